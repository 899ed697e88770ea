"""Checker for the `launch_announcement` task. Usage: python3 test.py WORKSPACE

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
text = read("announcement.txt")
t = text or ""
low = t.lower()
words = len(t.split())
# a missing, empty or off-topic text is not "an announcement under 120 words": the limit and
# the pricing rule earn credit only for a text that names the product
on_topic = "aurora" in low
m["word_limit"] = float(on_topic and 0 < words < EXP["max_words"])
m["product_named"] = float("aurora 2.0" in low)
m["date_given"] = float(bool(re.search(r"2024-06-14|june\s+14|14\s+june|14/06|06/14", low)))
m["time_given"] = float(bool(re.search(r"15[:.]00|3(:00)?\s*(pm|p\.m\.)", low)))
m["location_given"] = float("main hall" in low and "building c" in low)
m["rsvp_given"] = float("events@northwind.example" in low)
m["no_pricing"] = float(on_topic and not re.search(r"pric|\$\s*\d|cost", low))

print(json.dumps(m))
