"""Reference solution (count_files); run with the workspace as the current directory."""

import os
from pathlib import Path

P = {"dir": "records", "output": "result.txt"}


def read(rel):
    return Path(rel).read_text()


n = len(os.listdir(P["dir"]))
out = f"{n}\n"
Path(P["output"]).write_text(out)
