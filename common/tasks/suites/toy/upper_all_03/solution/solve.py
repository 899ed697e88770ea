"""Reference solution (upper_all); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "words.txt", "output": "output.txt"}


def read(rel):
    return Path(rel).read_text()


out = read(P["input"]).upper()
Path(P["output"]).write_text(out)
