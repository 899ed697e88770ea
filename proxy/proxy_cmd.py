"""``harnessrl proxy``: serve the model APIs for one sandbox's rollout until SIGTERM/SIGINT.

Prints ``proxy ready: http://HOST:PORT`` once it serves. On shutdown it stops accepting calls
and waits (``flush_timeout_s``) until the bus acknowledged every CallRecord
(``harnessrl.proxy.stack.serve``).
"""

from __future__ import annotations

import argparse

from harnessrl.proxy.proxy_config import ProxyConfig

CONFIG = ProxyConfig


def main(cfg: ProxyConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common.aio import run, setup_logging
    from harnessrl.proxy.stack import serve

    setup_logging(cfg.log_level, "proxy")
    return int(run(serve(cfg)))


if __name__ == "__main__":  # ``python -m harnessrl.proxy.proxy_cmd`` is ``harnessrl proxy``
    from harnessrl.common.cli import run_module

    run_module("proxy")
