"""``harnessrl proxy``: serve the model APIs for one sandbox's rollout until SIGTERM/SIGINT.

Prints ``proxy ready: http://HOST:PORT`` once it serves. On shutdown it stops accepting calls
and waits (``flush_timeout_s``) until the bus acknowledged every CallRecord.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from harnessrl.proxy.proxy_config import ProxyConfig

CONFIG = ProxyConfig

log = logging.getLogger("harnessrl.proxy")


async def serve(cfg: ProxyConfig) -> int:
    from harnessrl.common import metrics
    from harnessrl.common.bus import connect_service
    from harnessrl.proxy.server import ProxyServer
    from harnessrl.proxy.stack import open_proxy_stack

    bus = await connect_service(cfg, "proxy")
    served = None
    code = 0
    try:
        async with open_proxy_stack(
            cfg,
            bus,
            record_buffer=cfg.record_buffer,
            health_interval_s=cfg.health_interval_s,
            close_timeout_s=1.0,
        ) as stack:
            for rollout_id in set(cfg.token_map().values()):
                stack.recorder.register(rollout_id, cfg.harness, cfg.harness_version)
            server = ProxyServer(
                stack.caller,
                cfg.token_map(),
                model_name=cfg.model_name,
                host=cfg.host,
                port=cfg.port,
                ping_s=cfg.ping_s,
                stream_grace_s=cfg.stream_grace_s,
                max_body_bytes=cfg.request_limit(stack.max_context),
            )
            await server.start()
            served = await metrics.start_metrics_server(cfg.metrics_port)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            print(f"proxy ready: {server.url} (engines {', '.join(cfg.engines)})", flush=True)
            await stop.wait()
            await server.stop()
            try:
                n = await stack.recorder.flush(timeout=cfg.flush_timeout_s)
                log.info("flushed %d call records", n)
            except Exception as e:
                log.error("call records not all stored: %r", e)
                code = 1
    finally:
        await bus.close()
        if served:
            await served[0].cleanup()
    return code


def main(cfg: ProxyConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common.aio import run, setup_logging

    setup_logging(cfg.log_level, "proxy")
    return int(run(serve(cfg)))


if __name__ == "__main__":  # ``python -m harnessrl.proxy.proxy_cmd`` is ``harnessrl proxy``
    from harnessrl.common.cli import run_module

    run_module("proxy")
