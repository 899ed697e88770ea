"""Reference solution (sum_files); run with the workspace as the current directory."""

import os
from pathlib import Path

P = {"dir": "docs", "output": "result.txt"}


def read(rel):
    return Path(rel).read_text()


n = sum(int(read(os.path.join(P["dir"], name))) for name in os.listdir(P["dir"]))
out = f"{n}\n"
Path(P["output"]).write_text(out)
