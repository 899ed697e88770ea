"""A preloaded start for a Python harness: one interpreter that has imported the harness's
heavy libraries forks a copy of itself into each rollout's sandbox.

Run on the host, as root, by the harness's own interpreter (its venv's ``python``), from
``harnessrl.actors.harnesses.preload``; standard library only, since it runs in the harness's
venv::

    <venv>/bin/python -s -E -B _preloader.py --socket S --report-fd F --entry MODULE
        --min-uid U --parent PID [--per-uid N] [--request-timeout S] [--import MODULE]...

It imports the ``--import`` modules (their import-time settings come from this process's
environment, which is the same for every rollout), listens on the unix socket ``S`` (bound
into each sandbox) and writes ``ready`` to ``F``. A client (``_preload_client.py``, started
inside the sandbox by the usual sandbox command chain, so already as the sandbox's uid, with
its rlimits, in its namespaces) connects and sends its argv, environment and cwd, with its
stdin, stdout and stderr as file descriptors. For each client this process forks a
*supervisor*, which

1. takes the client's pid and uid from ``SO_PEERCRED`` (set by the kernel: a client cannot
   name another process) and refuses a uid below ``--min-uid`` (never root);
2. joins the client's pid namespace and forks the *harness*, which joins the client's other
   namespaces (cgroup, ipc, uts, net, mount) and root, copies the client's rlimits, drops
   every capability and becomes the client's uid and gid with ``no_new_privs`` — all before
   it touches a path of the sandbox — then takes the client's cwd, environment and stdio and
   runs ``python -m MODULE`` the way the interpreter does (``runpy``, ``sys.argv``, the cwd
   first on ``sys.path``), ending with the interpreter's own shutdown;
3. waits for the harness (or for the client to go away: then it kills the harness), sends
   the client how it ended, and writes ``<run> <cpu seconds>`` to ``F`` (the harness's CPU,
   which the sandbox's own accounting, counting the client, cannot see).

Only ``python -m MODULE`` with this preloader's ``--entry`` is served; anything else gets a
``fallback`` answer and the client starts the command cold, as does a client that cannot
connect. What one sandbox can make this (root) process hold is bounded: at most ``--per-uid``
supervisors at once for one uid (the next client is told ``busy`` if none ends within a
second), each waiting at most ``--request-timeout`` seconds for its request. A harness killed
with its sandbox (timeout, destroy) dies with the sandbox's pid namespace like a cold-started
one.

What differs from a cold start, by design: the interpreter's startup flags (``-s -E -B`` here;
the harness's ``PYTHON*`` variables still reach its own code and its subprocesses), the hash
seed (shared by every fork), ``sys.executable``/module paths (the install's host path, which
the sandbox binds at the same path), and the end: after the module returns or raises, the
harness joins its threads, runs its atexit handlers, collects its garbage, flushes its
standard streams and exits, without the interpreter's teardown of every object (`Job.run`).
"""

from __future__ import annotations

import argparse
import array
import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback

MAX_REQUEST = 16 << 20
NAMESPACES = ("cgroup", "ipc", "uts", "net", "mnt")  # pid is joined by the supervisor
CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 24, 4, 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _setns(fd: int, nstype: int = 0) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


class Refused(Exception):
    """A request this preloader does not serve; the client starts the command cold."""


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's request: a 4-byte length, that much JSON, and three fds with the first
    bytes. Raises `Refused` on anything malformed."""
    fds = array.array("i")
    msg, anc, _flags, _addr = conn.recvmsg(4, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    fds_list = list(fds)
    if len(msg) < 4:
        raise Refused("short header")
    (n,) = struct.unpack("!I", msg)
    if n > MAX_REQUEST:
        raise Refused(f"request of {n} bytes")
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            raise Refused("request cut short")
        buf += chunk
    try:
        req = json.loads(buf)
    except ValueError as e:
        raise Refused(f"request is not JSON: {e}") from None
    if len(fds_list) != 3:
        raise Refused(f"{len(fds_list)} file descriptors, not 3")
    ok = isinstance(req, dict) and isinstance(req.get("argv"), list)
    ok = ok and all(isinstance(a, str) for a in req["argv"])
    ok = ok and isinstance(req.get("env"), dict) and isinstance(req.get("cwd"), str)
    ok = ok and all(isinstance(k, str) and isinstance(v, str) for k, v in req["env"].items())
    if not ok:
        raise Refused("request needs argv (strings), env (strings) and cwd")
    return req, fds_list


def peer(conn: socket.socket) -> tuple[int, int, int]:
    """The client's pid, uid and gid, as the kernel recorded them when it connected."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    return struct.unpack("iII", creds)


def reap(children: dict[int, int]) -> None:
    """Forget the supervisors that ended."""
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue
        del children[pid]


