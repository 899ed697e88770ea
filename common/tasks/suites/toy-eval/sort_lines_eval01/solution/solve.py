"""Reference solution (sort_lines); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "input.txt", "output": "answer.txt"}


def read(rel):
    return Path(rel).read_text()


out = "".join(line + "\n" for line in sorted(read(P["input"]).splitlines()))
Path(P["output"]).write_text(out)
