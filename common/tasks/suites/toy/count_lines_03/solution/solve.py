"""Reference solution (count_lines); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "input.txt", "output": "result.txt"}


def read(rel):
    return Path(rel).read_text()


n = len(read(P["input"]).splitlines())
out = f"{n}\n"
Path(P["output"]).write_text(out)
