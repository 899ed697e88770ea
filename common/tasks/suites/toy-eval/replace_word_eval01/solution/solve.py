"""Reference solution (replace_word); run with the workspace as the current directory."""

import re
from pathlib import Path

P = {"input": "list.txt", "output": "answer.txt", "word": "stone", "new": "copper"}


def read(rel):
    return Path(rel).read_text()


word = P["word"]
out = re.sub(rf"\b{word}\b", P["new"], read(P["input"]))
Path(P["output"]).write_text(out)
