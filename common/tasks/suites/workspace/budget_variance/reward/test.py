"""Checker for the `budget_variance` task. Usage: python3 test.py WORKSPACE

Prints a JSON dict of metrics in [0, 1]. Every metric is 0 when the file it judges is missing,
empty or unreadable; expected values live in expected.json beside this file.
"""

import csv
import io
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
text = read("variance.csv")
rows = list(csv.reader(io.StringIO(text))) if text else []
head = ["department", "planned", "actual", "variance", "variance_pct", "flag"]
m["header_ok"] = float(bool(rows) and [c.strip() for c in rows[0]] == head)
body = [r for r in rows[1:] if r] if m["header_ok"] else []
exp = EXP["rows"]
shaped = len(body) == len(exp) and all(
    len(r) == 6 and r[0] == e[0] for r, e in zip(body, exp, strict=False)
)
m["variance_ok"] = float(shaped and all(close(r[3], e[3]) for r, e in zip(body, exp, strict=False)))
m["pct_ok"] = float(
    shaped and all(close(r[4], e[4], 0.051) for r, e in zip(body, exp, strict=False))
)
m["flags_ok"] = float(shaped and all(r[5].strip() == e[5] for r, e in zip(body, exp, strict=False)))

print(json.dumps(m))
