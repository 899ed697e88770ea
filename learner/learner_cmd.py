"""``harnessrl learner --nats URL --run NAME --model PATH|tiny --algo grpo|ppo [--sft] ...``:
train on the run's TreeSamples and broadcast new weights until SIGTERM, Ctrl-C or
``--max-steps``. SIGTERM finishes the current step and commits a checkpoint; ``--resume``
continues from it.

Also runnable as ``python -m learner.learner_cmd`` with the same flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from learner import config as _config

CONFIG = _config.LearnerConfig
SECTION = "learner"


def main(cfg: Any, args: argparse.Namespace | None = None) -> int:
    from common import aio
    from learner.service import serve

    aio.setup_logging(cfg.log_level, "learner")
    try:
        return aio.run(serve(cfg))
    except RuntimeError as e:
        print(f"harnessrl learner: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # ``python -m learner.learner_cmd`` is ``harnessrl learner``
    from common.cli import run_module

    run_module("learner")
