"""Sandbox lifecycle cost: create + run ``true`` + destroy, against a bare ``bwrap true``.

    python -m benchmarks.sandbox_lifecycle [--quick]

Floor (same run): a bare ``bwrap`` with the same namespaces and only ``/usr`` bound, running
``true`` — what no bwrap design can beat (namespace creation, the network namespace above all).
Also measured, in one pass after the rounds (its own floor beside them:
``info_pass_vs_its_floor``): a plain ``create_subprocess_exec("true")`` (the old baseline), one
``run`` in an existing sandbox without a proxy, with ``proxy=False`` in a sandbox that has one,
through the compiled forwarder and through the Python one (``_forwarder.py``, the fallback and
what every run paid before), and whole lifecycles without a pool, and pooled with the Python
forwarder (the state before the compiled one).

Target ``lifecycle_vs_bwrap_floor``: a rollout's sandbox with its proxy forwarder, from the warm
pool (`harnessrl.actors.sandbox.base.SandboxPool`: blanks made ahead, removal in the background; the
refill runs during the measurement) — create + ``run(["true"])`` through the forwarder +
destroy, p50 — over the floor's p50; the value is the median of the ratios of 3 rounds (each
round the floor and the pooled lifecycle in alternating blocks). Reported
beside it: ``ready`` (p50 of the pooled ``create``: until the rollout can start its command)
and CPU per sandbox (this process and its children, refill and background removal included:
the pool is drained and refilled inside the measured span), against the floor's CPU per call.

Docker: the same cases on the engine at ``$DOCKER_HOST`` when one answers, else on a private
dockerd started for the run (root + ``docker.io`` installed); the image is imported from the
cached rootfs (`harnessrl.actors.sandbox.docker_image`). Target ``docker_pooled_lifecycle_p50_ms``: a
rollout's container with its forwarder from the pool (``pool_size`` ``POOL_SIZE``: containers of
the spec's shape started ahead, removal in the background; refills run during the measurement)
— create + ``run(["true"])`` through the forwarder + destroy, p50, at most
``DOCKER_TARGET_MS``; beside it the unpooled ``lifecycle`` (create, start, run, remove). When no
engine works the docker cases are skipped and the reason is printed and recorded
(``docker_skipped``), as when ``$HRL_BENCH_SKIP_DOCKER`` is set (its value is the reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from benchmarks._common import parse_args, print_table, target, write_result
from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.sandbox.bwrap import BwrapBackend

TARGET_RATIO = 2.5
"""Pooled lifecycle with forwarder ÷ bare ``bwrap true``."""
ROUNDS = 3
"""Rounds of all cases; the target's value is the median of the rounds' ratios."""
POOL_SIZE = 2
"""Blanks the pooled backend keeps ready (the actor's default ``sandbox_pool``)."""
DOCKER_TARGET_MS = 200.0
"""Pooled docker lifecycle with forwarder, p50 (pre-created containers)."""


async def timed(
    cases: dict[str, Callable[[], Awaitable[object]]], n: int, blocks: int = 5, warmup: int = 3
) -> dict[str, list[float]]:
    """Each case in ``blocks`` separate blocks (ABCD ABCD ...), a pause before each block.

    Blocks, not strict alternation: tearing down a network namespace leaves the kernel work
    (netns cleanup) that would land on the next measurement, the baseline's included; blocks
    spread slow drifts of a shared machine over all cases.
    """
    out: dict[str, list[float]] = {k: [] for k in cases}
    per_block = max(1, n // blocks)
    for _ in range(blocks):
        for name, fn in cases.items():
            await asyncio.sleep(0.2)
            for i in range(warmup + per_block):
                t0 = time.perf_counter()
                await fn()
                if i >= warmup:
                    out[name].append(time.perf_counter() - t0)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "p50_ms": round(statistics.median(xs) * 1e3, 3),
        "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3),
        "mean_ms": round(statistics.fmean(xs) * 1e3, 3),
        "n": len(xs),
    }


class DockerSkipped(Exception):
    """No docker engine could be reached or started here (the message says why)."""


@contextlib.asynccontextmanager
async def docker_engine(tmp: Path) -> AsyncIterator[str]:
    """URL of an engine with the sandbox image: ``$DOCKER_HOST``'s, else a private dockerd."""
    from harnessrl.actors.sandbox.docker_image import PrivateDockerd, ensure_image

    if reason := os.environ.get("HRL_BENCH_SKIP_DOCKER"):
        raise DockerSkipped(f"HRL_BENCH_SKIP_DOCKER: {reason}")
    url = os.environ.get("DOCKER_HOST")
    if url:
        try:
            await ensure_image(url)
        except Exception as e:
            raise DockerSkipped(f"DOCKER_HOST={url}: {e}") from e
        yield url
        return
    daemon = PrivateDockerd(tmp / "dockerd")
    try:
        await asyncio.to_thread(daemon.start)
        await ensure_image(daemon.url)
    except Exception as e:
        await asyncio.to_thread(daemon.stop)
        raise DockerSkipped(f"private dockerd: {e}") from e
    try:
        yield daemon.url
    finally:
        await asyncio.to_thread(daemon.stop)


async def docker_cases(tmp: Path, n: int) -> dict[str, list[float]]:
    """create+run+destroy, run only, run through the forwarder — on docker."""
    from harnessrl.actors.sandbox.docker import DockerBackend

    async with (
        docker_engine(tmp) as url,
        DockerBackend(tmp / "docker-sandboxes", docker_url=url) as be,
        DockerBackend(tmp / "docker-pooled", docker_url=url, pool_size=POOL_SIZE) as pooled,
    ):

        async def lifecycle() -> None:
            sb = await be.create(SandboxSpec(owner="bench"))
            r = await sb.run(["true"], timeout=30)
            await sb.destroy()
            assert r.ok, r

        async def noop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        sock = tmp / "docker-proxy.sock"
        server = await asyncio.start_unix_server(noop, path=str(sock))
        try:
            async with (
                await be.create(SandboxSpec(owner="bench")) as sb,
                await be.create(SandboxSpec(owner="bench", proxy_socket=sock)) as sbf,
            ):

                async def run_only() -> None:
                    assert (await sb.run(["true"], timeout=30)).ok

                async def run_forwarder() -> None:
                    assert (await sbf.run(["true"], timeout=30)).ok

                cases = {"lifecycle": lifecycle, "run_only": run_only}
                cases["run_with_forwarder"] = run_forwarder
                got = await timed(cases, n, blocks=2, warmup=2)
                return got | await docker_pooled(pooled, sock, n)
        finally:
            server.close()


async def docker_pooled(be, sock: Path, n: int) -> dict[str, list[float]]:
    """The pooled lifecycle, each one with the pool full and the last removal done (a pool
    that keeps up: a rollout takes longer than a refill), and the refill itself: seconds per
    container started ahead, from an empty pool."""
    spec = SandboxSpec(owner="bench", proxy_socket=sock)
    await be.warm(spec)
    out: dict[str, list[float]] = {"pooled_lifecycle_with_forwarder": [], "pooled_ready": []}
    for i in range(2 + n):
        await be.pool.wait_full()
        await be.pool.drain()
        t0 = time.perf_counter()
        s = await be.create(spec)
        t1 = time.perf_counter()
        r = await s.run(["true"], timeout=30)
        await s.destroy()
        t2 = time.perf_counter()
        assert r.ok, r
        if i >= 2:
            out["pooled_lifecycle_with_forwarder"].append(t2 - t0)
            out["pooled_ready"].append(t1 - t0)
    await be.pool.wait_full()
    be.pool.clear()
    await be.pool.drain()
    t0 = time.perf_counter()
    be.pool.refill()
    await be.pool.wait_full()
    out["pool_refill_per_container"] = [(time.perf_counter() - t0) / be.pool.size]
    return out


def cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (bwrap and all inside it)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


async def cpu_per_call(fn: Callable[[], Awaitable[object]], n: int, settle=None) -> float:
    """CPU ms per ``fn()`` over ``n`` calls, ``settle()`` (background work) included."""
    t0 = cpu_s()
    for _ in range(n):
        await fn()
    if settle is not None:
        await settle()
    return round((cpu_s() - t0) / n * 1e3, 3)


async def main_async(quick: bool) -> dict:
    n = 8 if quick else 30
    rounds = ROUNDS

    async def plain() -> None:
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()

    results: dict[str, list[float]] = {}
    round_ratios: list[float] = []
    round_ready: list[float] = []
    cpu: dict[str, float] = {}
    ready: list[float] = []
    with tempfile.TemporaryDirectory(prefix="hrl-bench-") as tmp:
        sock = Path(tmp) / "proxy.sock"

        async def noop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_unix_server(noop, path=str(sock))
        async with (
            BwrapBackend(Path(tmp) / "sandboxes") as be,
            BwrapBackend(Path(tmp) / "pooled", pool_size=POOL_SIZE) as pooled,
            BwrapBackend(Path(tmp) / "pooled-py", pool_size=POOL_SIZE, forwarder="python") as py,
        ):
            forwarder_kind = pooled.forwarder_kind

            async def lifecycle() -> None:
                sb = await be.create(SandboxSpec(owner="bench"))
                r = await sb.run(["true"], timeout=30)
                await sb.destroy()
                assert r.ok, r

            async def lifecycle_with_forwarder() -> None:
                sb = await be.create(SandboxSpec(owner="bench", proxy_socket=sock))
                r = await sb.run(["true"], timeout=30)
                await sb.destroy()
                assert r.ok, r

            async def pooled_lifecycle_with_forwarder() -> None:
                t0 = time.perf_counter()
                sb = await pooled.create(SandboxSpec(owner="bench", proxy_socket=sock))
                ready.append(time.perf_counter() - t0)
                r = await sb.run(["true"], timeout=30)
                await sb.destroy()
                assert r.ok, r

            async def pooled_lifecycle_python_forwarder() -> None:
                sb = await py.create(SandboxSpec(owner="bench", proxy_socket=sock))
                r = await sb.run(["true"], timeout=30)
                await sb.destroy()
                assert r.ok, r

            floor_argv = [be._bwrap, *be._ns_args(), *be._system_binds(), "--", "/usr/bin/true"]

            async def bwrap_floor() -> None:
                proc = await asyncio.create_subprocess_exec(*floor_argv)
                await proc.wait()

            async def settle() -> None:
                await pooled.pool.drain()
                await pooled.pool.wait_full()

            async with (
                await be.create(SandboxSpec(owner="bench")) as sb,
                await be.create(SandboxSpec(owner="bench", proxy_socket=sock)) as sbf,
                await py.create(SandboxSpec(owner="bench", proxy_socket=sock)) as sbp,
            ):

                async def run_only() -> None:
                    assert (await sb.run(["true"], timeout=30)).ok

                async def run_forwarder() -> None:
                    assert (await sbf.run(["true"], timeout=30)).ok

                async def run_no_proxy() -> None:
                    assert (await sbf.run(["true"], timeout=30, proxy=False)).ok

                async def run_python_forwarder() -> None:
                    assert (await sbp.run(["true"], timeout=30)).ok

                # the target's two cases, in every round
                cases = {
                    "bwrap_floor": bwrap_floor,
                    "pooled_lifecycle_with_forwarder": pooled_lifecycle_with_forwarder,
                }
                for _ in range(rounds):
                    ready.clear()
                    got = await timed(cases, n, warmup=1)
                    floor = statistics.median(got["bwrap_floor"])
                    lc = statistics.median(got["pooled_lifecycle_with_forwarder"])
                    round_ratios.append(lc / floor)
                    round_ready.append(statistics.median(ready) / floor)
                    results.setdefault("pooled_ready", []).extend(ready)
                    for k, v in got.items():
                        results.setdefault(k, []).extend(v)
                # where the time goes (one pass, the floor again for its ratios)
                info = {
                    "bwrap_floor": bwrap_floor,
                    "baseline_subprocess": plain,
                    "run_only": run_only,
                    "run_no_proxy": run_no_proxy,
                    "run_with_forwarder": run_forwarder,
                    "run_with_python_forwarder": run_python_forwarder,
                    "lifecycle": lifecycle,
                    "lifecycle_with_forwarder": lifecycle_with_forwarder,
                    "pooled_lifecycle_python_forwarder": pooled_lifecycle_python_forwarder,
                }
                got = await timed(info, max(4, n // 3), blocks=2, warmup=1)
                info_floor = statistics.median(got.pop("bwrap_floor"))
                info_ratios = {
                    k: round(statistics.median(v) / info_floor, 2) for k, v in got.items()
                }
                for k, v in got.items():
                    results.setdefault(k, []).extend(v)
                m = max(6, n // 6)
                cpu["bwrap_floor"] = await cpu_per_call(bwrap_floor, m)
                cpu["run_only"] = await cpu_per_call(run_only, m)
                cpu["run_with_forwarder"] = await cpu_per_call(run_forwarder, m)
                cpu["lifecycle_with_forwarder"] = await cpu_per_call(lifecycle_with_forwarder, m)
                await settle()
                cpu["pooled_lifecycle_with_forwarder"] = await cpu_per_call(
                    pooled_lifecycle_with_forwarder, m, settle
                )
        server.close()
        skipped = None
        try:
            docker = await docker_cases(Path(tmp), 6 if quick else 20)
            results |= {f"docker_{k}": v for k, v in docker.items()}
        except DockerSkipped as e:
            skipped = str(e)
    return {
        "metrics": {k: summary(v) for k, v in results.items()},
        "round_ratios": round_ratios,
        "info_ratios": info_ratios,
        "forwarder": forwarder_kind,
        "round_ready": round_ready,
        "cpu_ms": cpu,
        "docker_skipped": skipped,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    out = asyncio.run(main_async(args.quick))
    res = out["metrics"]
    base = res.pop("baseline_subprocess")
    floor = res["bwrap_floor"]["p50_ms"]
    ratios = {k: round(v["p50_ms"] / floor, 2) for k, v in res.items()}
    ratios["baseline_subprocess"] = round(base["p50_ms"] / floor, 3)
    rows = [("baseline: create_subprocess_exec(true)", *map(str, base.values()), "-")]
    rows += [
        (k.replace("docker_", "docker ") if k.startswith("docker_") else f"bwrap {k}",)
        + (*map(str, v.values()), str(ratios[k]))
        for k, v in res.items()
    ]
    print_table(
        "sandbox lifecycle (p50 over n; ratios: p50 / bwrap floor p50, same run)",
        rows,
        ("case", "p50 ms", "p90 ms", "mean ms", "n", "x floor"),
    )
    cpu = out["cpu_ms"]
    print("\nCPU ms per call (this process + children; pool refill and removal included):")
    for k, v in cpu.items():
        print(f"  {k}: {v} ms ({v / cpu['bwrap_floor']:.2f}x floor)")
    lc = statistics.median(out["round_ratios"])
    targets = {"lifecycle_vs_bwrap_floor": target(lc, TARGET_RATIO, at_least=False)}
    targets["lifecycle_vs_bwrap_floor"]["rounds"] = [round(x, 3) for x in out["round_ratios"]]
    metrics = {
        **res,
        "forwarder": out["forwarder"],
        "info_pass_vs_its_floor": out["info_ratios"],
        "ready_vs_bwrap_floor_rounds": [round(x, 3) for x in out["round_ready"]],
        "cpu_ms_per_sandbox": cpu,
        "cpu_vs_bwrap_floor": {k: round(v / cpu["bwrap_floor"], 2) for k, v in cpu.items()},
    }
    if out["docker_skipped"]:
        metrics["docker_skipped"] = out["docker_skipped"]
        print(f"\ndocker skipped: {out['docker_skipped']}")
    else:
        p50 = res["docker_pooled_lifecycle_with_forwarder"]["p50_ms"]
        targets["docker_pooled_lifecycle_p50_ms"] = target(p50, DOCKER_TARGET_MS, at_least=False)
        print(f"\ntarget pooled docker lifecycle <= {DOCKER_TARGET_MS} ms p50: {p50} ms")
    path = write_result(
        "sandbox_lifecycle",
        metrics,
        {"bwrap_floor": floor, "subprocess_true": base},
        targets,
        ratios=ratios,
        quick=args.quick,
        out=args.out,
    )
    print(
        f"\ntarget pooled lifecycle with forwarder <= {TARGET_RATIO}x bwrap floor "
        f"(median of {len(out['round_ratios'])} rounds): {targets['lifecycle_vs_bwrap_floor']}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
