"""Reference solution (json_collect); run with the workspace as the current directory."""

import json
import os
from pathlib import Path

P = {"dir": "parts", "output": "output.txt", "key": "name"}


def read(rel):
    return Path(rel).read_text()


names = sorted(n for n in os.listdir(P["dir"]) if n.endswith(".json"))
values = [json.loads(read(os.path.join(P["dir"], n)))[P["key"]] for n in names]
out = "".join(f"{v}\n" for v in values)
Path(P["output"]).write_text(out)
