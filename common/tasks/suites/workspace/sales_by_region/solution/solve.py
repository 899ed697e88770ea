"""Reference solution for `sales_by_region`; run with the workspace as the current directory."""

import csv
import json
from pathlib import Path

rev, prod, units = {}, {}, 0
for row in csv.DictReader(Path("sales.csv").read_text().splitlines()):
    value = int(row["units"]) * float(row["unit_price"])
    rev[row["region"]] = rev.get(row["region"], 0) + value
    prod[row["product"]] = prod.get(row["product"], 0) + value
    units += int(row["units"])
summary = {
    "revenue_by_region": {k: round(v, 2) for k, v in rev.items()},
    "top_product": max(prod, key=prod.get),
    "total_units": units,
}
Path("summary.json").write_text(json.dumps(summary, indent=2))
