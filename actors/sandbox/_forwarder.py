"""In-sandbox launcher: relay 127.0.0.1:PORT to the proxy's unix socket, run the command.

    python3 -I -S -B _forwarder.py PORT UNIX_SOCKET [--status-fd FD] -- CMD [ARG...]

Runs *inside* the sandbox, already under the sandbox's uid and rlimits. Why a launcher: each
`Sandbox.run` is its own bwrap with its own network namespace (loopback only), so whatever
listens on the loopback for the harness must live in that same namespace, started before the
harness. This process binds the port first (no start-up race), forks and execs the command, and
relays every accepted TCP connection to a fresh connection on the unix socket (bind-mounted
from the host) until the command exits; then it exits with the command's status (128+N for a
signal), which tears the whole sandbox down.

``SIGUSR1`` closes the listening sockets and every connection, ``SIGUSR2`` listens again:
docker's forwarder serves every command of its container, and a run with ``proxy=False``
must find nothing listening (the host waits for it on ``/proc/PID/net/tcp``).

``--status-fd FD`` (an inherited pipe from the host, not passed on to the command): before
exiting, write how the command ended, ``exit N`` or ``signal N``, then ``cpu S``: the CPU
seconds (user + system) of the command and of every process it waited for (``wait4``), which
the host cannot see itself (bwrap's pid namespace keeps them from its ``RUSAGE_CHILDREN``). An
exit status of 137 is ambiguous (``exit 137`` or death by SIGKILL); this line is not, and its
absence tells the host that this launcher (or the sandbox's init) itself died before the
command ended.

One thread, epoll, non-blocking sockets; both directions of every connection are relayed
independently, with half-close (EOF on one side becomes shutdown(SHUT_WR) on the other once the
pending bytes are written). Standard library only; no threads, so it costs a single entry of
the sandbox's process limit.

It starts on every `Sandbox.run` of a sandbox with a proxy, before the command: it imports only
built-in modules (``_socket``, ``select``, ``_signal``; not ``socket``, ``selectors`` or
``signal``, whose imports of ``enum`` and ``collections`` cost more than the rest of the
start-up), which ``benchmarks/sandbox_lifecycle.py`` measures as ``run_with_forwarder``.
"""

import _signal  # pyright: ignore[reportMissingImports] (typeshed has no stub for it)
import _socket as socket
import errno
import os
import select
import sys

BUF = 256 * 1024
CLOSE = _signal.SIGUSR1
"""Stop listening and drop every connection (a docker sandbox's run with ``proxy=False``)."""
OPEN = _signal.SIGUSR2
"""Listen again."""
READ = select.EPOLLIN
WRITE = select.EPOLLOUT


class Selector:
    """The few `selectors` verbs used here, over epoll (fd -> data; events as selectors gives
    them: a hang-up or error reads as every registered event)."""

    def __init__(self):
        self.ep = select.epoll()
        self.keys = {}

    def register(self, obj, mask, data):
        fd = obj if isinstance(obj, int) else obj.fileno()
        self.ep.register(fd, mask)
        self.keys[fd] = (obj, mask, data)

    def modify(self, obj, mask, data):
        fd = obj.fileno()
        self.ep.modify(fd, mask)
        self.keys[fd] = (obj, mask, data)

    def unregister(self, obj):
        fd = obj.fileno()
        self.ep.unregister(fd)
        del self.keys[fd]

    def select(self, timeout):
        out = []
        for fd, ev in self.ep.poll(-1 if timeout is None else timeout):
            key = self.keys.get(fd)
            if key is None:
                continue
            events = 0
            if ev & ~READ:
                events |= WRITE
            if ev & ~WRITE:
                events |= READ
            out.append((key, events & key[1]))
        return out


