"""``harnessrl learner --nats URL --run NAME --model PATH|tiny --algo grpo|ppo [--sft] ...``:
train on the run's TreeSamples and broadcast new weights until SIGTERM, Ctrl-C or
``--max-steps``. SIGTERM finishes the current step and commits a checkpoint; ``--resume``
continues from it.

Also runnable as ``python -m harnessrl.learner.learner_cmd`` with the same flags.

A fleet of N data-parallel ranks is started by a launcher that sets ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, e.g.
``torchrun --standalone --nproc-per-node 2 -m -- harnessrl.common.cli learner ...`` (the ``--`` keeps
torchrun from reading ``--run`` as its own ``--run-path``): rank 0 is the learner service, the
other ranks follow it (``harnessrl.learner.fleet``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harnessrl.learner import config as _config

CONFIG = _config.LearnerConfig
SECTION = "learner"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        metavar="N",
        help="set by the deepspeed launcher; ignored (ranks are read from RANK, WORLD_SIZE and "
        "LOCAL_RANK, which torchrun and deepspeed both set)",
    )


def main(cfg: Any, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common import aio
    from harnessrl.learner.fleet import world
    from harnessrl.learner.service import follow, serve

    rank, size = world()
    if size > 1:
        from harnessrl.common.procs import die_with_parent

        die_with_parent()  # a rank never outlives its launcher
    aio.setup_logging(cfg.log_level, "learner" if rank == 0 else f"learner-rank{rank}")
    try:
        if rank > 0:
            return follow(cfg)
        return aio.run(serve(cfg))
    except RuntimeError as e:
        print(f"harnessrl learner: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # ``python -m harnessrl.learner.learner_cmd`` is ``harnessrl learner``
    from harnessrl.common.cli import run_module

    run_module("learner")
