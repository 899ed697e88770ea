"""``harnessrl assembler --nats URL --run NAME``: run the tree assembler until SIGTERM or Ctrl-C.

Also runnable as ``python -m harnessrl.learner.assembler_cmd`` with the same flags.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from harnessrl.learner.config import AssemblerConfig

CONFIG = AssemblerConfig
SECTION = "assembler"


def main(cfg: AssemblerConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common import aio

    aio.setup_logging(cfg.log_level, "assembler")
    return aio.run(serve(cfg))


async def serve(cfg: AssemblerConfig) -> int:
    """Connect, serve ``/metrics``, run the loop; a signal cancels it (in-flight results are
    nak'ed for the next assembler: nothing is acked before its sample is stored) and interrupts
    the bus (nothing waits for an unreachable NATS)."""
    from harnessrl.common import metrics
    from harnessrl.common.bus import connect_service
    from harnessrl.learner.assembler import Assembler

    bus = await connect_service(cfg, "assembler")
    served = await metrics.start_metrics_server(cfg.metrics_port)
    if served:
        print(f"assembler: metrics on :{served[1]}/metrics", file=sys.stderr, flush=True)
    task = asyncio.create_task(Assembler(bus, cfg).run())
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        bus.interrupt()
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        if served:
            await served[0].cleanup()
        await bus.close()
    return 0


if (
    __name__ == "__main__"
):  # ``python -m harnessrl.learner.assembler_cmd`` is ``harnessrl assembler``
    from harnessrl.common.cli import run_module

    run_module("assembler")
