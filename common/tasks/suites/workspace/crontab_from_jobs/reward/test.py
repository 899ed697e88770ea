"""Checker for the `crontab_from_jobs` task. Usage: python3 test.py WORKSPACE

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
text = read("crontab.txt") or ""
lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
exp = EXP["lines"]
parsed = []
for ln in lines:
    body, _, name = ln.partition("#")
    f = body.split(None, 5)
    parsed.append((" ".join(f[:5]), f[5].strip() if len(f) == 6 else "", name.strip()))
m["line_count"] = float(len(lines) == len(exp))
m["schedules_ok"] = float(
    len(parsed) == len(exp) and all(p[0] == e[0] for p, e in zip(parsed, exp, strict=False))
)
m["commands_ok"] = float(
    len(parsed) == len(exp) and all(p[1] == e[1] for p, e in zip(parsed, exp, strict=False))
)
m["names_ok"] = float(
    len(parsed) == len(exp) and all(p[2] == e[2] for p, e in zip(parsed, exp, strict=False))
)

print(json.dumps(m))
