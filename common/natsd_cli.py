"""``harnessrl nats``: serve JetStream until Ctrl-C or SIGTERM, then stop the server by PID.

By default the server requires credentials and serves TLS: it writes one credential file per
role into its auth folder (``<store>/auth/<role>.cred``) and a self-signed CA
(``<store>/auth/tls/ca.pem``), creates the streams of ``--runs`` with the admin credential
(no other role may), and prints where the files are. Give each process its own role's file
(``--nats-creds``) and the CA (``--nats-ca``); the roles and their permissions are listed in
``common.natsauth``. ``--insecure`` serves without either (private loopback servers only).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import NatsServerConfig
from common.natsd import NatsServer, NatsServerError

if TYPE_CHECKING:
    from common.natsauth import ServerAuth

CONFIG = NatsServerConfig


def server_auth(cfg: NatsServerConfig) -> ServerAuth | None:
    """The credentials and TLS files ``cfg`` asks for (None with ``insecure``); raises
    ``common.natsauth.AuthError``."""
    from common.natsauth import prepare_server_auth

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
    )


async def create_streams(srv: NatsServer, runs: list[str]) -> None:
    """Create every stream of ``runs`` as the admin role."""
    from common.bus import connect

    for run in runs:
        bus = await connect(
            srv.url, run, name="harnessrl-nats-admin", creds=srv.creds("admin"), ca=srv.ca
        )
        await bus.close()


def main(cfg: NatsServerConfig, args: argparse.Namespace) -> int:
    from common.bus import BusError
    from common.files import SecretFileError

    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        auth = server_auth(cfg)
        srv = NatsServer(
            cfg.store_dir,
            host=cfg.host,
            port=cfg.port,
            max_payload_mb=cfg.max_payload_mb,
            binary=cfg.binary,
            auth=auth,
        ).start(timeout=cfg.startup_timeout_s)
    except (NatsServerError, SecretFileError) as e:
        print(f"harnessrl nats: {e}", file=sys.stderr)
        return 1
    try:
        try:
            asyncio.run(create_streams(srv, cfg.runs))
        except BusError as e:
            print(f"harnessrl nats: {e}", file=sys.stderr)
            return 1
        if auth is None:
            trust = "INSECURE: no credentials, no TLS"
        else:
            trust = f"credentials {auth.auth_dir}/ROLE.cred"
            trust += f", CA {srv.ca}" if srv.ca else (", TLS" if auth.tls_cert else ", no TLS")
        print(
            f"nats-server ready: {srv.url} (JetStream store {srv.store_dir}, pid {srv.pid}) "
            f"{trust}; runs {', '.join(cfg.runs)}; Ctrl-C to stop",
            flush=True,
        )
        while not stop:
            if srv.proc is None or srv.proc.poll() is not None:
                print("harnessrl nats: nats-server exited unexpectedly", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        srv.stop()
    print("nats-server stopped", flush=True)
    return 0
