"""Checker for the `meeting_action_items` task. Usage: python3 test.py WORKSPACE

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
text = read("action_items.md") or ""
pat = re.compile(r"^- \[ \] (\w+): (.+) \(due (\d{4}-\d{2}-\d{2})\)$")
bullets = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("- [")]
parsed = [pat.match(b) for b in bullets]
exp = EXP["items"]
m["format_ok"] = float(bool(bullets) and all(parsed))
good = [p.groups() for p in parsed if p]
m["item_count"] = float(len(bullets) == len(exp))
m["owners_in_order"] = float([g[0] for g in good] == [e["owner"] for e in exp])
m["due_dates"] = float(
    len(good) == len(exp) and all(g[2] == e["due"] for g, e in zip(good, exp, strict=False))
)


def words(s):
    return set(re.findall(r"[a-z0-9]+", s.lower()))


m["tasks_described"] = float(
    len(good) == len(exp)
    and all(
        len(words(g[1]) & words(e["task"])) >= 0.6 * len(words(e["task"]))
        for g, e in zip(good, exp, strict=False)
    )
)

print(json.dumps(m))
