"""Reference solution for `budget_variance`; run with the workspace as the current directory."""

import csv
from pathlib import Path

rows = list(csv.DictReader(Path("budget.csv").read_text().splitlines()))
with open("variance.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["department", "planned", "actual", "variance", "variance_pct", "flag"])
    for r in rows:
        planned, actual = float(r["planned"]), float(r["actual"])
        var = actual - planned
        pct = round(var / planned * 100, 1)
        w.writerow(
            [
                r["department"],
                r["planned"],
                r["actual"],
                f"{var:.2f}",
                pct,
                "OVER" if pct > 10 else "",
            ]
        )
