"""Reference solution (sum_numbers); run with the workspace as the current directory."""

from pathlib import Path

P = {"input": "list.txt", "output": "output.txt"}


def read(rel):
    return Path(rel).read_text()


n = sum(int(x) for x in read(P["input"]).split())
out = f"{n}\n"
Path(P["output"]).write_text(out)
