"""Checker for the `inventory_json_to_csv` task. Usage: python3 test.py WORKSPACE

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
text = read("inventory.csv")
rows = list(csv.reader(io.StringIO(text))) if text else []
m["header_ok"] = float(bool(rows) and rows[0] == ["sku", "name", "qty", "low_stock"])
body = [r for r in rows[1:] if r] if m["header_ok"] else []
exp = EXP["rows"]
by_sku = {r[0]: r for r in body if len(r) == 4}
m["all_items"] = float(set(by_sku) == {r[0] for r in exp} and len(body) == len(exp))
m["qty_correct"] = float(m["all_items"] == 1 and all(by_sku[r[0]][2].strip() == r[2] for r in exp))
m["low_stock_correct"] = float(
    m["all_items"] == 1 and all(by_sku[r[0]][3].strip().lower() == r[3] for r in exp)
)
m["sorted_by_sku"] = float(m["all_items"] == 1 and [r[0] for r in body] == [r[0] for r in exp])

print(json.dumps(m))
