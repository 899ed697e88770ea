"""Reference solution (reverse_lines); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "notes.txt", "output": "out.txt"}


def read(rel):
    return Path(rel).read_text()


out = "".join(line + "\n" for line in read(P["input"]).splitlines()[::-1])
Path(P["output"]).write_text(out)
