"""Checker for the `error_log_summary` task. Usage: python3 test.py WORKSPACE

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
data = load_json("errors.json")
ok = isinstance(data, dict)
m["valid_json"] = float(ok)
m["total_errors"] = float(ok and data.get("total_errors") == EXP["total"])
m["by_code"] = float(ok and data.get("by_code") == EXP["by_code"])
m["first_error_at"] = float(ok and data.get("first_error_at") == EXP["first"])

print(json.dumps(m))
