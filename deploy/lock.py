"""Write ``deploy/constraints.txt``: the exact versions of the environment CI tests.

    .venv/bin/python deploy/lock.py          # after changing dependencies in pyproject.toml

``deploy/setup.sh`` installs with ``-c deploy/constraints.txt`` (``CONSTRAINTS=`` turns that off),
so CI and every machine set up from a checkout get the versions that passed. The file pins every
distribution installed in this interpreter's environment except harnessrl itself, pip's build
tools and torch with its CUDA companions (``TORCH_SPEC`` picks torch: a CPU build here, a CUDA
build on GPU machines). A test holds the file equal to the environment it describes.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

OUT = Path(__file__).resolve().parent / "constraints.txt"
UNPINNED = re.compile(r"^(harnessrl|pip|setuptools|wheel|torch|triton|nvidia-.*|cuda-.*)$")
HEADER = (
    "# The versions CI tests: written by `python deploy/lock.py`, read by deploy/setup.sh\n"
    "# (-c). Not pinned here: harnessrl, pip's build tools, torch and its CUDA companions.\n"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """``{canonical name: version}`` of every distribution this environment has, less the
    unpinned ones."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name and not UNPINNED.match(name):
            out[name] = dist.version
    return out


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def parse(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


if __name__ == "__main__":
    pins = installed()
    OUT.write_text(render(pins))
    print(f"{OUT}: {len(pins)} distributions pinned", file=sys.stderr)
