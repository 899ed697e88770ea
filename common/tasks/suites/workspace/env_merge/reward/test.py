"""Checker for the `env_merge` task. Usage: python3 test.py WORKSPACE

Prints a JSON dict of metrics in [0, 1]. Every metric is 0 when the file it judges is missing,
empty or unreadable; expected values live in expected.json beside this file.
"""

import configparser
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
text = read("config/local.ini")
cp = configparser.ConfigParser()
try:
    cp.read_string(text or "")
    parsed = text is not None
except configparser.Error:
    parsed = False
got = {s: dict(cp[s]) for s in cp.sections()} if parsed else {}
exp = EXP["merged"]
# every other metric earns credit only once a missing key was added (the untouched files are
# valid, keep the local values and leave the defaults alone, and must score 0)
local = EXP["local_values"]
added = any(k in got.get(s, {}) for s in exp for k in exp[s] if k not in local.get(s, {}))
m["valid_ini"] = float(added and bool(cp.sections()))
m["missing_keys_added"] = float(all(k in got.get(s, {}) for s in exp for k in exp[s]))
m["local_values_kept"] = float(
    added
    and all(
        got.get(s, {}).get(k) == v for s, kv in EXP["local_values"].items() for k, v in kv.items()
    )
)
m["exact_merge"] = float(got == exp)
m["defaults_unchanged"] = float(added and read("config/defaults.ini") == EXP["defaults"])

print(json.dumps(m))
