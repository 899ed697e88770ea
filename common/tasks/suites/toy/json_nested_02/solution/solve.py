"""Reference solution (json_nested); run with the workspace as the current directory."""

import json
from pathlib import Path

P = {"input": "config.json", "output": "output.txt", "outer": "pet", "key": "status"}


def read(rel):
    return Path(rel).read_text()


value = json.loads(read(P["input"]))[P["outer"]][P["key"]]
out = f"{value}\n"
Path(P["output"]).write_text(out)
