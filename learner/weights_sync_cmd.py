"""``harnessrl weights-sync --nats URL --run NAME --engine URL``: apply every new weight version
the learner broadcasts to one SGLang-compatible engine (via ``update_weights_from_disk``), in
order, never a partially received one. Runs until SIGTERM or Ctrl-C.

Also runnable as ``python -m learner.weights_sync_cmd`` with the same flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from learner.config import WeightSyncConfig

CONFIG = WeightSyncConfig
SECTION = "weights_sync"

log = logging.getLogger("harnessrl.weights_sync")


def main(cfg: WeightSyncConfig, args: argparse.Namespace | None = None) -> int:
    from common import aio

    aio.setup_logging(cfg.log_level, "weights-sync")
    return aio.run(serve(cfg))


async def serve(cfg: WeightSyncConfig) -> int:
    from common import metrics
    from common.bus import connect
    from learner.weights import WeightUpdater, durable_name, engine_apply
    from proxy.sglang import EngineClient

    bus = await connect(cfg.nats, cfg.run)
    client = EngineClient(cfg.engine)
    served = await metrics.start_metrics_server(cfg.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        deadline = loop.time() + cfg.engine_wait_s
        while not await client.health(retries=0, timeout=5.0):
            if loop.time() > deadline or stop.is_set():
                print(f"harnessrl weights-sync: engine {cfg.engine} not healthy", file=sys.stderr)
                return 1
            await asyncio.sleep(1.0)
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


if __name__ == "__main__":  # ``python -m learner.weights_sync_cmd`` is ``harnessrl weights-sync``
    from common.cli import run_module

    run_module("weights-sync")
