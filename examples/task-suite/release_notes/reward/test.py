"""Checker for `release_notes`. Usage: python3 test.py WORKSPACE

Prints one JSON dict of metrics in [0, 1]; every metric is 0 when RELEASE.md is missing or
empty. "No docs changes" earns credit only once a section is right, so an empty or untouched
workspace scores 0 on every metric.
"""

import json
import sys
from pathlib import Path

WS = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()
EXP = json.loads((Path(__file__).parent / "expected.json").read_text())


def sections(text):
    """``{heading: [bullet text, ...]}`` of the ``## `` sections of a Markdown text."""
    out, current = {}, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("## "):
            current = out.setdefault(s[3:].strip().lower(), [])
        elif s.startswith(("- ", "* ")) and current is not None:
            current.append(s[2:].strip())
    return out


try:
    text = (WS / "RELEASE.md").read_text()
except (OSError, UnicodeDecodeError):
    text = ""
found = sections(text)
features_ok = found.get("features") == EXP["features"]
fixes_ok = found.get("fixes") == EXP["fixes"]
leaked = any(d in text for d in EXP["left_out"])
print(
    json.dumps(
        {
            "features": float(features_ok),
            "fixes": float(fixes_ok),
            "no_docs_changes": float((features_ok or fixes_ok) and not leaked),
        }
    )
)
