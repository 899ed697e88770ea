"""Reference solution for `customer_reply`; run with the workspace as the current directory."""

from pathlib import Path

text = (
    "Hi Dana,\n\n"
    "Thank you for reaching out, and I'm sorry your standing desk (order #4521) is taking so long. "
    "The shipment was delayed with our carrier FreightCo, and the new delivery date is July 22, 2024 "
    "(2024-07-22). We will keep an eye on it and let you know if anything changes.\n\n"
    "We apologise for the inconvenience while you set up your home office.\n\n"
    "Best regards,\n"
    "Support Team\n"
)
Path("reply.txt").write_text(text)
