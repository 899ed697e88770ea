"""Checker for the `expense_report` task. Usage: python3 test.py WORKSPACE

Prints a JSON dict of metrics in [0, 1]. Every metric is 0 when the file it judges is missing,
empty or unreadable; expected values live in expected.json beside this file.
"""

import json
import re
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
text = read("report.md") or ""
lines = [ln.strip() for ln in text.splitlines()]
head = [i for i, ln in enumerate(lines) if re.match(r"^\|\s*Category\s*\|\s*Total\s*\|$", ln)]
m["has_table"] = float(
    bool(head) and head[0] + 1 < len(lines) and set(lines[head[0] + 1]) <= set("|-: ")
)
rows = []
for ln in lines[head[0] + 2 :] if head else []:
    cells = [c.strip() for c in ln.strip("|").split("|")] if ln.startswith("|") else []
    if len(cells) != 2:
        break
    rows.append(cells)
got = {}
for name, value in rows:
    try:
        got[name] = float(value.replace(",", "").lstrip("$"))
    except ValueError:
        got[name] = None
tot = EXP["totals"]
m["category_totals"] = float(set(got) == set(tot) and all(close(got[k], v) for k, v in tot.items()))
m["sorted_desc"] = float(m["category_totals"] == 1 and [r[0] for r in rows] == EXP["order"])
g = re.search(r"\*\*Grand total:\s*\$?([0-9,]+\.[0-9]{2})\*\*", text)
m["grand_total"] = float(bool(g) and close(g.group(1).replace(",", ""), EXP["grand"]))

print(json.dumps(m))
