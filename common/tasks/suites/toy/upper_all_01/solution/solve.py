"""Reference solution (upper_all); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "input.txt", "output": "out.txt"}


def read(rel):
    return Path(rel).read_text()


out = read(P["input"]).upper()
Path(P["output"]).write_text(out)
