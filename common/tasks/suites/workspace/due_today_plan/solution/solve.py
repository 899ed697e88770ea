"""Reference solution for `due_today_plan`; run with the workspace as the current directory."""

import json
from pathlib import Path

rank = {"high": 0, "medium": 1, "low": 2}
tasks = [
    t
    for t in json.loads(Path("tasks.json").read_text())
    if not t["done"] and t["due"] <= "2024-05-10"
]
tasks.sort(key=lambda t: (rank[t["priority"]], t["due"]))
Path("today.md").write_text("".join(f"- [{t['priority']}] {t['title']}\n" for t in tasks))
