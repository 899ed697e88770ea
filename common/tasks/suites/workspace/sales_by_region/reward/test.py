"""Checker for the `sales_by_region` task. Usage: python3 test.py WORKSPACE

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
data = load_json("summary.json")
ok = isinstance(data, dict)
m["valid_json"] = float(ok)
got = data.get("revenue_by_region") if ok else None
exp = EXP["revenue_by_region"]
m["revenue_by_region"] = float(
    isinstance(got, dict) and set(got) == set(exp) and all(close(got[k], v) for k, v in exp.items())
)
m["top_product"] = float(ok and str(data.get("top_product", "")).strip() == EXP["top_product"])
m["total_units"] = float(ok and close(data.get("total_units"), EXP["total_units"], 0))
# leaving sales.csv alone earns credit only alongside a summary (the untouched workspace does)
m["source_unchanged"] = float(ok and read("sales.csv") == EXP["sales_csv"])

print(json.dumps(m))
