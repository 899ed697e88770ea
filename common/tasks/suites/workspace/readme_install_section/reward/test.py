"""Checker for the `readme_install_section` task. Usage: python3 test.py WORKSPACE

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
text = read("README.md") or ""
heads = [ln.strip() for ln in text.splitlines() if ln.startswith("## ")]
m["section_present"] = float("## Installation" in heads)
m["position_ok"] = float(
    "## Installation" in heads
    and heads.index("## Installation") > 0
    and heads[heads.index("## Installation") - 1] == "## Overview"
    and heads.index("## Installation") + 1 < len(heads)
    and heads[heads.index("## Installation") + 1] == "## Usage"
)
sec = re.search(r"^## Installation\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
block = re.search(r"```bash\n(.*?)```", sec.group(1), re.S) if sec else None
cmds = [c.strip() for c in block.group(1).splitlines() if c.strip()] if block else []
m["commands_in_bash_block"] = float(cmds == EXP["commands"])
kept = True
for name, body in EXP["sections"].items():
    s = re.search(rf"^## {name}\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
    kept = kept and bool(s) and s.group(1).strip() == body
# the untouched README keeps every section: this earns credit only with the new section added
m["other_sections_kept"] = float(
    kept and text.startswith("# tidyfiles") and bool(m["section_present"])
)

print(json.dumps(m))
