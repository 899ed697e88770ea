"""Reference solution for `pin_requirements`; run with the workspace as the current directory."""

import json
from pathlib import Path

lock = json.loads(Path("versions.lock.json").read_text())
out = []
for line in Path("requirements.txt").read_text().splitlines():
    name = line.strip()
    out.append(line if not name or name.startswith("#") else f"{name}=={lock[name]}")
Path("requirements.txt").write_text("\n".join(out) + "\n")