class Relay:
    """One TCP client <-> one unix connection. ``buf[i]`` holds bytes read from ``socks[i]``."""

    def __init__(self, sel, a, b):
        self.sel = sel
        self.socks = [a, b]
        self.buf = [bytearray(), bytearray()]
        self.eof = [False, False]
        self.shut = [False, False]
        self.mask = [0, 0]
        self.closed = False
        self.update()

    def on_event(self, i, events):
        try:
            if events & READ:
                data = self.socks[i].recv(BUF)
                if data:
                    self.buf[i] += data
                else:
                    self.eof[i] = True
            if events & WRITE:
                n = self.socks[i].send(self.buf[1 - i])
                del self.buf[1 - i][:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close()
            return
        self.update()

    def update(self):
        if self.closed:
            return
        for i in (0, 1):
            src = 1 - i  # bytes for socks[i] come from socks[src]
            if self.eof[src] and not self.buf[src] and not self.shut[i]:
                self.shut[i] = True
                try:
                    self.socks[i].shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if all(self.shut):
            self.close()
            return
        for i in (0, 1):
            m = 0
            if not self.eof[i] and len(self.buf[i]) < BUF:
                m |= READ
            if self.buf[1 - i]:
                m |= WRITE
            self._set_mask(i, m)

    def _set_mask(self, i, m):
        old = self.mask[i]
        if m == old:
            return
        sock = self.socks[i]
        if old == 0:
            self.sel.register(sock, m, (self, i))
        elif m == 0:
            self.sel.unregister(sock)
        else:
            self.sel.modify(sock, m, (self, i))
        self.mask[i] = m

    def close(self):
        self.closed = True
        for i in (0, 1):
            if self.mask[i]:
                self.sel.unregister(self.socks[i])
                self.mask[i] = 0
            self.socks[i].close()


def listen(port):
    """Listening sockets on ::1 (when the namespace has IPv6) and 127.0.0.1 (required), in
    that order: a host that waits for 127.0.0.1 to listen finds both listening."""
    out = []
    for family, host in ((socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM, 0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((host, port))
            s.listen(256)
            s.setblocking(False)
            out.append(s)
        except OSError:
            if family == socket.AF_INET:
                raise
    return out


def accept(sel, listener, unix_path, warned):
    while True:
        try:
            fd, _ = listener._accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        c = socket.socket(listener.family, socket.SOCK_STREAM, 0, fd)
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)
        try:
            u.settimeout(5.0)
            u.connect(unix_path)
        except OSError as e:
            u.close()
            c.close()
            if not warned:
                warned.append(1)
                sys.stderr.write(f"hrl-forwarder: proxy socket unavailable: {e}\n")
            continue
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.setblocking(False)
        u.setblocking(False)
        Relay(sel, c, u)


def spawn(cmd):
    pid = os.fork()
    if pid:
        return pid
    try:  # Python ignores these; a harness must get the default actions back
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGINT, CLOSE, OPEN):
            _signal.signal(sig, _signal.SIG_DFL)
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write(f"hrl-forwarder: cannot execute {cmd[0]}: {e.strerror}\n")
        sys.stderr.flush()
        os._exit(127 if e.errno == errno.ENOENT else 126)
    os._exit(126)


def control_signals(sel):
    """``CLOSE`` / ``OPEN`` arrive as bytes on a pipe registered in ``sel`` (``"signal"``)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    for sig in (CLOSE, OPEN):
        _signal.signal(sig, lambda *_: None)
    _signal.set_wakeup_fd(w)
    sel.register(r, READ, "signal")
    return r


def on_control(sel, fd, port, listeners):
    """Stop listening and drop every relay (``CLOSE``), or listen again (``OPEN``)."""
    try:
        sigs = os.read(fd, 64)
    except (BlockingIOError, InterruptedError):
        return
    for sig in sigs:
        if sig == CLOSE and listeners:
            for s in listeners:
                sel.unregister(s)
                s.close()
            listeners.clear()
            for _, _, data in list(sel.keys.values()):
                if isinstance(data, tuple):
                    data[0].close()
        elif sig == OPEN and not listeners:
            try:
                listeners.extend(listen(port))
            except OSError as e:
                sys.stderr.write(f"hrl-forwarder: cannot listen again on {port}: {e}\n")
            for s in listeners:
                sel.register(s, READ, None)


def report(fd, status, usage):
    """Write how the command ended, and the CPU seconds it and the processes it waited for
    used, to the host's status pipe (best effort)."""
    if fd is None:
        return
    kind = (
        f"signal {os.WTERMSIG(status)}"
        if os.WIFSIGNALED(status)
        else f"exit {os.WEXITSTATUS(status)}"
    )
    cpu = usage.ru_utime + usage.ru_stime
    try:
        os.write(fd, f"{kind} cpu {cpu:.3f}\n".encode())
        os.close(fd)
    except OSError:
        pass


def main(argv):
    status_fd = None
    if len(argv) >= 4 and argv[2] == "--status-fd":
        status_fd, argv = int(argv[3]), argv[:2] + argv[4:]
        os.set_inheritable(status_fd, False)  # the command must not be able to write it
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: _forwarder.py PORT UNIX_SOCKET [--status-fd FD] -- CMD [ARG...]\n")
        return 125
    port, unix_path, cmd = int(argv[0]), argv[1], argv[3:]
    sel = Selector()
    try:
        listeners = listen(port)
        for s in listeners:
            sel.register(s, READ, None)
    except OSError as e:
        sys.stderr.write(f"hrl-forwarder: cannot listen on 127.0.0.1:{port}: {e}\n")
        return 125
    pid = spawn(cmd)
    control = control_signals(sel)
    try:
        pidfd = os.pidfd_open(pid)
        sel.register(pidfd, READ, "child")
    except (AttributeError, OSError):
        pidfd = None
    warned = []
    while True:
        for (obj, _, data), events in sel.select(None if pidfd is not None else 0.05):
            if data is None:
                accept(sel, obj, unix_path, warned)
            elif data == "child":
                pass
            elif data == "signal":
                on_control(sel, control, port, listeners)
            else:
                relay, i = data
                relay.on_event(i, events)
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            report(status_fd, status, usage)
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))
