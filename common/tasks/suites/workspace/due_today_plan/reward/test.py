"""Checker for the `due_today_plan` task. Usage: python3 test.py WORKSPACE

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
text = read("today.md") or ""
bullets = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("-")]
exp = EXP["lines"]
m["format_ok"] = float(
    bool(bullets) and all(re.match(r"^- \[(high|medium|low)\] \S", b) for b in bullets)
)
m["includes_all_due"] = float(all(e in bullets for e in exp))
m["excludes_others"] = float(
    bool(bullets) and not any(o.lower() in text.lower() for o in EXP["others"])
)
m["ordered"] = float(bullets == exp)

print(json.dumps(m))
