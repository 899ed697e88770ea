"""``harnessrl weights-sync --nats URL --run NAME --engine URL``: apply every new weight version
the learner broadcasts to one SGLang-compatible engine (via ``update_weights_from_disk``), in
order, never a partially received one. Runs until SIGTERM or Ctrl-C.

``harnessrl weights-sync --engine URL --load PATH [--load-version V]`` instead loads one HF
folder into the engine once (no NATS needed) and exits: 0 once the engine serves it, 1 with a
one-line error naming the engine and the folder.

Also runnable as ``python -m harnessrl.proxy.weights_sync_cmd`` with the same flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from harnessrl.proxy.config import WeightSyncConfig

CONFIG = WeightSyncConfig
SECTION = "weights_sync"

log = logging.getLogger("harnessrl.weights_sync")


def main(cfg: WeightSyncConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common import aio

    aio.setup_logging(cfg.log_level, "weights-sync")
    return aio.run(load(cfg) if cfg.load else serve(cfg))


async def _wait_healthy(client: Any, cfg: WeightSyncConfig, stop: asyncio.Event) -> bool:
    """Wait up to ``engine_wait_s`` for the engine's ``/health``; False if it never answered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.engine_wait_s
    while not await client.health(retries=0, timeout=5.0):
        if loop.time() > deadline or stop.is_set():
            return False
        await asyncio.sleep(1.0)
    return True


async def load(cfg: WeightSyncConfig) -> int:
    """Load ``cfg.load`` into the engine as ``cfg.load_version``, once."""
    from harnessrl.proxy.engine.auth import client_key
    from harnessrl.proxy.sglang import EngineClient, EngineError

    client = EngineClient(cfg.engine, api_key=client_key(cfg.engine_api_key_file))
    try:
        if not await _wait_healthy(client, cfg, asyncio.Event()):
            print(
                f"harnessrl weights-sync: engine {cfg.engine} not healthy; {cfg.load} not loaded",
                file=sys.stderr,
            )
            return 1
        try:
            await client.update_weights_from_disk(
                cfg.load, weight_version=cfg.load_version, abort_all_requests=False
            )
        except EngineError as e:
            msg = " ".join(str(e).split())
            print(
                f"harnessrl weights-sync: engine {cfg.engine} did not load {cfg.load}: {msg}",
                file=sys.stderr,
            )
            return 1
        print(
            f"weights-sync: {cfg.engine} loaded {cfg.load} as version {cfg.load_version}",
            file=sys.stderr,
            flush=True,
        )
        return 0
    finally:
        await client.close()


async def serve(cfg: WeightSyncConfig) -> int:
    from harnessrl.common import metrics
    from harnessrl.common.bus import connect_service
    from harnessrl.proxy.engine.auth import client_key
    from harnessrl.proxy.sglang import EngineClient
    from harnessrl.proxy.weights_sync import WeightUpdater, durable_name, engine_apply

    key = client_key(cfg.engine_api_key_file)
    bus = await connect_service(cfg, f"weights-sync {cfg.name or cfg.engine}")
    client = EngineClient(cfg.engine, api_key=key)
    served = await metrics.start_metrics_server(cfg.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # stop; never wait for an unreachable NATS from now on
        stop.set()
        bus.interrupt()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    try:
        if not await _wait_healthy(client, cfg, stop):
            print(f"harnessrl weights-sync: engine {cfg.engine} not healthy", file=sys.stderr)
            return 1
        applied = await client.weight_version()
        name = f"weights-sync-{cfg.name}" if cfg.name else durable_name(cfg.engine)
        updater = WeightUpdater(
            bus,
            engine_apply(client),
            cfg.work_dir,
            durable=name,
            applied_version=applied,
            keep_local=cfg.keep_local,
            base_model=cfg.base_model or None,
            read_retries=cfg.read_retries,
            ack_wait=cfg.ack_wait,
            label=cfg.engine,
        )
        print(f"weights-sync: {cfg.engine} at version {applied}", file=sys.stderr, flush=True)
        await updater.run(stop)
    finally:
        await client.close()
        if served:
            await served[0].cleanup()
        await bus.close()
    return 0


if (
    __name__ == "__main__"
):  # ``python -m harnessrl.proxy.weights_sync_cmd`` is ``harnessrl weights-sync``
    from harnessrl.common.cli import run_module

    run_module("weights-sync")
