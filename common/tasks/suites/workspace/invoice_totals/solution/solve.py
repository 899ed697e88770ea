"""Reference solution for `invoice_totals`; run with the workspace as the current directory."""

import csv
import json
import os
from pathlib import Path

totals = {}
n = 0
for name in sorted(os.listdir("invoices")):
    if not name.endswith(".json"):
        continue
    inv = json.loads(Path(os.path.join("invoices", name)).read_text())
    sub = sum(i["qty"] * i["price"] for i in inv["items"])
    t = totals.setdefault(inv["customer"], [0, 0.0])
    t[0] += 1
    t[1] += sub * (1 + inv["tax_rate"])
    n += 1
rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
with open("totals.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["customer", "invoice_count", "total"])
    for cust, (count, total) in rows:
        w.writerow([cust, count, f"{total:.2f}"])
    w.writerow(["ALL", n, f"{sum(t for _, t in totals.values()):.2f}"])
