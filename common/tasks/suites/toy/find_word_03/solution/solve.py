"""Reference solution (find_word); run with the workspace as the current directory."""

import os
import re
from pathlib import Path

P = {"dir": "records", "output": "out.txt", "word": "candle"}


def read(rel):
    return Path(rel).read_text()


word = P["word"]
names = sorted(os.listdir(P["dir"]))
hits = [n for n in names if re.search(rf"\b{word}\b", read(os.path.join(P["dir"], n)))]
out = hits[0] + "\n"
Path(P["output"]).write_text(out)
