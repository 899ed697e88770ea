"""Sandbox lifecycle cost: create + run ``true`` + destroy, against a plain subprocess.

    python -m benchmarks.sandbox_lifecycle [--quick]

Baseline (same run): ``asyncio.create_subprocess_exec("true")`` + wait. Also reported: one
``run`` in an existing sandbox (fast path, no forwarder), one ``run`` through the proxy
forwarder (python launcher in between), and the floor: a bare ``bwrap`` with the same
namespaces and only ``/usr`` bound, which no bwrap design can beat (namespace creation, the
network namespace above all). Target: lifecycle p50 <= 5x the baseline p50.

Docker (reported, no target): the same three cases on the engine at ``$DOCKER_HOST`` when one
answers, else on a private dockerd started for the run (root + ``docker.io`` installed); the
image is imported from the cached rootfs (`actors.sandbox.docker_image`). When neither works the
docker cases are skipped and the reason is printed and recorded (``docker_skipped``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from actors.sandbox import SandboxSpec
from actors.sandbox.bwrap import BwrapBackend
from benchmarks._common import parse_args, print_table, target, write_result

TARGET_RATIO = 5.0


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
    from actors.sandbox.docker_image import PrivateDockerd, ensure_image

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
    from actors.sandbox.docker import DockerBackend

    async with (
        docker_engine(tmp) as url,
        DockerBackend(tmp / "docker-sandboxes", docker_url=url) as be,
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
                return await timed(cases, n, blocks=2, warmup=2)
        finally:
            server.close()


async def main_async(quick: bool) -> tuple[dict[str, dict[str, float]], str | None]:
    n = 40 if quick else 250

    async def plain() -> None:
        proc = await asyncio.create_subprocess_exec("true")
        await proc.wait()

    with tempfile.TemporaryDirectory(prefix="hrl-bench-") as tmp:
        async with BwrapBackend(Path(tmp) / "sandboxes") as be:

            async def lifecycle() -> None:
                sb = await be.create(SandboxSpec(owner="bench"))
                r = await sb.run(["true"], timeout=30)
                await sb.destroy()
                assert r.ok, r

            floor_argv = [be._bwrap, *be._ns_args(), *be._system_binds(), "--", "/usr/bin/true"]

            async def bwrap_floor() -> None:
                proc = await asyncio.create_subprocess_exec(*floor_argv)
                await proc.wait()

            async def noop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                writer.close()

            sock = Path(tmp) / "proxy.sock"
            server = await asyncio.start_unix_server(noop, path=str(sock))
            async with (
                await be.create(SandboxSpec(owner="bench")) as sb,
                await be.create(SandboxSpec(owner="bench", proxy_socket=sock)) as sbf,
            ):

                async def run_only() -> None:
                    assert (await sb.run(["true"], timeout=30)).ok

                async def run_forwarder() -> None:
                    assert (await sbf.run(["true"], timeout=30)).ok

                cases = {
                    "baseline_subprocess": plain,
                    "bwrap_floor": bwrap_floor,
                    "lifecycle": lifecycle,
                    "run_only": run_only,
                    "run_with_forwarder": run_forwarder,
                }
                results = await timed(cases, n)
            server.close()
        skipped = None
        try:
            docker = await docker_cases(Path(tmp), 10 if quick else 60)
            results |= {f"docker_{k}": v for k, v in docker.items()}
        except DockerSkipped as e:
            skipped = str(e)
    return {k: summary(v) for k, v in results.items()}, skipped


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    res, docker_skipped = asyncio.run(main_async(args.quick))
    base = res.pop("baseline_subprocess")
    ratios = {k: round(v["p50_ms"] / base["p50_ms"], 2) for k, v in res.items()}
    rows = [("baseline: create_subprocess_exec(true)", *map(str, base.values()), "1.0")]
    rows += [
        (k.replace("docker_", "docker ") if k.startswith("docker_") else f"bwrap {k}",)
        + (*map(str, v.values()), str(ratios[k]))
        for k, v in res.items()
    ]
    print_table(
        "sandbox lifecycle (p50 over n)",
        rows,
        ("case", "p50 ms", "p90 ms", "mean ms", "n", "x baseline"),
    )
    targets = {"lifecycle_vs_subprocess": target(ratios["lifecycle"], TARGET_RATIO, at_least=False)}
    if docker_skipped:
        print(f"\ndocker skipped: {docker_skipped}")
    path = write_result(
        "sandbox_lifecycle",
        {**res, "docker_skipped": docker_skipped} if docker_skipped else res,
        {"subprocess_true": base},
        targets,
        ratios=ratios,
        quick=args.quick,
        out=args.out,
    )
    print(f"\ntarget lifecycle <= {TARGET_RATIO}x: {targets['lifecycle_vs_subprocess']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
