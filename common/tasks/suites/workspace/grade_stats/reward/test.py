"""Checker for the `grade_stats` task. Usage: python3 test.py WORKSPACE

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
data = load_json("stats.json")
ok = isinstance(data, dict) and isinstance(data.get("subjects"), dict)
m["valid_json"] = float(ok)
got = data["subjects"] if ok else {}
exp = EXP["subjects"]
same_keys = set(got) == set(exp) and all(isinstance(got[k], dict) for k in exp)
for stat in ("mean", "median", "max"):
    m[stat] = float(same_keys and all(close(got[k].get(stat), exp[k][stat]) for k in exp))
m["best_student"] = float(ok and data.get("best_student") == EXP["best_student"])

print(json.dumps(m))
