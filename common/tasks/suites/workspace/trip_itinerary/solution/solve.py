"""Reference solution for `trip_itinerary`; run with the workspace as the current directory."""

import datetime
import json
from pathlib import Path

fl = json.loads(Path("flights.json").read_text())
ho = json.loads(Path("hotel.json").read_text())
start = datetime.date.fromisoformat(fl["outbound"]["date"])
end = datetime.date.fromisoformat(fl["return"]["date"])
out = ["# Munich trip", ""]
n = (end - start).days
for i in range(n + 1):
    day = start + datetime.timedelta(days=i)
    out.append(f"## Day {i + 1} - {day.isoformat()}")
    if i == 0:
        ob = fl["outbound"]
        out.append(f"- Arrive in {ob['to']} on {ob['flight']} at {ob['arrives']}")
        out.append(
            f"- Check in at {ho['name']} ({ho['address']}), confirmation {ho['confirmation']}"
        )
    elif i == n:
        rt = fl["return"]
        out.append(f"- Check out of {ho['name']}")
        out.append(f"- Fly home on {rt['flight']} departing {rt['departs']}")
    else:
        out.append("- Free day to explore the city")
    out.append("")
Path("itinerary.md").write_text("\n".join(out))
