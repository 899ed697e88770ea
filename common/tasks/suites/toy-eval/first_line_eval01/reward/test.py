"""Toy checker: is the output file written, and is it exactly right?

Usage: python3 test.py WORKSPACE. Prints {"written": 0|1, "correct": 0|1}. Lines are compared
without trailing whitespace and without blank lines at the start or end.
"""

import json
import sys
from pathlib import Path


def norm(text):
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


spec = json.loads((Path(__file__).parent / "expected.json").read_text())
ws = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
written = correct = 0.0
try:
    got = (ws / spec["output"]).read_text(errors="replace")
    written = 1.0 if got.strip() else 0.0
    correct = 1.0 if got.strip() and norm(got) == norm(spec["expected"]) else 0.0
except OSError:
    pass
print(json.dumps({"written": written, "correct": correct}))
