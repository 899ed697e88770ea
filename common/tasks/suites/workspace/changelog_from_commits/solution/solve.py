"""Reference solution for `changelog_from_commits`; run with the workspace as the current directory."""

import re
from pathlib import Path

feats, fixes = [], []
for line in Path("commits.txt").read_text().splitlines():
    m = re.match(r"^(\w+)(\([^)]*\))?: (.+)$", line)
    if m and m.group(1) == "feat":
        feats.append(m.group(3))
    elif m and m.group(1) == "fix":
        fixes.append(m.group(3))
out = ["# Changelog", "", "## v1.4.0", "", "### Features", ""]
out += [f"- {f}" for f in feats]
out += ["", "### Bug Fixes", ""]
out += [f"- {f}" for f in fixes]
Path("CHANGELOG.md").write_text("\n".join(out) + "\n")
