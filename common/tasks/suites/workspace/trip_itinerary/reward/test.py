"""Checker for the `trip_itinerary` task. Usage: python3 test.py WORKSPACE

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
text = read("itinerary.md")
t = text or ""
heads = re.findall(r"^## Day (\d+) [-\u2013\u2014] (\d{4}-\d{2}-\d{2})\s*$", t, re.M)
exp = EXP["days"]
m["day_headings"] = float(heads == [(str(i), d) for i, d in enumerate(exp, 1)])
days = re.split(r"^## Day \d+.*$", t, flags=re.M)[1:]
first = days[0] if days else ""
last = days[-1] if len(days) == len(exp) else ""
m["arrival_flight_day1"] = float("LH 1234" in first)
m["hotel_on_checkin"] = float("Hotel Isarblick" in first and "IB-88213" in first)
m["return_flight_last_day"] = float("LH 4321" in last)
# the limit earns credit only for an itinerary with day headings (not for any short text)
m["word_limit"] = float(bool(heads) and 0 < len(t.split()) < EXP["max_words"])

print(json.dumps(m))
