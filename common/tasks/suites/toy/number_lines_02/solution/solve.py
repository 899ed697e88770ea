"""Reference solution (number_lines); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "data.txt", "output": "out.txt"}


def read(rel):
    return Path(rel).read_text()


lines = read(P["input"]).splitlines()
out = "".join(f"{i}: {line}\n" for i, line in enumerate(lines, 1))
Path(P["output"]).write_text(out)
