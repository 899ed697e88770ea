"""Reference solution (json_field); run with the workspace as the current directory."""

import json
from pathlib import Path

P = {"input": "info.json", "output": "result.txt", "key": "status"}


def read(rel):
    return Path(rel).read_text()


value = json.loads(read(P["input"]))[P["key"]]
out = f"{value}\n"
Path(P["output"]).write_text(out)
