"""Reference solution (write_word); run with the workspace as the current directory."""

from pathlib import Path

P = {"output": "output.txt", "word": "cloud"}


def read(rel):
    return Path(rel).read_text()


out = P["word"] + "\n"
Path(P["output"]).write_text(out)
