"""One harness sending huge request bodies: how much it slows the other rollouts of its actor.

The proxies of an actor's rollouts share the actor's process and event loop (one
``ProxyServer`` per rollout over one ``ModelCaller``, as ``harnessrl.actors.rollout`` wires
them). This benchmark runs exactly that in this process — ``SIBLINGS`` + 1 proxies on one loop,
the tiny model's real tokenizer and template, a 32k context, CallRecords on an in-memory bus —
against a scripted engine in a child process that takes ``ENGINE_MS`` per call (a fast GPU
engine). In a second child process the siblings run agent loops (chat completions with tool
round trips, one call after the other); in a third the hostile harness sends, over and over:

* ``content_length``: a 50 MB body announced by its ``Content-Length``;
* ``chunked``: a 50 MB chunked body (no length announced);
* ``at_limit``: a valid request just under the proxy's body limit (32 B per context token +
  4 MiB), its text far too long for the context: the most work a harness can still ask for;
* ``at_limit_own_process``: the same, sent to a proxy of its own in another process (what a
  proxy process per sandbox would be): the design alternative, measured in the same run.

Phases alternate (``baseline`` with the hostile harness idle, then each mode) over several
rounds; every sibling call is assigned to the phase it started in. Metric per mode: the
siblings' call p99 as a ratio to their p99 in the baseline phases of the same run.

Targets (reported, not asserted): the p99 ratio <= 1.5 for the 50 MB bodies, with and without
``Content-Length``; ``at_limit`` and ``at_limit_own_process`` are reported against the same
bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

import aiohttp

from benchmarks._common import WORDS, parse_args, print_table, spawn_child, target, write_result

CONTEXT = 32768
"""The context window the proxies check against (it sizes their body limit)."""
ENGINE_MS = 20.0
"""How long the scripted engine takes per call."""
SIBLINGS = 4
"""Rollouts making calls beside the hostile one."""
BODY_MB = 50
"""Size of the hostile bodies of the ``content_length`` and ``chunked`` modes."""
MODES = ("content_length", "chunked", "at_limit", "at_limit_own_process")
HOSTILE_NICE = 10
"""The hostile harness's process runs at a lower CPU priority, as a sandboxed harness should
(the actor must not lose its CPU to one): what is measured is what the proxy does with its
bodies, not the machine's cores given to producing them."""
LAG_TICK_S = 0.005
"""Period of the probe that measures the proxy's event-loop lag."""
TURNS = 10
"""Calls of one sibling's agent loop before it starts over (~3k tokens at the end)."""
TOKEN = "sk-bench-{}"
REPLY = (
    '<tool_call>\n{"name": "bash", "arguments": {"command": "cat module/config.py"}}\n</tool_call>'
)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---------------------------------------------------------------------------------------------
# child processes: the engine, the siblings, the hostile harness
# ---------------------------------------------------------------------------------------------


def _serve_engine(conn: Any) -> None:
    """A scripted engine answering a tool call after ``ENGINE_MS``."""
    from harnessrl.proxy.scripted import Reply, ScriptedEngine

    async def serve() -> None:
        eng: ScriptedEngine

        def script(input_ids: list[int], body: dict[str, Any]) -> Reply:
            eng.requests.clear()  # it keeps every body otherwise
            return Reply(text=REPLY, delay=ENGINE_MS / 1000)

        eng = await ScriptedEngine("tiny-1m", script).start()
        conn.send(eng.url)
        await asyncio.Event().wait()

    asyncio.run(serve())


def _siblings(conn: Any, urls: list[str]) -> None:
    """Agent loops against ``urls`` (one each) until told to stop; sends back every call as
    ``(start, seconds)`` (``time.monotonic``: one clock for every process of the machine)."""

    async def loop(i: int, url: str, calls: list[tuple[float, float]], stop: asyncio.Event):
        rng = random.Random(i)
        headers = {"Authorization": f"Bearer {TOKEN.format(i)}"}
        tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
        async with aiohttp.ClientSession(url) as http:
            while not stop.is_set():
                msgs = [{"role": "user", "content": _words(rng, 200)}]
                for t in range(TURNS):
                    if stop.is_set():
                        break
                    body = {"model": "m", "messages": msgs, "tools": tools, "max_tokens": 64}
                    t0 = time.monotonic()
                    async with http.post("/v1/chat/completions", json=body, headers=headers) as r:
                        reply = await r.json()
                    calls.append((t0, time.monotonic() - t0))
                    msg = reply["choices"][0]["message"]
                    msgs += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"]}]
                    msgs[-1]["content"] = _words(rng, 150 + 10 * t)

    async def main() -> None:
        stop = asyncio.Event()
        calls: list[tuple[float, float]] = []
        tasks = [asyncio.ensure_future(loop(i, u, calls, stop)) for i, u in enumerate(urls)]
        conn.send("ready")
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        stop.set()
        await asyncio.gather(*tasks)
        conn.send(calls)

    asyncio.run(main())


