"""Harness installs faked at the paths each adapter looks for (a manifest plus one file per
path), so adapters can be exercised without npm or pip; the real installs are exercised by the
real-harness tests."""

from __future__ import annotations

import json
from pathlib import Path

from harnessrl.actors.harnesses._platform import npm_arch, rust_triple
from harnessrl.actors.harnesses.base import MANIFEST

ARCH = npm_arch()
FAKE_FILES = {
    "claude-code": [f"node_modules/@anthropic-ai/claude-code-linux-{ARCH}/claude"],
    "codex": [f"node_modules/@openai/codex-linux-{ARCH}/vendor/{rust_triple()}/bin/codex"],
    "mini-swe-agent": ["venv/bin/python"],
    "opencode": [f"node_modules/opencode-linux-{ARCH}/bin/opencode"],
    "openclaw": [
        f"node_modules/node-linux-{ARCH}/bin/node",
        "node_modules/openclaw/openclaw.mjs",
    ],
}
"""Per npm/pip harness: the files its adapter checks; the first is the program it launches."""


def fake_installs(cache: Path, program: str = "") -> Path:
    """Every npm/pip harness looks installed (version 9.9.9) in ``cache``; each program it
    launches is ``program`` (executable) when given, else an empty file."""
    for name, files in FAKE_FILES.items():
        root = cache / name
        for i, rel in enumerate(files):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(program if i == 0 else "")
            if program and i == 0:
                (root / rel).chmod(0o755)
        (root / MANIFEST).write_text(json.dumps({"name": name, "version": "9.9.9"}))
    return cache
