"""Reference solution for `meeting_action_items`; run with the workspace as the current directory."""

import re
from pathlib import Path

out = []
for line in Path("meeting_notes.txt").read_text().splitlines():
    m = re.match(r"ACTION: (\w+) to (.+) by (\d{4}-\d{2}-\d{2})", line.strip())
    if m:
        out.append(f"- [ ] {m.group(1)}: {m.group(2)} (due {m.group(3)})")
Path("action_items.md").write_text("\n".join(out) + "\n")
