"""Proxy overhead per model call: TITO prompt building, parsing, recording, engine client.

Baselines measured in the same run:
* TITO prepare+commit vs. a full render + encode of the same conversation (what a proxy
  without token-in-token-out does on every call), at several conversation lengths;
* ``EngineClient.generate`` vs. a bare aiohttp POST of the same body to the same scripted
  engine (the client's own cost over the transport).

Targets (reported, not asserted): TITO at the longest conversation <= 1.5x a full render;
client overhead <= 1.3x the bare POST; recorder ``record()`` <= 2 ms with 100 earlier calls.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp

from benchmarks._common import parse_args, print_table, target, write_result
from common.bus import connect
from common.models import load_tokenizer
from proxy.parsers import HermesParser
from proxy.recorder import Recorder
from proxy.scripted import ScriptedEngine
from proxy.sglang import EngineClient, GenerateResult
from proxy.tito import ChatRenderer, TitoSession

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
    for name in ("bash", "read_file", "write_file", "grep")
]
WORDS = [
    "the",
    "file",
    "test",
    "error",
    "value",
    "function",
    "return",
    "module",
    "import",
    "class",
    "config",
    "path",
    "line",
]


def _text(rng: random.Random, n_words: int) -> str:
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if len(line) >= 12:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)])


def _timeit(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_tito(r: ChatRenderer, turns: int, seed: int = 0) -> dict[str, float]:
    """Run an agent loop of ``turns`` calls; time the last call's prompt both ways."""
    rng = random.Random(seed)
    p = HermesParser()
    s = TitoSession(r)
    msgs = [
        {"role": "system", "content": _text(rng, 300)},
        {"role": "user", "content": _text(rng, 80)},
    ]
    t_tito = []
    for seq in range(turns):
        t0 = time.perf_counter()
        prompt = s.prepare(msgs, TOOLS)
        t1 = time.perf_counter()
        completion = (
            f"{_text(rng, 30)}\n<tool_call>\n"
            + json.dumps({"name": "bash", "arguments": {"arg": _text(rng, 8)}})
            + "\n</tool_call>"
        )
        out = r.encode(completion) + [2]
        reply = p.parse(r.decode(out)).message()
        t2 = time.perf_counter()
        s.commit(seq, prompt, out, reply)
        t_tito.append(t1 - t0 + time.perf_counter() - t2)
        msgs = msgs + [reply, {"role": "tool", "content": _text(rng, 250)}]
    hits = s.counts["hit"]
    n_tokens = len(s.prepare(msgs, TOOLS).input_ids)
    full = _timeit(lambda: r.encode(r.render(msgs, TOOLS, True)), 3)
    last = _timeit(lambda: s.prepare(msgs, TOOLS), 3)
    parse = _timeit(lambda: p.parse(r.decode(out)), 20)
    return {
        "turns": turns,
        "tokens": n_tokens,
        "tito_ms": last * 1e3,
        "full_render_ms": full * 1e3,
        "tito_mean_ms": sum(t_tito) / len(t_tito) * 1e3,
        "parse_ms": parse * 1e3,
        "hits": hits,
    }


async def bench_recorder(n_calls: int, tokens: int) -> dict[str, float]:
    bus = await connect("memory://bench-proxy", "benchproxy")
    rec = Recorder(bus, capacity=n_calls + 10)
    await rec.start()
    rng = random.Random(1)
    ids = [rng.randrange(8000) for _ in range(tokens)]
    times = []
    for _i in range(n_calls):
        ids = ids + [rng.randrange(8000) for _ in range(200)]
        res = GenerateResult([5] * 100, [-0.5] * 100, "stop")
        t = rec.begin("bench-0-1")
        t0 = time.perf_counter()
        rec.record(t, ids, res)
        times.append(time.perf_counter() - t0)
        ids = ids + [5] * 100
    t0 = time.perf_counter()
    await rec.flush("bench-0-1")
    flush_s = time.perf_counter() - t0
    await rec.close()
    await bus.close()
    last = sorted(times[-10:])
    return {
        "calls": n_calls,
        "input_tokens_last": len(ids),
        "record_ms_last": last[len(last) // 2] * 1e3,
        "record_ms_mean": sum(times) / len(times) * 1e3,
        "flush_ms": flush_s * 1e3,
    }


async def bench_client(n: int, prompt_len: int) -> dict[str, float]:
    tok = load_tokenizer("tiny-1m")
    async with ScriptedEngine(tok, lambda ids, body: [5] * 50 + [2]) as eng:
        body = EngineClient(eng.url).generate_payload(list(range(prompt_len)), {}, "x")
        bare = client = 0.0
        async with aiohttp.ClientSession() as sess, EngineClient(eng.url) as c:
            for _ in range(n):  # interleaved, so both see the same engine state
                t0 = time.perf_counter()
                async with sess.post(eng.url + "/generate", json=body) as resp:
                    await resp.json()
                t1 = time.perf_counter()
                await c.generate(list(range(prompt_len)), {}, "x")
                bare += t1 - t0
                client += time.perf_counter() - t1
        bare, client = bare / n, client / n
    return {"bare_post_ms": bare * 1e3, "client_ms": client * 1e3, "prompt_len": prompt_len}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.split("\n")[0], argv)
    r = ChatRenderer(load_tokenizer("tiny-1m"))
    lengths = [10, 40] if args.quick else [10, 50, 150]
    tito = [bench_tito(r, n) for n in lengths]
    recd = asyncio.run(bench_recorder(30 if args.quick else 100, 2000))
    client = asyncio.run(bench_client(100 if args.quick else 400, 4000))

    print_table(
        "TITO prompt building (last call of an agent loop)",
        [
            (
                str(t["turns"]),
                str(t["tokens"]),
                f"{t['tito_ms']:.2f}",
                f"{t['full_render_ms']:.2f}",
                f"{t['tito_ms'] / t['full_render_ms']:.2f}",
                f"{t['parse_ms']:.3f}",
                f"{t['hits']}/{t['turns'] - 1}",
            )
            for t in tito
        ],
        ("turns", "tokens", "tito ms", "full render ms", "ratio", "parse ms", "hits"),
    )
    print_table(
        "Recorder and engine client",
        [
            ("record() last 10 calls (median), ms", f"{recd['record_ms_last']:.3f}"),
            ("record() mean, ms", f"{recd['record_ms_mean']:.3f}"),
            (f"flush {recd['calls']} records (memory bus), ms", f"{recd['flush_ms']:.2f}"),
            ("bare aiohttp POST /generate, ms", f"{client['bare_post_ms']:.3f}"),
            ("EngineClient.generate, ms", f"{client['client_ms']:.3f}"),
        ],
        ("metric", "value"),
    )
    longest = tito[-1]
    tito_ratio = longest["tito_ms"] / longest["full_render_ms"]
    client_ratio = client["client_ms"] / client["bare_post_ms"]
    path = write_result(
        "proxy_overhead",
        {"tito": tito, "recorder": recd, "client_ms": client["client_ms"]},
        {
            "full_render_ms": [t["full_render_ms"] for t in tito],
            "bare_post_ms": client["bare_post_ms"],
        },
        {
            "tito_vs_full_render": target(tito_ratio, 1.5, at_least=False),
            "client_vs_bare_post": target(client_ratio, 1.3, at_least=False),
            "record_ms": target(recd["record_ms_last"], 2.0, at_least=False),
        },
        ratios={"tito_vs_full_render": tito_ratio, "client_vs_bare_post": client_ratio},
        quick=args.quick,
        out=args.out,
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
