"""Reference solution for `launch_announcement`; run with the workspace as the current directory."""

from pathlib import Path

text = (
    "Join us for the launch of Aurora 2.0!\n\n"
    "Our new analytics dashboard goes live with a launch event on Friday, June 14 (2024-06-14). "
    "Doors open at 15:00 in the Main Hall, Building C (ground floor), and the live demo starts at 15:30. "
    "Everyone is welcome, partners too, and there will be snacks.\n\n"
    "Please RSVP to events@northwind.example by June 10 so we can plan catering.\n\n"
    "See you there!\n"
)
Path("announcement.txt").write_text(text)
