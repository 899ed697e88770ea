"""Embedded engine: tokens/s of 16 concurrent requests vs 1, prefix-cache reuse, lean forward.

``python -m benchmarks.engine_batching [--quick] [--model tiny]``

Runs a real ``EngineServer`` in this process and drives it over loopback HTTP, as the proxy does:

* baseline: one request at a time (decode batch of 1);
* batched: 16 concurrent requests (one packed forward per step) — target >= 4x the baseline
  (the two loads alternate a few times; each keeps its best run);
* prefix cache: time to first token of a long prompt, cold vs. a request that extends an
  earlier prompt + reply (the harness resending its history every turn);
* lean forward: a second engine with ``lean_forward = false`` (the ``transformers`` module
  tree) runs the same loads at 1, 8 and 16 concurrent requests, alternating with the lean one;
  reported as tokens/s, time per scheduler step, and the scheduler thread's CPU time per step
  (what a busy machine distorts least) with the ratio transformers / lean.

torch runs one thread by default (``--threads``): on a shared machine, oversubscribed OpenMP
threads make every number erratic.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from benchmarks._common import parse_args, print_table, target, write_result

NAME = "engine_batching"
TARGET_RATIO = 4.0


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8000) for _ in range(n)]


async def _generate(http: Any, ids: list[int], max_new: int) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    async with http.post("/generate", json=body) as r:
        reply = await r.json()
        assert r.status == 200, reply
        return reply


async def _throughput(http: Any, concurrency: int, max_new: int, seed: int) -> float:
    """Aggregate sampled tokens per second with ``concurrency`` requests in flight."""
    start = time.perf_counter()
    replies = await asyncio.gather(
        *(_generate(http, _ids(32, 1000 * seed + i), max_new) for i in range(concurrency))
    )
    tokens = sum(x["meta_info"]["completion_tokens"] for x in replies)
    return tokens / (time.perf_counter() - start)


async def _first_token_s(http: Any, ids: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    reply = await _generate(http, ids, 1)
    return time.perf_counter() - start, reply["meta_info"]["cached_tokens"]


async def _lean_vs_hf(
    model: str, threads: int, max_new: int, repeats: int
) -> dict[str, dict[int, dict[str, float]]]:
    """Tokens/s, seconds per step and scheduler CPU seconds per step of the lean and the
    transformers forward at 1/8/16 concurrent requests, the two engines alternating; each
    keeps its run of least CPU per step (wall times on a busy machine include waiting for a
    core; CPU time mostly does not)."""
    import aiohttp

    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import EngineServer

    best: dict[str, dict[int, dict[str, float]]] = {"lean": {}, "hf": {}}
    async with contextlib.AsyncExitStack() as stack:
        sessions = {}
        for name, lean in (("lean", True), ("hf", False)):
            cfg = EngineConfig(
                model=model, port=0, max_batch_size=16, threads=threads, lean_forward=lean
            )
            srv = await stack.enter_async_context(EngineServer(cfg))
            if (srv.engine.lean is not None) != lean:
                raise RuntimeError(f"{model}: the lean forward is not available")
            http = await stack.enter_async_context(aiohttp.ClientSession(srv.url))
            await _generate(http, _ids(16, 0), 4)  # warm-up
            sessions[name] = (srv, http)
        for r in range(repeats):
            for conc in (1, 8, 16):
                for name, (srv, http) in sessions.items():
                    eng = srv.engine
                    steps, cpu = eng.steps, eng.step_cpu_s
                    start = time.perf_counter()
                    tps = await _throughput(http, conc, max_new, seed=r)
                    n = max(eng.steps - steps, 1)
                    step_s = (time.perf_counter() - start) / n
                    cpu_s = (eng.step_cpu_s - cpu) / n
                    old = best[name].get(conc)
                    if old is None or cpu_s < old["step_cpu_s"]:
                        best[name][conc] = {"tokens_per_s": tps, "step_s": step_s}
                        best[name][conc]["step_cpu_s"] = cpu_s
    return best


async def run(quick: bool, model: str, threads: int) -> dict[str, Any]:
    import aiohttp

    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import EngineServer

    max_new = 48 if quick else 128
    repeats = 2 if quick else 4
    long_prompt = 2000 if quick else 8000
    cfg = EngineConfig(model=model, port=0, max_batch_size=16, threads=threads)
    async with EngineServer(cfg) as srv, aiohttp.ClientSession(srv.url) as http:
        await _generate(http, _ids(16, 0), 4)  # warm-up
        # Alternate the two loads and keep each one's best run: on a shared machine the least
        # disturbed run is the closest to what the engine can do.
        single = batched = 0.0
        for r in range(repeats):
            single = max(single, await _throughput(http, 1, max_new, seed=r))
            batched = max(batched, await _throughput(http, 16, max_new, seed=r))
        prompt = _ids(long_prompt, 7)
        cold_s, _ = await _first_token_s(http, prompt)
        first = await _generate(http, prompt, 16)
        turn2 = prompt + first["output_ids"] + _ids(64, 8)
        warm_s, cached = await _first_token_s(http, turn2)
        folder = str(srv.engine.folder)
    lean = await _lean_vs_hf(model, threads, max_new // 2, repeats)
    return {
        "model": folder,
        "threads": threads,
        "max_new_tokens": max_new,
        "repeats": repeats,
        "tokens_per_s_1": single,
        "tokens_per_s_16": batched,
        "ratio": batched / single,
        "prompt_tokens": long_prompt,
        "cold_first_token_s": cold_s,
        "cached_first_token_s": warm_s,
        "cached_tokens": cached,
        "cache_speedup": cold_s / warm_s,
        "lean": lean,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    extra = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    extra.add_argument("--model", default="tiny", help="model folder or tiny spec")
    extra.add_argument("--threads", type=int, default=1, help="torch threads (0 = all cores)")
    known, rest = extra.parse_known_args(argv)
    args = parse_args(__doc__.splitlines()[0], rest)
    from harnessrl.common.aio import run as run_loop

    r = run_loop(run(args.quick, known.model, known.threads))
    print_table(
        f"{NAME} ({r['model']}, {r['max_new_tokens']} new tokens per request)",
        [
            ("1 request", f"{r['tokens_per_s_1']:.1f}", "baseline"),
            ("16 concurrent", f"{r['tokens_per_s_16']:.1f}", f"{r['ratio']:.2f}x"),
        ],
        ("load", "tokens/s", "vs 1"),
    )
    print_table(
        f"prefix cache ({r['prompt_tokens']}-token prompt, time to first token)",
        [
            ("cold", f"{r['cold_first_token_s'] * 1000:.0f} ms", "0"),
            (
                "extends earlier turn",
                f"{r['cached_first_token_s'] * 1000:.0f} ms",
                str(r["cached_tokens"]),
            ),
        ],
        ("request", "first token", "cached tokens"),
    )
    lean, hf = r["lean"]["lean"], r["lean"]["hf"]
    print_table(
        "lean forward vs transformers forward (same run, alternating)",
        [
            (
                str(c),
                f"{hf[c]['tokens_per_s']:.1f}",
                f"{lean[c]['tokens_per_s']:.1f}",
                f"{hf[c]['step_s'] * 1000:.2f} ms",
                f"{lean[c]['step_s'] * 1000:.2f} ms",
                f"{hf[c]['step_cpu_s'] * 1000:.2f} ms",
                f"{lean[c]['step_cpu_s'] * 1000:.2f} ms",
                f"{hf[c]['step_cpu_s'] / lean[c]['step_cpu_s']:.2f}x",
            )
            for c in sorted(lean)
        ],
        (
            "requests",
            "hf tok/s",
            "lean tok/s",
            "hf step",
            "lean step",
            "hf cpu",
            "lean cpu",
            "hf / lean cpu",
        ),
    )
    print(f"\nbatching ratio {r['ratio']:.2f}x (target >= {TARGET_RATIO}x); ", end="")
    print(f"cache speedup {r['cache_speedup']:.1f}x")
    path = write_result(
        NAME,
        metrics={
            **{k: r[k] for k in ("tokens_per_s_16", "cached_first_token_s", "cached_tokens")},
            **{f"lean_tokens_per_s_{c}": v["tokens_per_s"] for c, v in lean.items()},
            **{f"lean_step_s_{c}": v["step_s"] for c, v in lean.items()},
            **{f"lean_step_cpu_s_{c}": v["step_cpu_s"] for c, v in lean.items()},
        },
        baseline={
            **{k: r[k] for k in ("tokens_per_s_1", "cold_first_token_s")},
            **{f"hf_tokens_per_s_{c}": v["tokens_per_s"] for c, v in hf.items()},
            **{f"hf_step_s_{c}": v["step_s"] for c, v in hf.items()},
            **{f"hf_step_cpu_s_{c}": v["step_cpu_s"] for c, v in hf.items()},
        },
        targets={"batching_ratio": target(r["ratio"], TARGET_RATIO)},
        ratios={
            "batching": r["ratio"],
            "prefix_cache_first_token": r["cache_speedup"],
            **{
                f"lean_vs_hf_tokens_per_s_{c}": lean[c]["tokens_per_s"] / hf[c]["tokens_per_s"]
                for c in sorted(lean)
            },
            **{
                f"hf_vs_lean_step_cpu_{c}": hf[c]["step_cpu_s"] / lean[c]["step_cpu_s"]
                for c in sorted(lean)
            },
        },
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