def _hostile(conn: Any, url: str, own_url: str, at_limit_bytes: int) -> None:
    """Sends the body of the mode it is told (None: stays idle) until told otherwise; counts
    the answers by status."""
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (BODY_MB << 20)
    text = "word " * ((at_limit_bytes - 1024) // 5)
    at_limit = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})

    async def send(mode: str) -> int:
        own = mode == "at_limit_own_process"
        host, port = (own_url if own else url).removeprefix("http://").split(":")
        token = TOKEN.format("own" if own else "hostile")
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
        )
        reader, writer = await asyncio.open_connection(host, int(port))
        if mode == "content_length":
            writer.write(f"{head}Content-Length: {len(big) + 4}\r\n\r\n".encode())
            frames = [big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)]
        elif mode == "chunked":
            writer.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            frames = [
                f"{len(c):x}\r\n".encode() + c + b"\r\n"
                for c in (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))
            ]
        else:
            data = at_limit.encode()
            writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
            frames = []
        answer = asyncio.ensure_future(reader.readline())
        try:
            for f in frames:
                if answer.done():
                    break
                writer.write(f)
                await writer.drain()
            status = int((await asyncio.wait_for(answer, 60)).split()[1])
        except (ConnectionError, IndexError, TimeoutError):
            status = 0
        writer.transport.abort()
        return status

    async def main() -> None:
        os.nice(HOSTILE_NICE)
        loop = asyncio.get_running_loop()
        statuses: dict[str, dict[int, int]] = {m: {} for m in MODES}
        mode: str | None = None
        told = asyncio.ensure_future(loop.run_in_executor(None, conn.recv))
        conn.send("ready")
        while True:
            if told.done():
                mode = told.result()
                if mode == "stop":
                    break
                told = asyncio.ensure_future(loop.run_in_executor(None, conn.recv))
            if mode is None:
                await asyncio.wait({told})
                continue
            status = await send(mode)
            statuses[mode][status] = statuses[mode].get(status, 0) + 1
        conn.send(statuses)

    asyncio.run(main())


def _own_proxy(conn: Any, engine_url: str) -> None:
    """A proxy for the hostile harness alone, in a process of its own."""

    async def serve() -> None:
        server, _ = await _proxies(engine_url, ["own"])
        conn.send(server[0].url)
        await asyncio.Event().wait()

    asyncio.run(serve())


async def _proxies(engine_url: str, names: list[str]) -> tuple[list[Any], list[Any]]:
    """One ``ProxyServer`` per name over one ``ModelCaller``, as an actor wires its rollouts'
    proxies; and what to close."""
    from harnessrl.common.bus import connect
    from harnessrl.common.models import load_tokenizer
    from harnessrl.proxy.calls import ModelCaller
    from harnessrl.proxy.parsers import HermesParser
    from harnessrl.proxy.recorder import Recorder
    from harnessrl.proxy.server import ProxyServer
    from harnessrl.proxy.sglang import EngineClient
    from harnessrl.proxy.tito import ChatRenderer

    bus = await connect("memory://big-body", "bench")
    recorder = await Recorder(bus, capacity=1 << 16).start()
    client = EngineClient(engine_url)
    renderer = ChatRenderer(load_tokenizer("tiny-1m"))
    caller = ModelCaller(client, renderer, HermesParser(), recorder, max_context=CONTEXT)
    servers = [
        await ProxyServer(caller, {TOKEN.format(n): f"bench-{n}-0-1"}).start() for n in names
    ]
    return servers, [recorder, client, bus]


# ---------------------------------------------------------------------------------------------
# the actor: the proxies on one loop
# ---------------------------------------------------------------------------------------------


