"""Reference solution for `readme_install_section`; run with the workspace as the current directory."""

from pathlib import Path

steps = Path("install_steps.txt").read_text().strip()
readme = Path("README.md").read_text()
section = "## Installation\n\n```bash\n" + steps + "\n```\n\n"
readme = readme.replace("## Usage\n", section + "## Usage\n", 1)
Path("README.md").write_text(readme)
