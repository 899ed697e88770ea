"""Reference solution (count_word); run with the workspace as the current directory."""

import re
from pathlib import Path

P = {"input": "notes.txt", "output": "out.txt", "word": "pebble"}


def read(rel):
    return Path(rel).read_text()


word = P["word"]
n = len(re.findall(rf"\b{word}\b", read(P["input"])))
out = f"{n}\n"
Path(P["output"]).write_text(out)
