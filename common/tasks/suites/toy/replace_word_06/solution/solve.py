"""Reference solution (replace_word); run with the workspace as the current directory."""

import re
from pathlib import Path

P = {"input": "list.txt", "output": "output.txt", "word": "lemon", "new": "silver"}


def read(rel):
    return Path(rel).read_text()


word = P["word"]
out = re.sub(rf"\b{word}\b", P["new"], read(P["input"]))
Path(P["output"]).write_text(out)
