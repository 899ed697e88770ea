"""Checker for the `survey_top_words` task. Usage: python3 test.py WORKSPACE

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
data = load_json("top_words.json")
ok = (
    isinstance(data, list)
    and len(data) == 5
    and all(isinstance(p, list) and len(p) == 2 for p in data)
)
m["valid_json"] = float(ok)
exp = EXP["top"]
m["words_ok"] = float(ok and [str(p[0]).lower() for p in data] == [e[0] for e in exp])
m["counts_ok"] = float(ok and [p[1] for p in data] == [e[1] for e in exp])

print(json.dumps(m))
