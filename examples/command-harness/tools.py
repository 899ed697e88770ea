"""The agent's tools, as plain functions: llm's --functions turns each into a tool the model
can call (name, docstring and typed parameters), runs the calls and sends the results back.
They work on the current folder, the task's workspace."""

import os
import subprocess
from pathlib import Path


def run(cmd: str) -> str:
    """Run a shell command in the workspace; returns its output and exit status."""
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    return f"{(p.stdout + p.stderr)[-4000:]}\n(exit {p.returncode})"


def read_file(path: str) -> str:
    """Read a text file of the workspace."""
    return Path(path).read_text()[:8000]


def write_file(path: str, content: str) -> str:
    """Create or overwrite a file with the given content."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(content)
    return f"wrote {len(content)} characters to {path}"


def list_dir(path: str) -> str:
    """List a directory of the workspace (folders end in /)."""
    names = sorted(n + "/" if (Path(path) / n).is_dir() else n for n in os.listdir(path))
    return "\n".join(names) or "(empty)"


def finish(summary: str) -> str:
    """Say the task is done."""
    return "done"
