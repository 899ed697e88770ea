"""Reference solution for `error_log_summary`; run with the workspace as the current directory."""

import json
import re
from pathlib import Path

total, by_code, first = 0, {}, None
for line in Path("logs/server.log").read_text().splitlines():
    parts = line.split()
    if len(parts) > 1 and parts[1] == "ERROR":
        total += 1
        first = first or parts[0]
        code = re.search(r"\[(E\d+)\]", line)
        if code:
            by_code[code.group(1)] = by_code.get(code.group(1), 0) + 1
out = {"total_errors": total, "by_code": by_code, "first_error_at": first}
Path("errors.json").write_text(json.dumps(out, indent=2))
