"""Reference solution for `crontab_from_jobs`; run with the workspace as the current directory."""

import json
from pathlib import Path

days = ["sunday", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday"]
out = []
for job in json.loads(Path("jobs.json").read_text()):
    s = job["schedule"]
    if s["every"] == "hour":
        spec = f"{s['minute']} * * * *"
    else:
        hour, minute = (int(x) for x in s["at"].split(":"))
        dom = s.get("day_of_month", "*") if s["every"] == "month" else "*"
        dow = days.index(s["day"]) if s["every"] == "week" else "*"
        spec = f"{minute} {hour} {dom} * {dow}"
    out.append(f"{spec} {job['command']} # {job['name']}")
Path("crontab.txt").write_text("\n".join(out) + "\n")
