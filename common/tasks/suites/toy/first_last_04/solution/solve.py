"""Reference solution (first_last); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "words.txt", "output": "out.txt"}


def read(rel):
    return Path(rel).read_text()


lines = read(P["input"]).splitlines()
out = lines[0] + "\n" + lines[-1] + "\n"
Path(P["output"]).write_text(out)
