"""Reference solution for `grade_stats`; run with the workspace as the current directory."""

import csv
import json
import statistics
from pathlib import Path

by_subject, by_student = {}, {}
for row in csv.DictReader(Path("grades.csv").read_text().splitlines()):
    by_subject.setdefault(row["subject"], []).append(int(row["score"]))
    by_student.setdefault(row["student"], []).append(int(row["score"]))
out = {
    "subjects": {
        s: {"mean": round(statistics.mean(v), 2), "median": statistics.median(v), "max": max(v)}
        for s, v in by_subject.items()
    },
    "best_student": max(by_student, key=lambda s: statistics.mean(by_student[s])),
}
Path("stats.json").write_text(json.dumps(out, indent=2))