def settled(children: dict[int, int], uid: int, bound: int, wait: float = 1.0) -> bool:
    """Whether ``uid`` is at its bound of supervisors, after waiting up to ``wait`` seconds
    for one to end: a supervisor that has just answered its client may not have exited yet
    when the same sandbox asks again."""
    deadline = time.monotonic() + wait
    while True:
        reap(children)
        if sum(u == uid for u in children.values()) < bound:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.01)


def send(conn: socket.socket, **reply: object) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(reply).encode() + b"\n")


class Job:
    """What the forked harness runs once it is set up (returned up to `main`)."""

    def __init__(self, entry: str, argv: list[str], cwd: str) -> None:
        self.entry, self.argv, self.cwd = entry, argv, cwd

    def run(self) -> None:
        """``python -m entry``, then the interpreter's shutdown steps that a program can
        observe (non-daemon threads joined, atexit handlers, garbage collected, standard
        streams flushed) and exit. The teardown of every module and object is skipped: in a
        fork it would write to every page shared with the preloader (~1.2 s of CPU for
        mini-swe-agent, 4x the rest of its start)."""
        sys.argv = [self.argv[0], *self.argv[3:]]
        sys.path[0] = self.cwd  # was this script's folder; ``-m`` puts the cwd first
        code = 0
        try:
            runpy.run_module(self.entry, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = exit_code(e.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        finish(code)


def exit_code(code: object) -> int:
    """What the interpreter exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def finish(code: int) -> None:
    with contextlib.suppress(Exception):
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    gc.collect()  # the harness's own objects only: the preloaded ones are frozen
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:  # killed by a signal, as the interpreter does for KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


LIMIT_NAMES = {
    "Max cpu time": "RLIMIT_CPU",
    "Max file size": "RLIMIT_FSIZE",
    "Max data size": "RLIMIT_DATA",
    "Max stack size": "RLIMIT_STACK",
    "Max core file size": "RLIMIT_CORE",
    "Max resident set": "RLIMIT_RSS",
    "Max processes": "RLIMIT_NPROC",
    "Max open files": "RLIMIT_NOFILE",
    "Max locked memory": "RLIMIT_MEMLOCK",
    "Max address space": "RLIMIT_AS",
    "Max file locks": "RLIMIT_LOCKS",
    "Max pending signals": "RLIMIT_SIGPENDING",
    "Max msgqueue size": "RLIMIT_MSGQUEUE",
    "Max nice priority": "RLIMIT_NICE",
    "Max realtime priority": "RLIMIT_RTPRIO",
    "Max realtime timeout": "RLIMIT_RTTIME",
}


def rlimits(pid: int) -> dict[int, tuple[int, int]]:
    """``pid``'s rlimits, from ``/proc/<pid>/limits`` (``prlimit`` on another uid's process
    needs CAP_SYS_RESOURCE, which containers often drop)."""
    limits = {}
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            name = line[:26].strip()
            res = getattr(resource, LIMIT_NAMES.get(name, "-"), None)
            words = line[26:].split()
            if res is None or len(words) < 2:
                continue
            soft, hard = (resource.RLIM_INFINITY if w == "unlimited" else int(w) for w in words[:2])
            limits[res] = (soft, hard)
    return limits


def enter(
    pid: int, uid: int, gid: int, limits: dict, req: dict, fds: list[int], keep_fd: int
) -> Job:
    """In the forked harness: become the client (see the module docstring, step 2)."""
    ns = {name: os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name in NAMESPACES}
    root = os.open(f"/proc/{pid}/root", os.O_RDONLY | os.O_DIRECTORY)
    if os.stat(f"/proc/{pid}").st_uid != uid:
        raise Refused("the client is gone")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for name in NAMESPACES:
        _setns(ns[name])
        os.close(ns[name])
    os.fchdir(root)
    os.chroot(".")
    os.close(root)
    for res, lim in limits.items():
        with contextlib.suppress(OSError, ValueError):  # only ever lowered: never refused
            resource.setrlimit(res, lim)
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # from root to a uid: every capability goes
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_DUMPABLE, 1)  # as after the exec of a cold start
    os.chdir(req["cwd"])
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    os.closerange(3, keep_fd)  # all but stdio and ``keep_fd`` (the caller closes it)
    os.closerange(keep_fd + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.dont_write_bytecode = bool(req["env"].get("PYTHONDONTWRITEBYTECODE"))
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return Job(req["argv"][2], req["argv"], req["cwd"])


def supervise(conn: socket.socket, args: argparse.Namespace, report_fd: int) -> Job | None:
    """In the forked supervisor (step 1 and 3); returns a `Job` in the forked harness."""
    conn.settimeout(args.request_timeout)  # a client that connects and says nothing
    try:
        req, fds = recv_request(conn)
    except (Refused, OSError) as e:
        send(conn, fallback=str(e) or type(e).__name__)
        os._exit(0)
    conn.settimeout(None)
    argv = req["argv"]
    if len(argv) < 3 or argv[1] != "-m" or argv[2] != args.entry:
        send(conn, fallback=f"serves only python -m {args.entry}")
        os._exit(0)
    pid, uid, gid = peer(conn)
    try:
        limits = rlimits(pid)
        pidns = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY)
        _setns(pidns, CLONE_NEWPID)
        os.close(pidns)
    except OSError as e:
        send(conn, fallback=f"cannot join the sandbox: {e}")
        os._exit(0)
    run = str(req.get("run", ""))[:64]
    sys.stdout.flush()
    sys.stderr.flush()
    failed_r, failed_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(failed_r)
            job = enter(pid, uid, gid, limits, req, fds, failed_w)
        except BaseException as e:  # nothing of the harness ran yet
            with contextlib.suppress(OSError):
                os.write(failed_w, f"cannot start the harness: {e}".encode()[:4000])
            os._exit(125)
        os.close(failed_w)
        return job
    os.close(failed_w)
    for fd in fds:
        os.close(fd)
    with os.fdopen(failed_r, "rb") as f:
        failed = f.read()  # EOF when the harness is set up (or died: then wait4 tells)
    if failed:
        os.waitpid(child, 0)
        send(conn, fallback=failed.decode(errors="replace"))
        os._exit(0)
    pidfd = os.pidfd_open(child)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            break
        try:
            gone = not conn.recv(4096)  # anything a client sends now is ignored
        except OSError:
            gone = True
        if gone:  # the client went away (killed with its sandbox): so does the harness
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
            break
    _, status, usage = os.wait4(child, 0)
    cpu = usage.ru_utime + usage.ru_stime
    if run:
        with contextlib.suppress(OSError):
            os.write(report_fd, f"{run} {cpu:.3f}\n".encode())
    if os.WIFSIGNALED(status):
        send(conn, signal=os.WTERMSIG(status), cpu=round(cpu, 3))
    else:
        send(conn, exit=os.waitstatus_to_exitcode(status), cpu=round(cpu, 3))
    os._exit(0)


class Stop(Exception):
    """SIGTERM: stop accepting (supervisors already forked finish their runs)."""


def _stop(*_: object) -> None:
    raise Stop


def serve(args: argparse.Namespace) -> Job | None:
    report_fd = args.report_fd
    signal.signal(signal.SIGTERM, _stop)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # the actor died (even by SIGKILL): stop too
    if os.getppid() != args.parent:
        return None
    os.set_blocking(report_fd, False)
    for name in args.imports:
        try:
            importlib.import_module(name)
        except Exception as e:  # skipped: the rest still helps
            print(f"hrl-preloader: cannot import {name}: {e}", file=sys.stderr, flush=True)
    if threading.active_count() != 1:  # fork() would copy only this thread: refuse to serve
        print("hrl-preloader: the imports started threads", file=sys.stderr, flush=True)
        sys.exit(3)
    gc.collect()
    gc.freeze()  # collections in a fork skip the preloaded objects (their pages stay shared)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(args.socket)
    os.chmod(args.socket, 0o666)  # sandboxes run as their own uids; SO_PEERCRED is the check
    srv.listen(64)
    os.write(report_fd, b"ready\n")
    supervisors: dict[int, int] = {}  # pid -> the uid it serves (reaped at each accept)
    try:
        while True:
            conn, _ = srv.accept()
            uid = peer(conn)[1]
            why = None
            if uid < args.min_uid:
                why = f"uid {uid} is not a sandbox's"
            elif settled(supervisors, uid, args.per_uid):  # one harness at a time, per sandbox
                why = "busy"
            if why:
                send(conn, fallback=why)
                conn.close()
                continue
            try:
                pid = os.fork()
                if pid == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    srv.close()
                    return supervise(conn, args, report_fd)
                supervisors[pid] = uid
            except OSError as e:
                send(conn, fallback=f"cannot fork: {e}")
            conn.close()
    except Stop:
        pass
    srv.close()
    with contextlib.suppress(OSError):
        os.unlink(args.socket)
    return None


def main() -> None:
    p = argparse.ArgumentParser(prog="hrl-preloader")
    p.add_argument("--socket", required=True)
    p.add_argument("--report-fd", type=int, required=True)
    p.add_argument("--entry", required=True)
    p.add_argument("--min-uid", type=int, required=True)
    p.add_argument("--parent", type=int, required=True, help="the actor's pid")
    p.add_argument("--per-uid", type=int, default=2, help="runs at once for one sandbox uid")
    p.add_argument("--request-timeout", type=float, default=30.0, help="seconds to send argv")
    p.add_argument("--import", dest="imports", action="append", default=[])
    try:
        job = serve(p.parse_args())
    except Stop:  # SIGTERM while importing
        job = None
    if job is not None:
        del p
        job.run()


if __name__ == "__main__":
    main()
