"""``harnessrl actor``: run rollouts for a run until SIGTERM/SIGINT.

    harnessrl actor --nats URL --run NAME --engine URL [--engine URL ...] --concurrency K
                    [--sandbox bwrap|docker] [--model tiny|PATH] [--config actor.toml]

Prints ``actor ready: NAME`` once it pulls tasks. On SIGTERM it stops fetching, lets in-flight
rollouts finish for ``shutdown_grace_s`` (a second SIGTERM or SIGINT cuts that short), kills
the rest (their tasks go back to the queue) and exits 0. See ``actors/service.py`` for the loop and ``actors/rollout.py`` for one rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from harnessrl.actors.config import ActorConfig

CONFIG = ActorConfig
SECTION = "actor"

log = logging.getLogger("harnessrl.actor")


async def serve(cfg: ActorConfig, stop: asyncio.Event | None = None, *, backend: Any = None) -> int:
    """Run the actor until ``stop`` (or SIGTERM/SIGINT). ``backend``: a sandbox backend to use
    instead of the configured one (``benchmarks/fleet.py`` passes its no-op backend)."""
    from harnessrl.actors.rollout import RolloutDeps, default_actor_name
    from harnessrl.actors.service import ActorService
    from harnessrl.common import metrics
    from harnessrl.common.bus import connect_service
    from harnessrl.common.procs import raise_open_files_limit

    raise_open_files_limit()  # a few descriptors per rollout in flight: see its docstring
    stop = stop or asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # the first stops fetching; a second ends the grace period
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    name = cfg.name or default_actor_name()
    bus = await connect_service(cfg, f"actor {name}")
    bus.publish_as(name)  # an open server knows no user name: publish under the actor's
    served = await metrics.start_metrics_server(cfg.metrics_port)
    try:
        async with RolloutDeps.open(cfg, bus, actor=name, backend=backend) as deps:
            service = ActorService(cfg, bus, deps)
            port = f", metrics on :{served[1]}" if served else ""
            print(f"actor ready: {name} (run {cfg.run}, {cfg.concurrency} slots{port})", flush=True)
            await service.run(stop, hurry)
            log.info("actor %s stopped after %d rollouts", name, service.done)
    finally:
        await bus.close()
        if served:
            await served[0].cleanup()
    return 0


def main(cfg: ActorConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common.aio import run, setup_logging

    setup_logging(cfg.log_level, "actor")
    return int(run(serve(cfg), subprocesses=True))


if __name__ == "__main__":  # ``python -m harnessrl.actors.actor_cmd`` is ``harnessrl actor``
    from harnessrl.common.cli import run_module

    run_module("actor")
