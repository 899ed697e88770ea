"""Reference solution (copy); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "data.txt", "output": "output.txt"}


def read(rel):
    return Path(rel).read_text()


out = read(P["input"])
Path(P["output"]).write_text(out)
