"""Reference solution (first_line); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "data.txt", "output": "result.txt"}


def read(rel):
    return Path(rel).read_text()


out = read(P["input"]).splitlines()[0] + "\n"
Path(P["output"]).write_text(out)
