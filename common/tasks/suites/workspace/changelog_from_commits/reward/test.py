"""Checker for the `changelog_from_commits` task. Usage: python3 test.py WORKSPACE

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
text = read("CHANGELOG.md") or ""
m["version_heading"] = float(bool(re.search(r"^## v1\.4\.0\s*$", text, re.M)))


def section(name):
    s = re.search(rf"^### {name}\s*$(.*?)(?=^#|\Z)", text, re.S | re.M)
    return (
        [ln.strip()[2:].strip() for ln in s.group(1).splitlines() if ln.strip().startswith("- ")]
        if s
        else None
    )


m["features_listed"] = float(section("Features") == EXP["features"])
m["fixes_listed"] = float(section("Bug Fixes") == EXP["fixes"])
m["others_excluded"] = float(
    section("Features") is not None and not any(x.lower() in text.lower() for x in EXP["excluded"])
)

print(json.dumps(m))
