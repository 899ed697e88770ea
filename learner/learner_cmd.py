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


def _standalone(argv: list[str]) -> int:
    from common.config import ConfigError, add_config_args, config_from_args, dump_toml

    parser = argparse.ArgumentParser(prog="harnessrl learner", description=__doc__)
    add_config_args(parser, CONFIG)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(CONFIG, args, section=SECTION)
    except ConfigError as e:
        print(f"harnessrl learner: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_toml(cfg))
        return 0
    return main(cfg, args)


if __name__ == "__main__":
    sys.exit(_standalone(sys.argv[1:]))
