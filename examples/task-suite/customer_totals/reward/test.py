"""Checker for `customer_totals`. Usage: python3 test.py WORKSPACE

Prints one JSON dict of metrics in [0, 1]. A metric is 0 when the file it judges is missing,
empty or unreadable; the expected rows live in expected.json beside this file, never in the
workspace.
"""

import csv
import io
import json
import sys
from pathlib import Path

WS = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
EXPECTED = json.loads((Path(__file__).parent / "expected.json").read_text())["rows"]


def rows(rel):
    """The CSV rows of a workspace file, or [] when it is missing, unreadable or empty."""
    try:
        text = (WS / rel).read_text()
    except (OSError, UnicodeDecodeError):
        return []
    return [r for r in csv.reader(io.StringIO(text)) if r]


def same_amount(a, b):
    try:
        return abs(float(a) - float(b)) < 0.005
    except ValueError:
        return False


got = rows("totals.csv")
header_ok = bool(got) and [c.strip() for c in got[0]] == ["customer", "total"]
body = got[1:] if header_ok else []
customers_ok = [r[0].strip() for r in body] == [e[0] for e in EXPECTED]
totals_ok = customers_ok and all(
    len(r) == 2 and same_amount(r[1], e[1]) for r, e in zip(body, EXPECTED, strict=True)
)
print(
    json.dumps(
        {
            "header": float(header_ok),
            "customers_in_order": float(customers_ok),
            "totals": float(totals_ok),
        }
    )
)
