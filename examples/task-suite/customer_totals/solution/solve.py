"""Reference solution for `customer_totals`; run with the workspace as the current directory."""

import csv
from collections import defaultdict
from pathlib import Path

totals = defaultdict(float)
for row in csv.DictReader(Path("orders.csv").read_text().splitlines()):
    totals[row["customer"]] += float(row["amount"])
with open("totals.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["customer", "total"])
    for customer, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        w.writerow([customer, f"{total:.2f}"])
