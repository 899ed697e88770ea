"""Reference solution for `env_merge`; run with the workspace as the current directory."""

import configparser
from pathlib import Path

d = configparser.ConfigParser()
d.read("config/defaults.ini")
text = Path("config/local.ini").read_text()
local = configparser.ConfigParser()
local.read_string(text)
for section in d.sections():
    if not local.has_section(section):
        local.add_section(section)
    for key, value in d[section].items():
        if not local.has_option(section, key):
            local.set(section, key, value)
with open("config/local.ini", "w") as f:
    local.write(f)
