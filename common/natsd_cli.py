"""``harnessrl nats``: serve JetStream until Ctrl-C or SIGTERM, then stop the server by PID.

By default the server requires credentials and serves TLS: it writes one credential file per
role into its auth folder (``<store>/auth/<role>.cred``), one per actor
(``<store>/auth/actors/actor-<i>.cred``, ``--actors`` of them: actors never share one; a
credential added there later is accepted within seconds) and a self-signed CA
(``<store>/auth/tls/ca.pem``), creates the streams of ``--runs`` with the admin credential
(no other role may), and prints where the files are. Give each process its own role's file
(``--nats-creds``) and the CA (``--nats-ca``); the roles and their permissions are listed in
``harnessrl.common.natsauth``. ``--insecure`` serves without either (private loopback servers only).

With ``--cluster-name`` the server is one node of a JetStream cluster (``--cluster-port`` for
its routes, ``--routes HOST:PORT`` once per node, the same list on every node). Every node uses
the same auth folder (make it on one node, copy it to the others with ``--auth-dir``): clients
then hold one credential and CA for all nodes, and the nodes' routes authenticate with its
``route.cred`` over TLS verified both ways. Each node creates the runs' streams with
``--stream-replicas`` copies once the cluster can place them (it waits ``--cluster-wait-s``
for the other nodes), then prints its ready line.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl.common.config import NatsServerConfig
from harnessrl.common.natsd import Cluster, NatsServer, NatsServerError

if TYPE_CHECKING:
    from harnessrl.common.natsauth import ServerAuth

CONFIG = NatsServerConfig

ACTORS_POLL_S = 1.0
"""How often the auth folder is looked at for new actor credentials."""


def server_auth(cfg: NatsServerConfig) -> ServerAuth | None:
    """The credentials and TLS files ``cfg`` asks for (None with ``insecure``); raises
    ``harnessrl.common.natsauth.AuthError``."""
    from harnessrl.common.natsauth import prepare_server_auth

    if cfg.insecure:
        return None
    return prepare_server_auth(
        Path(cfg.auth_dir) if cfg.auth_dir else Path(cfg.store_dir) / "auth",
        cfg.runs,
        tls=cfg.tls,
        host=cfg.host,
        tls_hosts=cfg.tls_hosts,
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
        tls_ca=cfg.tls_ca,
        actors=cfg.actors,
    )


def cluster(cfg: NatsServerConfig) -> Cluster | None:
    """This node's place in the cluster ``cfg`` names (None for a single server)."""
    if not cfg.cluster_name:
        return None
    return Cluster(cfg.cluster_name, cfg.cluster_port, tuple(cfg.routes), cfg.server_name)


async def create_streams(
    srv: NatsServer, runs: list[str], *, replicas: int = 1, wait_s: float = 60.0
) -> None:
    """Create every stream of ``runs`` as the admin role, with ``replicas`` copies, waiting up
    to ``wait_s`` for JetStream to place them."""
    from harnessrl.common.bus import connect

    for run in runs:
        bus = await connect(
            srv.url,
            run,
            name="harnessrl-nats-admin",
            creds=srv.creds("admin"),
            ca=srv.ca,
            replicas=replicas,
            stream_wait_s=wait_s,
        )
        await bus.close()


class _Stopped(BaseException):
    """SIGTERM or SIGINT while the server is starting or waiting for its cluster."""


def main(cfg: NatsServerConfig, args: argparse.Namespace) -> int:
    from harnessrl.common.bus import BusError
    from harnessrl.common.files import SecretFileError

    stop = False
    starting = True

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True
        if starting:  # a cluster node may wait minutes for its peers: give up at once
            raise _Stopped

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    srv: NatsServer | None = None
    try:
        try:
            auth = server_auth(cfg)
            srv = NatsServer(
                cfg.store_dir,
                host=cfg.host,
                port=cfg.port,
                max_payload_mb=cfg.max_payload_mb,
                binary=cfg.binary,
                auth=auth,
                cluster=cluster(cfg),
            )
            srv.start(timeout=cfg.startup_timeout_s)
            wait = cfg.cluster_wait_s if cfg.cluster_name else 60.0
            asyncio.run(create_streams(srv, cfg.runs, replicas=cfg.stream_replicas, wait_s=wait))
        except (NatsServerError, SecretFileError, BusError) as e:
            starting = False
            where = ""
            if srv is not None and cfg.cluster_name:
                where = f" (cluster {cfg.cluster_name}: see {srv.log_path})"
            print(f"harnessrl nats: {e}{where}", file=sys.stderr)
            return 1
        except _Stopped:
            starting = False
            print("harnessrl nats: stopped before it was ready", file=sys.stderr)
            return 0
        starting = False
        print(ready_line(cfg, srv, auth), flush=True)
        looked = time.monotonic()
        while not stop:
            if srv.proc is None or srv.proc.poll() is not None:
                print("harnessrl nats: nats-server exited unexpectedly", file=sys.stderr)
                return 1
            if time.monotonic() - looked >= ACTORS_POLL_S:
                looked = time.monotonic()
                if srv.watch_actors() and auth is not None:
                    print(f"actor credentials now: {len(auth.actors)}", flush=True)
            time.sleep(0.2)
    finally:
        if srv is not None:
            srv.stop()
            print("nats-server stopped", flush=True)
    return 0


def ready_line(cfg: NatsServerConfig, srv: NatsServer, auth: ServerAuth | None) -> str:
    """What ``harnessrl nats`` prints once its streams exist (the supervisor waits for it)."""
    if auth is None:
        trust = "INSECURE: no credentials, no TLS"
    else:
        trust = f"credentials {auth.auth_dir}/ROLE.cred"
        trust += f", {len(auth.actors)} actor credentials in {auth.auth_dir}/actors"
        trust += f", CA {srv.ca}" if srv.ca else (", TLS" if auth.tls_cert else ", no TLS")
    node = ""
    if srv.cluster is not None:
        node = (
            f"; node {srv.cluster.node_name()} of cluster {cfg.cluster_name} (routes on "
            f"port {cfg.cluster_port}), {cfg.stream_replicas} replica(s) per stream"
        )
    return (
        f"nats-server ready: {srv.url} (JetStream store {srv.store_dir}, pid {srv.pid}) "
        f"{trust}; runs {', '.join(cfg.runs)}{node}; Ctrl-C to stop"
    )
