"""Checker for the `markdown_table_to_json` task. Usage: python3 test.py WORKSPACE

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
data = load_json("pricing.json")
exp = EXP["plans"]
ok = isinstance(data, list) and len(data) == len(exp) and all(isinstance(p, dict) for p in data)
m["valid_json"] = float(isinstance(data, list) and bool(data))
m["plans_ok"] = float(ok and [p.get("plan") for p in data] == [e["plan"] for e in exp])
m["prices_ok"] = float(
    ok
    and all(
        isinstance(p.get("price"), (int, float)) and close(p["price"], e["price"])
        for p, e in zip(data, exp, strict=False)
    )
)
m["seats_ok"] = float(
    ok and all(p.get("seats", "missing") == e["seats"] for p, e in zip(data, exp, strict=False))
)
m["support_ok"] = float(ok and [p.get("support") for p in data] == [e["support"] for e in exp])

print(json.dumps(m))
