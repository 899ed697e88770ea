"""Reference solution for `calendar_conflicts`; run with the workspace as the current directory."""

import json
from pathlib import Path

ev = json.loads(Path("calendar.json").read_text())
pairs = []
for i, a in enumerate(ev):
    for b in ev[i + 1 :]:
        if a["start"] < b["end"] and b["start"] < a["end"]:
            x, y = sorted((a["id"], b["id"]))
            pairs.append(f"{x} <-> {y}")
Path("conflicts.txt").write_text("".join(p + "\n" for p in sorted(pairs)))
