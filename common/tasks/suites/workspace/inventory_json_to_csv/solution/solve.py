"""Reference solution for `inventory_json_to_csv`; run with the workspace as the current directory."""

import csv
import json
from pathlib import Path

items = sorted(json.loads(Path("inventory.json").read_text()), key=lambda i: i["sku"])
with open("inventory.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["sku", "name", "qty", "low_stock"])
    for i in items:
        w.writerow([i["sku"], i["name"], i["qty"], "yes" if i["qty"] < 10 else "no"])
