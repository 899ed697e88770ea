"""Checker for the `pin_requirements` task. Usage: python3 test.py WORKSPACE

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
text = read("requirements.txt") or ""
lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
exp = EXP["lines"]
pkgs = [ln for ln in lines if not ln.startswith("#")]
exp_pkgs = [ln for ln in exp if not ln.startswith("#")]
m["all_pinned"] = float(bool(pkgs) and all(p in pkgs for p in exp_pkgs))
# keeping comments and adding nothing earn credit only once something is pinned (the untouched
# file keeps both, and must score 0)
pinned = any(p in pkgs for p in exp_pkgs)
m["comments_kept"] = float(pinned and all(c in lines for c in exp if c.startswith("#")))
m["no_extra_packages"] = float(pinned and len(pkgs) == len(exp_pkgs))
m["order_kept"] = float(lines == exp)

print(json.dumps(m))
