"""Reference solution (concat_dir); run with the workspace as the current directory."""

import os
from pathlib import Path

P = {"dir": "docs", "output": "out.txt"}


def read(rel):
    return Path(rel).read_text()


names = sorted(n for n in os.listdir(P["dir"]) if n.endswith(".txt"))
out = "".join(read(os.path.join(P["dir"], n)) for n in names)
Path(P["output"]).write_text(out)
