"""Reference solution for `sort_notes_by_tag`; run with the workspace as the current directory."""

import os
from pathlib import Path

for name in sorted(os.listdir("notes")):
    path = os.path.join("notes", name)
    if not name.endswith(".md") or not os.path.isfile(path):
        continue
    tag = Path(path).read_text().splitlines()[0].split(":", 1)[1].strip()
    os.makedirs(os.path.join("notes", tag), exist_ok=True)
    os.rename(path, os.path.join("notes", tag, name))
