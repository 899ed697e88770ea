"""Host-side helpers of the bubblewrap backend (``bwrap.py``): the compiled forwarder's build,
the state's lock info and generated /etc files, a blank's bookkeeping, killing a dead
sandbox's uid, reading a run's capped output."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harnessrl.actors.sandbox._fs import _starttime
from harnessrl.actors.sandbox.base import SandboxError, SandboxSpec

FORWARDER_C_SRC = Path(__file__).with_name("_forwarder.c")


def build_forwarder(cache_dir: Path, cc: str | None = None) -> Path:
    """The compiled forwarder (``_forwarder.c``) for this host: built once per source and
    compiler into ``cache_dir/<hash>/hrl-forwarder`` (atomically; concurrent builders race
    harmlessly), then reused. Raises `SandboxError` when no C compiler builds it."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SandboxError("no C compiler (cc) for the forwarder")
    src = FORWARDER_C_SRC.read_bytes()
    h = hashlib.sha256(src + os.path.realpath(cc).encode() + os.uname().machine.encode())
    final = cache_dir / h.hexdigest()[:16] / "hrl-forwarder"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = final.with_name(f".new-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        p = subprocess.run(
            [cc, "-O2", "-o", str(tmp), str(FORWARDER_C_SRC)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if p.returncode != 0:
            raise SandboxError(f"cannot build the forwarder: {p.stderr.strip()[-800:]}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxError(f"cannot build the forwarder: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is ``uid``; returns how many were found."""
    n = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            os.kill(int(d), signal.SIGKILL)
                            n += 1
                        break
        except (OSError, ValueError):
            continue
    return n


def _write_lock_info(fd: int, owner: str, sid: str, uid: int, mode: str) -> None:
    """The lock file's JSON: who owns the sandbox (sweep reads ``mode`` and ``uid``)."""
    info = {"owner": owner, "pid": os.getpid(), "start": _starttime(os.getpid())}
    info |= {"id": sid, "uid": uid, "mode": mode}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)


@dataclass(slots=True)
class _Blank:
    """A sandbox's state made ahead (`BwrapBackend._blank_sync`), not yet given a spec."""

    path: Path
    sid: str
    uid: int
    lock_fd: int
    uid_fd: int | None

    def close(self) -> None:
        for fd in (self.lock_fd, self.uid_fd):
            if fd is not None:
                os.close(fd)


def _etc_files(spec: SandboxSpec, uid: int) -> dict[str, str]:
    """The /etc files generated per sandbox (the user's uid and the hostname vary)."""
    return {
        "passwd": "root:x:0:0:root:/root:/bin/bash\n"
        f"hrl:x:{uid}:{uid}:harnessrl sandbox:{spec.home}:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nhrl:x:{uid}:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1 localhost {spec.hostname}\n::1 localhost ip6-localhost\n",
        "hostname": f"{spec.hostname}\n",
    }


def _no_private_keys(d: str, names: list[str]) -> list[str]:
    return ["private"] if d.endswith("ssl") else []


def _below(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _setup_failed(returncode: int | None, stderr: bytes) -> bool:
    """Whether a run failed in bwrap / setpriv / prlimit / the forwarder, before the command.

    These tools report on stderr with their name as prefix and exit 1 (125: forwarder).
    """
    return returncode in (1, 125) and stderr.startswith(_SETUP_ERRORS)


_SETUP_ERRORS = (b"bwrap: ", b"setpriv: ", b"prlimit: failed to set", b"hrl-forwarder: cannot")


async def _read_capped(stream: asyncio.StreamReader | None, cap: int) -> tuple[bytes, bool]:
    buf, truncated = bytearray(), False
    if stream is None:
        return b"", False
    while chunk := await stream.read(1 << 16):
        room = cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        truncated = truncated or len(chunk) > room
    return bytes(buf), truncated