async def run(quick: bool) -> dict[str, Any]:
    rounds, phase_s = (1, 3.0) if quick else (4, 8.0)
    engine, engine_conn = spawn_child(_serve_engine)
    engine_url = engine_conn.recv()
    servers, closing = await _proxies(engine_url, [*map(str, range(SIBLINGS)), "hostile"])
    limit = servers[0].max_body_bytes
    procs = [engine]
    try:
        own, own_conn = spawn_child(_own_proxy, engine_url)
        procs.append(own)
        sib, sib_conn = spawn_child(_siblings, [s.url for s in servers[:SIBLINGS]])
        host, host_conn = spawn_child(_hostile, servers[-1].url, own_conn.recv(), limit)
        procs += [sib, host]
        assert sib_conn.recv() == host_conn.recv() == "ready"
        await asyncio.sleep(1.0)  # the siblings' first calls warm everything up
        lags: list[tuple[float, float]] = []
        probe = asyncio.ensure_future(_lag_probe(lags))
        phases: list[tuple[str, float, float]] = []
        cpu = {m: 0.0 for m in ("baseline", *MODES)}
        for _ in range(rounds):
            for mode in ("baseline", *MODES):
                host_conn.send(None if mode == "baseline" else mode)
                t0, c0 = time.monotonic(), time.process_time()
                await asyncio.sleep(phase_s)
                cpu[mode] += time.process_time() - c0
                phases.append((mode, t0 + 0.25, time.monotonic()))  # settle after a switch
        probe.cancel()
        host_conn.send("stop")
        sib_conn.send("stop")
        calls = await asyncio.get_running_loop().run_in_executor(None, sib_conn.recv)
        statuses = await asyncio.get_running_loop().run_in_executor(None, host_conn.recv)
    finally:
        for p in procs:
            p.kill()
        for s in servers:
            await s.stop()
        recorder, client, bus = closing
        await recorder.close(1.0)
        await client.close()
        await bus.close()
    return {
        "latency": _by_phase(calls, phases),
        "lag": _by_phase(lags, phases),
        "cpu": {m: c / (rounds * phase_s) for m, c in cpu.items()},
        "statuses": statuses,
        "limit": limit,
    }


async def _lag_probe(out: list[tuple[float, float]]) -> None:
    """How late the proxy's event loop wakes a ``LAG_TICK_S`` sleep: ``(start, late s)``."""
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(LAG_TICK_S)
        out.append((t0, time.monotonic() - t0 - LAG_TICK_S))


def _by_phase(
    samples: list[tuple[float, float]], phases: list[tuple[str, float, float]]
) -> dict[str, list[float]]:
    """Each ``(start, seconds)`` sample, in ms, under the phase it started in."""
    out: dict[str, list[float]] = {m: [] for m in ("baseline", *MODES)}
    for start, took in samples:
        for mode, a, b in phases:
            if a <= start < b:
                out[mode].append(took * 1000)
    return out


def _p(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q) - 1] if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.split("\n")[0], argv)
    out = asyncio.run(run(args.quick))
    lat = out["latency"]
    base99 = _p(lat["baseline"], 99)
    rows, metrics, ratios = [], {}, {}
    for mode in ("baseline", *MODES):
        xs, lag = lat[mode], out["lag"][mode]
        p50, p99 = _p(xs, 50), _p(xs, 99)
        metrics[mode] = {
            "calls": len(xs),
            "p50_ms": round(p50, 2),
            "p99_ms": round(p99, 2),
            "max_ms": round(max(xs, default=0.0), 2),
            "loop_lag_p99_ms": round(_p(lag, 99), 2),
            "loop_lag_max_ms": round(max(lag, default=0.0), 2),
            "proxy_cpu": round(out["cpu"][mode], 3),
            "hostile_answers": {str(k): v for k, v in out["statuses"].get(mode, {}).items()},
        }
        if mode != "baseline":
            ratios[f"{mode}_p99_vs_baseline"] = round(p99 / base99, 3) if base99 else 0.0
        answers = ", ".join(f"{k}: {v}" for k, v in metrics[mode]["hostile_answers"].items())
        rows.append(
            (
                mode,
                str(len(xs)),
                f"{p50:.1f}",
                f"{p99:.1f}",
                f"{p99 / base99:.2f}",
                f"{_p(lag, 99):.1f} / {max(lag, default=0.0):.1f}",
                f"{out['cpu'][mode]:.2f}",
                answers or "-",
            )
        )
    print_table(
        f"Sibling rollouts' calls while one harness sends huge bodies ({SIBLINGS} siblings, "
        f"engine {ENGINE_MS:g} ms/call, body limit {out['limit']} bytes)",
        rows,
        (
            "phase",
            "calls",
            "p50 ms",
            "p99 ms",
            "p99 / baseline",
            "loop lag p99 / max ms",
            "proxy cpu",
            "hostile answers",
        ),
    )
    targets = {
        f"{m}_p99_ratio": target(ratios[f"{m}_p99_vs_baseline"], 1.5, at_least=False) for m in MODES
    }
    path = write_result(
        "proxy_big_body",
        {**metrics, "body_limit_bytes": out["limit"], "hostile_body_mb": BODY_MB},
        {"baseline_p99_ms": round(base99, 2), "engine_ms": ENGINE_MS, "siblings": SIBLINGS},
        targets,
        ratios=ratios,
        quick=args.quick,
        out=args.out,
    )
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
