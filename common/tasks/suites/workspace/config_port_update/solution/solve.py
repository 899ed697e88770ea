"""Reference solution for `config_port_update`; run with the workspace as the current directory."""

import json
from pathlib import Path

cfg = json.loads(Path("config/app.json").read_text())
cfg["server"]["port"] = 9090
cfg["debug"] = False
if "metrics" not in cfg["features"]:
    cfg["features"].append("metrics")
Path("config/app.json").write_text(json.dumps(cfg, indent=2) + "\n")
