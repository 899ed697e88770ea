"""Checker for the `dedupe_contacts` task. Usage: python3 test.py WORKSPACE

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
text = read("contacts_clean.csv")
rows = list(csv.reader(io.StringIO(text))) if text else []
m["header_ok"] = float(bool(rows) and rows[0] == EXP["header"])
body = [r for r in rows[1:] if r] if m["header_ok"] else []
exp = EXP["rows"]
well_formed = all(len(r) == 4 for r in body)
body = [r for r in body if len(r) == 4]
emails = [r[2] for r in body]
m["no_duplicates"] = float(bool(body) and len({e.lower() for e in emails}) == len(body))
m["all_people_kept"] = float({e.lower() for e in emails} == {r[2] for r in exp})
m["first_occurrence_kept"] = float(sorted(map(tuple, body)) == sorted(map(tuple, exp)))
m["emails_lowercase"] = float(bool(emails) and all(e == e.lower() for e in emails))
m["sorted"] = float(
    bool(body)
    and well_formed
    and body == sorted(body, key=lambda r: (r[1], r[0]))
    and len(body) == len(exp)
)

print(json.dumps(m))
