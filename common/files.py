"""Small file and socket helpers every process shares: one atomic write, one secret reader,
one free port."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from harnessrl.common.aio import StartupError


def atomic_write(
    path: str | Path, data: str | bytes, *, fsync: bool = False, mode: int | None = None
) -> Path:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace``.

    Readers see the old content or the new one, never a partial file. With ``fsync`` the data
    reaches the disk before the rename (commit points: checkpoints, ledgers). With ``mode`` the
    file has those permission bits from its creation (secrets: 0o600), never wider."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    if mode is not None:
        os.fchmod(fd, mode)
    with open(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def atomic_write_json(path: str | Path, obj: Any, *, fsync: bool = False) -> Path:
    """``atomic_write`` of ``obj`` as JSON."""
    return atomic_write(path, json.dumps(obj), fsync=fsync)


class SecretFileError(ValueError, StartupError):
    """A secret file (credentials, API key) is missing, unreadable or empty (a process that
    meets one at start exits with this one-line message)."""


def read_secret(path: str | Path, what: str = "secret file") -> str:
    """The stripped text of a secret file (a password line, an API key). Secrets travel as file
    paths, never on command lines; the message of a failure names ``what`` and the path."""
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise SecretFileError(f"cannot read {what} {path}: {why}") from None
    if not text:
        raise SecretFileError(f"{what} {path} is empty")
    return text


def write_secret(path: str | Path, text: str) -> Path:
    """Write a secret file readable by its owner only (0600), atomically."""
    return atomic_write(path, text if text.endswith("\n") else text + "\n", mode=0o600)


def ensure_secret(path: str | Path, what: str = "secret file") -> tuple[str, bool]:
    """``(secret, made)``: the secret in ``path``, made first when the file does not exist (a
    random URL-safe token, 0600; a folder it creates is 0700). Two processes making the same
    file at once agree on one secret (the file appears whole, once: a hard link of a finished
    temp file, which fails when the file exists). Raises ``SecretFileError`` as `read_secret`."""
    import secrets

    path = Path(path)
    made = False
    if not path.exists() and not path.is_symlink():
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
                made = True
        except OSError as e:
            raise SecretFileError(f"cannot make {what} {path}: {e.strerror or e}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return read_secret(path, what), made


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read, close)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
