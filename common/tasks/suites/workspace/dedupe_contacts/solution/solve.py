"""Reference solution for `dedupe_contacts`; run with the workspace as the current directory."""

import csv
from pathlib import Path

rows = list(csv.reader(Path("contacts.csv").read_text().splitlines()))
header, seen, keep = rows[0], set(), []
for first, last, email, phone in rows[1:]:
    if email.lower() not in seen:
        seen.add(email.lower())
        keep.append([first, last, email.lower(), phone])
keep.sort(key=lambda r: (r[1], r[0]))
with open("contacts_clean.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(header)
    w.writerows(keep)
