"""The host's view of a docker sandbox's container (``harnessrl.actors.sandbox.docker``): its processes
in ``/proc``, its cgroup, its forwarder's listening socket, the exec output stream, and the
files and exit statuses of its commands."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harnessrl.actors.sandbox.base import SandboxSpec


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_status(pid: str) -> tuple[int, str] | None:
    """(real uid, state letter) of a host pid, or None when it is gone."""
    uid, state = None, ""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    state = line.split()[1]
                elif line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        return None
    return None if uid is None else (uid, state)


def _forwarder_pid(init_pid: int, proxy_uid: int) -> int | None:
    """Host pid of the container's forwarder: the child of its init running as
    ``proxy_uid`` (None when there is none)."""
    try:
        kids = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    except OSError:
        return None
    for kid in kids:
        st = _proc_status(kid)
        if st is not None and st[0] == proxy_uid:
            return int(kid)
    return None


def _cgroup_procs(pid: int) -> Path | None:
    """The ``cgroup.procs`` file (v1 pids controller, or v2) holding host pid ``pid``."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        rel = path.lstrip("/")
        if "pids" in ctrls.split(","):
            candidates.insert(0, Path("/sys/fs/cgroup") / ctrls / rel)
        elif hid == "0":
            candidates += [Path("/sys/fs/cgroup") / rel, Path("/sys/fs/cgroup/unified") / rel]
    for c in candidates:
        with contextlib.suppress(OSError):
            if str(pid) in (c / "cgroup.procs").read_text().split():
                return c / "cgroup.procs"
    return None


def _dying(pid: int | None) -> bool:
    """Whether host pid ``pid`` is gone, a zombie, or exiting (``PF_EXITING``: an init killed
    is still waiting for its namespace's processes to die when their exits are seen)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state, *rest = stat[stat.rindex(")") + 2 :].split()
        return state in ("Z", "X") or bool(int(rest[5]) & 0x4)  # flags
    except (OSError, ValueError, IndexError):
        return True


def _oom_kills(pid: int | None) -> int:
    """OOM kills so far in the memory cgroup (v2 or v1) of host pid ``pid`` (-1: unknown)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            hid, ctrls, path = line.split(":", 2)
            for f in (
                Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events",
                Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control",
            ):
                if ("memory" in ctrls.split(",") or hid == "0") and f.exists():
                    return int(dict(ln.split() for ln in f.read_text().splitlines())["oom_kill"])
    return -1


def _kill_uid_round(procs: Path, uid: int) -> int:
    """SIGKILL the live processes of ``uid`` listed in ``procs``; how many were signalled."""
    n = 0
    for pid in procs.read_text().split():
        st = _proc_status(pid)
        if st is not None and st[0] == uid and st[1] != "Z":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
                n += 1
    return n


def _listening(pid: int, port: int) -> bool:
    """Whether the network namespace of host pid ``pid`` has a TCP listener on 127.0.0.1:port."""
    want = f"0100007F:{port:04X}"
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            return any(
                (cols := line.split())[1] == want and cols[3] == "0A" for line in f.readlines()[1:]
            )
    except (OSError, IndexError):
        return False


_EMPTY = ((b"", True), (b"", True))


async def _pump(stream, cap: int) -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
    """Read the exec's multiplexed output to its end: (stdout, truncated), (stderr, truncated).
    A connection that breaks counts as the end."""
    bufs = {1: bytearray(), 2: bytearray()}
    trunc = {1: False, 2: False}
    with contextlib.suppress(Exception):  # aiohttp / docker errors: the stream is over
        while (msg := await stream.read_out()) is not None:
            buf = bufs.get(msg.stream)
            if buf is None:
                continue
            room = cap - len(buf)
            if room > 0:
                buf += msg.data[:room]
            trunc[msg.stream] = trunc[msg.stream] or len(msg.data) > room
    return (bytes(bufs[1]), trunc[1]), (bytes(bufs[2]), trunc[2])


async def _feed(stream, data: bytes) -> None:
    """Write stdin, then half-close the connection (docker then closes the command's stdin)."""
    with contextlib.suppress(Exception):
        if data:
            await stream.write_in(data)
        resp = getattr(stream, "_resp", None)  # aiodocker has no public half-close
        transport = resp.connection.transport if resp is not None and resp.connection else None
        if transport is not None and transport.can_write_eof():
            transport.write_eof()


def _etc_files(spec: SandboxSpec, uid: int, proxy_uid: int) -> dict[str, str]:
    return {
        "passwd": "root:x:0:0:root:/root:/bin/bash\n"
        f"hrl:x:{uid}:{uid}:harnessrl sandbox:{spec.home}:/bin/bash\n"
        f"hrl-proxy:x:{proxy_uid}:{proxy_uid}:harnessrl proxy:/nonexistent:/usr/sbin/nologin\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nhrl:x:{uid}:\nhrl-proxy:x:{proxy_uid}:\nnogroup:x:65534:\n",
    }


def _exec_failure(message: bytes) -> int | None:
    """Exit status for a command docker could not start (127 not found, 126 not executable);
    None when the sandbox itself is at fault (bad cwd, no pids left, …)."""
    if b"chdir to cwd" in message:
        return None
    if b"executable file not found" in message or b"no such file or directory" in message:
        return 127
    if b"permission denied" in message:
        return 126
    return None
