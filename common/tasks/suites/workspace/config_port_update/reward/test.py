"""Checker for the `config_port_update` task. Usage: python3 test.py WORKSPACE

Prints a JSON dict of metrics in [0, 1]. Every metric is 0 when the file it judges is missing,
empty or unreadable; expected values live in expected.json beside this file.
"""

import json
import sys
from pathlib import Path

WS = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
EXP = json.loads((Path(__file__).parent / "expected.json").read_text())


def read(rel):
    """The text of a workspace file, or None when it is missing, unreadable or empty."""
    try:
        text = (WS / rel).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def load_json(rel):
    text = read(rel)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def close(a, b, tol=0.011):
    try:
        return abs(float(a) - float(b)) <= tol
    except (TypeError, ValueError):
        return False


m = {}
data = load_json("config/app.json")
ok = isinstance(data, dict)
server = data.get("server") if ok else None
m["port_updated"] = float(isinstance(server, dict) and server.get("port") == 9090)
m["debug_off"] = float(ok and data.get("debug") is False)
feats = data.get("features") if ok else None
orig = EXP["original"]
m["metrics_enabled"] = float(
    isinstance(feats, list)
    and feats.count("metrics") == 1
    and all(f in feats for f in orig["features"])
    and len(feats) == len(orig["features"]) + 1
)
# validity and "the rest is unchanged" earn credit only once a requested change is made:
# the untouched file is valid and unchanged, and must score 0
changed = bool(m["port_updated"] or m["debug_off"] or m["metrics_enabled"])
m["valid_json"] = float(ok and changed)
same = ok and changed and isinstance(server, dict)
if same:
    rest = {k: v for k, v in data.items() if k not in ("debug", "features", "server")}
    orig_rest = {k: v for k, v in orig.items() if k not in ("debug", "features", "server")}
    srv = {k: v for k, v in server.items() if k != "port"}
    orig_srv = {k: v for k, v in orig["server"].items() if k != "port"}
    same = rest == orig_rest and srv == orig_srv
m["rest_unchanged"] = float(same)

print(json.dumps(m))
