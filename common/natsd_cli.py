"""``harnessrl nats``: serve JetStream until Ctrl-C or SIGTERM, then stop the server by PID."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from common.config import NatsServerConfig
from common.natsd import NatsServer, NatsServerError

CONFIG = NatsServerConfig


def main(cfg: NatsServerConfig, args: argparse.Namespace) -> int:
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        srv = NatsServer(
            cfg.store_dir,
            host=cfg.host,
            port=cfg.port,
            max_payload_mb=cfg.max_payload_mb,
            binary=cfg.binary,
        ).start(timeout=cfg.startup_timeout_s)
    except NatsServerError as e:
        print(f"harnessrl nats: {e}", file=sys.stderr)
        return 1
    print(
        f"nats-server ready: {srv.url} (JetStream store {srv.store_dir}, pid {srv.pid}); "
        "Ctrl-C to stop",
        flush=True,
    )
    try:
        while not stop:
            if srv.proc is None or srv.proc.poll() is not None:
                print("harnessrl nats: nats-server exited unexpectedly", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        srv.stop()
    print("nats-server stopped", flush=True)
    return 0
