"""``harnessrl weights-sync --nats URL --run NAME --engine URL``: apply every new weight version
the learner broadcasts to one SGLang-compatible engine (via ``update_weights_from_disk``), in
order, never a partially received one, until SIGTERM or Ctrl-C.

``harnessrl weights-sync --engine URL --load PATH [--load-version V]`` instead loads one HF
folder into the engine once (no NATS needed) and exits: 0 once the engine serves it, 1 with a
one-line error naming the engine and the folder. See ``harnessrl.proxy.weights_sync``.
"""

from __future__ import annotations

import argparse

from harnessrl.proxy.config import WeightSyncConfig

CONFIG = WeightSyncConfig
SECTION = "weights_sync"


def main(cfg: WeightSyncConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common import aio
    from harnessrl.proxy.weights_sync import load_once, serve

    aio.setup_logging(cfg.log_level, "weights-sync")
    return aio.run(load_once(cfg) if cfg.load else serve(cfg))


if __name__ == "__main__":
    from harnessrl.common.cli import run_module

    run_module("weights-sync")
