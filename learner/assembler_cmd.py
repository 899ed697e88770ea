"""``harnessrl assembler --nats URL --run NAME``: run the tree assembler until SIGTERM or Ctrl-C
(``harnessrl.learner.assembler``). Also runnable as ``python -m harnessrl.learner.assembler_cmd``.
"""

from __future__ import annotations

import argparse

from harnessrl.learner.config import AssemblerConfig

CONFIG = AssemblerConfig
SECTION = "assembler"


def main(cfg: AssemblerConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common import aio
    from harnessrl.learner.assembler import serve

    aio.setup_logging(cfg.log_level, "assembler")
    return aio.run(serve(cfg))


if __name__ == "__main__":
    from harnessrl.common.cli import run_module

    run_module("assembler")
