"""Checker for the `customer_reply` task. Usage: python3 test.py WORKSPACE

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
text = read("reply.txt")
t = text or ""
low = t.lower()
m["greets_by_name"] = float(bool(re.search(r"\b(dear|hi|hello)\s+dana\b", low)))
m["order_number"] = float("4521" in t)
m["apology"] = float(bool(re.search(r"\b(sorry|apologi[sz]e|apologies)\b", low)))
m["delivery_date"] = float(bool(re.search(r"2024-07-22|july\s+22|22\s+july", low)))
m["carrier"] = float("freightco" in low)
# the limit earns credit only for a reply about this order (not for any short text)
m["word_limit"] = float("4521" in t and 0 < len(t.split()) < EXP["max_words"])
lines = [ln.strip() for ln in t.splitlines() if ln.strip()]
m["signature"] = float(bool(lines) and lines[-1].rstrip(".,!") == "Support Team")

print(json.dumps(m))
