"""Inside a sandbox: start a Python harness from the preloader, or cold when it cannot.

Run by the sandbox's own command chain (so as the sandbox's uid, with its rlimits and
namespaces), with the system interpreter and no site (``/usr/bin/python3 -I -S``)::

    _preload_client.py SOCKET -- PYTHON -m MODULE [ARG]...

Sends the command, this process's environment (less ``HRL_PRELOAD_RUN``, the run's name for
the preloader's CPU report) and cwd to the preloader at ``SOCKET`` with stdin, stdout and
stderr as file descriptors, waits, and ends as the harness ended (its exit status, or the
same signal). When the socket does not answer or the preloader answers ``fallback``, it
executes the command itself: a cold start, exactly as without a preloader. Standard
library only (``_preloader.py`` describes the other side).
"""

import array
import json
import os
import signal
import socket
import struct
import sys


def cold(argv, why):
    if why:
        os.write(2, f"hrl-preload: starting cold ({why})\n".encode()[:2000])
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        os.write(2, f"hrl-preload: cannot execute {argv[0]}: {e}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        os.write(2, b"usage: _preload_client.py SOCKET -- COMMAND [ARG]...\n")
        os._exit(2)
    path, argv = sys.argv[1], sys.argv[3:]
    run = os.environ.pop("HRL_PRELOAD_RUN", "")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        body = json.dumps({"run": run, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()})
        data = body.encode()
        fds = array.array("i", [0, 1, 2])
        sock.sendmsg(
            [struct.pack("!I", len(data)), data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
        )
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    except OSError as e:
        sock.close()
        cold(argv, f"preloader: {e}")
    sock.close()
    try:
        ans = json.loads(reply)
    except ValueError:
        ans = {}
    if "fallback" in ans:
        cold(argv, ans["fallback"])
    if "signal" in ans:
        sig = int(ans["signal"])
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    if "exit" in ans:
        code = int(ans["exit"])
        os._exit(code if 0 <= code < 256 else 128 - code)
    why = ans.get("error") or "the preloader ended without an answer"
    os.write(2, f"hrl-preload: {why}\n".encode()[:2000])
    os._exit(125)


main()
