"""``harnessrl actor``: run rollouts for a run until SIGTERM/SIGINT.

    harnessrl actor --nats URL --run NAME --engine URL [--engine URL ...] --concurrency K
                    [--sandbox bwrap|docker] [--model tiny|PATH] [--config actor.toml]

Prints ``actor ready: NAME`` once it pulls tasks. On SIGTERM it stops fetching, lets in-flight
rollouts finish for ``shutdown_grace_s`` (a second SIGTERM or SIGINT cuts that short), kills
the rest (their tasks go back to the queue) and exits 0. See ``harnessrl.actors.service``.
"""

from __future__ import annotations

import argparse

from harnessrl.actors.config import ActorConfig

CONFIG = ActorConfig
SECTION = "actor"


def main(cfg: ActorConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.actors.service import serve
    from harnessrl.common.aio import run, setup_logging

    setup_logging(cfg.log_level, "actor")
    return int(run(serve(cfg), subprocesses=True))


if __name__ == "__main__":  # ``python -m harnessrl.actors.actor_cmd`` is ``harnessrl actor``
    from harnessrl.common.cli import run_module

    run_module("actor")
