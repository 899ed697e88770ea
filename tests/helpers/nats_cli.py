"""``harnessrl nats`` as a child process: start it on a free port, read its ready line, stop it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

HRL = [sys.executable, "-m", "harnessrl.common.cli"]


def spawn_nats_cli(tmp_path: Path, *flags: str) -> subprocess.Popen:
    """``harnessrl nats`` on a free client port with its store in ``tmp_path/store``."""
    return subprocess.Popen(
        [*HRL, "nats", "--port", "0", "--store-dir", str(tmp_path / "store"), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ready_line(proc: subprocess.Popen) -> str:
    """Its ``nats-server ready: URL …`` line (an AssertionError with its stderr otherwise)."""
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if "nats-server ready: " not in line:
        proc.kill()
        raise AssertionError(line + proc.communicate()[1])
    return line


def start_nats_cli(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`spawn_nats_cli`, once ready: (the process, its ready line)."""
    proc = spawn_nats_cli(tmp_path, *flags)
    return proc, ready_line(proc)


def stop_nats_cli(proc: subprocess.Popen) -> None:
    """SIGTERM; it must stop its server and exit 0."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
