"""Small file and socket helpers every process shares: one atomic write, one free port."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, data: str | bytes, *, fsync: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace``.

    Readers see the old content or the new one, never a partial file. With ``fsync`` the data
    reaches the disk before the rename (commit points: checkpoints, ledgers)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def atomic_write_json(path: str | Path, obj: Any, *, fsync: bool = False) -> Path:
    """``atomic_write`` of ``obj`` as JSON."""
    return atomic_write(path, json.dumps(obj), fsync=fsync)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read, close)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
