"""``harnessrl proxy``: serve the model APIs for one sandbox's rollout until SIGTERM/SIGINT.

Prints ``proxy ready: http://HOST:PORT`` once it serves. On shutdown it stops accepting calls
and waits (``flush_timeout_s``) until the bus acknowledged every CallRecord.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from proxy.proxy_config import ProxyConfig

CONFIG = ProxyConfig

log = logging.getLogger("harnessrl.proxy")


async def serve(cfg: ProxyConfig) -> int:
    from common import metrics
    from common.bus import connect
    from common.models import load_tokenizer
    from common.records import SamplingParams
    from proxy.calls import ModelCaller
    from proxy.parsers import get_parser
    from proxy.recorder import Recorder
    from proxy.server import ProxyServer
    from proxy.sglang import EngineRouter
    from proxy.tito import ChatRenderer

    bus = await connect(cfg.nats, cfg.run)
    router = EngineRouter(cfg.engines, health_interval=cfg.health_interval_s)
    await router.start()
    max_context = cfg.max_context
    if not max_context:
        info = await router.model_info()
        keys = ("context_length", "max_context_length", "max_position_embeddings")
        max_context = int(next((info[k] for k in keys if info.get(k)), 0))
    renderer = ChatRenderer(load_tokenizer(cfg.model))
    recorder = await Recorder(bus, capacity=cfg.record_buffer).start()
    sampling = SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
    )
    caller = ModelCaller(
        router,
        renderer,
        get_parser(cfg.parser),
        recorder,
        sampling=sampling,
        max_context=max_context,
    )
    server = ProxyServer(
        caller,
        cfg.token_map(),
        model_name=cfg.model_name,
        host=cfg.host,
        port=cfg.port,
        ping_s=cfg.ping_s,
        stream_grace_s=cfg.stream_grace_s,
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
    code = 0
    try:
        n = await recorder.flush(timeout=cfg.flush_timeout_s)
        log.info("flushed %d call records", n)
    except Exception as e:
        log.error("call records not all stored: %r", e)
        code = 1
    await recorder.close(timeout=1)
    await router.close()
    await bus.close()
    if served:
        await served[0].cleanup()
    return code


def main(cfg: ProxyConfig, args: argparse.Namespace | None = None) -> int:
    from common.aio import run, setup_logging

    setup_logging(cfg.log_level, "proxy")
    return int(run(serve(cfg)))


if __name__ == "__main__":  # ``python -m proxy.proxy_cmd`` is ``harnessrl proxy``
    from common.cli import run_module

    run_module("proxy")
