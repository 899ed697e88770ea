"""Checker for the `invoice_totals` task. Usage: python3 test.py WORKSPACE

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
text = read("totals.csv")
rows = [r for r in csv.reader(io.StringIO(text))] if text else []
m["header_ok"] = float(
    bool(rows) and [c.strip() for c in rows[0]] == ["customer", "invoice_count", "total"]
)
body = [r for r in rows[1:] if r] if m["header_ok"] else []
main = [r for r in body if r and r[0] != "ALL"]
exp = EXP["rows"]
got = {r[0]: r for r in main if len(r) == 3}
m["customer_totals"] = float(
    len(main) == len(exp)
    and all(
        e[0] in got and got[e[0]][1].strip() == str(e[1]) and close(got[e[0]][2], e[2]) for e in exp
    )
)
m["sorted_desc"] = float(bool(main) and [r[0] for r in main] == [e[0] for e in exp])
last = body[-1] if body else []
m["grand_total_row"] = float(
    len(last) == 3
    and last[0] == "ALL"
    and last[1].strip() == str(EXP["count"])
    and close(last[2], EXP["grand"])
)

print(json.dumps(m))
