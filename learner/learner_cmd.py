"""``harnessrl learner --nats URL --run NAME --model PATH|tiny --algo grpo|ppo [--sft] ...``:
train on the run's TreeSamples and broadcast new weights until SIGTERM, Ctrl-C or
``--max-steps`` (``harnessrl.learner.service``). SIGTERM finishes the current step and commits
a checkpoint; ``--resume`` continues from it.

A fleet of N data-parallel ranks is started by a launcher that sets ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, e.g. ``torchrun --standalone --nproc-per-node 2
-m -- harnessrl.common.cli learner ...`` (the ``--`` keeps torchrun from reading ``--run`` as its
own ``--run-path``): rank 0 is the learner service, the other ranks follow it.
"""

from __future__ import annotations

import argparse

from harnessrl.common import tracking
from harnessrl.learner.config import LearnerConfig

CONFIG = LearnerConfig
SECTION = "learner"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    help = "set by the deepspeed launcher; ignored (ranks come from RANK, WORLD_SIZE, LOCAL_RANK)"
    parser.add_argument("--local-rank", "--local_rank", type=int, metavar="N", help=help)
    tracking.add_arguments(parser)  # --wandb [PROJECT], --tensorboard DIR


def main(cfg: LearnerConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.learner.service import main

    return main(cfg)


if __name__ == "__main__":  # ``python -m harnessrl.learner.learner_cmd`` is ``harnessrl learner``
    from harnessrl.common.cli import run_module

    run_module("learner")
