"""Reference solution for `markdown_table_to_json`; run with the workspace as the current directory."""

import json
from pathlib import Path

rows = [ln for ln in Path("pricing.md").read_text().splitlines() if ln.startswith("|")]
plans = []
for ln in rows[2:]:
    plan, price, seats, support = [c.strip() for c in ln.strip("|").split("|")]
    plans.append(
        {
            "plan": plan,
            "price": float(price),
            "seats": None if seats == "Unlimited" else int(seats),
            "support": support,
        }
    )
Path("pricing.json").write_text(json.dumps(plans, indent=2))
