"""Reference solution (upper_word); run with the workspace as the current directory."""

import re
from pathlib import Path

P = {"input": "words.txt", "output": "output.txt", "word": "thunder"}


def read(rel):
    return Path(rel).read_text()


word = P["word"]
out = re.sub(rf"\b{word}\b", word.upper(), read(P["input"]))
Path(P["output"]).write_text(out)
