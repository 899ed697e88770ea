"""What the sandbox disk quota's watchdog costs per rollout (``actors/sandbox/quota.py``).

    python -m benchmarks.disk_quota [--quick]

Each "rollout" is one bwrap sandbox (the embedded backend) whose workspace starts as a copy of
a task folder, one harness-like command that runs for ``HARNESS_S`` seconds writing a few
files, and its destroy. The same rollouts run with the quota (``Limits.disk_bytes``, the
default 1 GiB: the watchdog walks the sandbox's writable folders every 0.5 s while a command
runs, and once more when it ends) and, as the baseline in the same run, without it. Reported per rollout: the actor
process's CPU seconds (this process: the watchdog runs here, in worker threads), the
watchdog's walks and its own CPU, and the wall time. Two workspaces: a task-sized one (40
files) and a large one (20,000 files: a ``node_modules``-sized tree, where each walk costs
most; 2,000 with ``--quick``). The ratio of the actor's CPU with the quota to without is reported; the bwrap
baseline is small (the sandbox's work is in its own processes), so the targets (reported,
not asserted) are on the watchdog's CPU as a share of one core while the harness runs: at
most 1 % with the task-sized workspace, at most 5 % with the large one.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import parse_args, print_table, target, write_result

HARNESS_S = 2.0
"""How long the command of one rollout runs."""
QUOTA = 1024 * 2**20
"""The default ``sandbox_disk_mb`` (1 GiB)."""
SMALL, LARGE, LARGE_QUICK = 40, 20_000, 2_000
"""Workspace sizes in files (``--quick``: a tenth of the large one; copying it in and removing
it is most of the run's time)."""
HARNESS = f"for i in 1 2 3 4; do echo step $i > out$i.txt; sleep {HARNESS_S / 4}; done"


def make_task(root: Path, files: int) -> Path:
    """A task folder of ``files`` small files in nested folders."""
    task = root / f"task-{files}"
    for i in range(files):
        d = task / f"d{i % 50}" / f"e{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.txt").write_text(f"line {i}\n" * 4)
    return task


async def rollouts(backend, task: Path, n: int, quota: int | None) -> dict[str, float]:
    """Run ``n`` rollouts one after another; per-rollout means."""
    from harnessrl.actors.sandbox import SandboxSpec
    from harnessrl.actors.sandbox.base import Limits

    cpu, wall, walks, watch_cpu = [], [], [], []
    for _ in range(n):
        spec = SandboxSpec(owner="bench", workspace_src=task, limits=Limits(disk_bytes=quota))
        c0, t0 = time.process_time(), time.monotonic()
        async with await backend.create(spec) as sb:
            r = await sb.run(["sh", "-c", HARNESS], timeout=60)
            assert r.ok and not r.disk_exceeded, r
            w = sb.disk_watch
        cpu.append(time.process_time() - c0)
        wall.append(time.monotonic() - t0)
        walks.append(w.walks if w is not None else 0)
        watch_cpu.append(w.cpu_s if w is not None else 0.0)
    return {
        "cpu_s": round(statistics.mean(cpu), 4),
        "wall_s": round(statistics.mean(wall), 3),
        "walks": round(statistics.mean(walks), 1),
        "watchdog_cpu_s": round(statistics.mean(watch_cpu), 4),
    }


async def main(quick: bool) -> dict[str, dict[str, dict[str, float]]]:
    from harnessrl.actors.sandbox.bwrap import BwrapBackend

    n = 2 if quick else 8
    out: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        async with BwrapBackend(root / "sandboxes", pool_size=0) as backend:
            for files in (SMALL, LARGE_QUICK if quick else LARGE):
                task = make_task(root, files)
                await rollouts(backend, task, 1, QUOTA)  # warm the page cache and the forwarder
                base = await rollouts(backend, task, n, None)
                quota = await rollouts(backend, task, n, QUOTA)
                out[f"{files}_files"] = {"quota": quota, "no_quota": base}
    return out


def run(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv)
    res = asyncio.run(main(args.quick))
    rows = []
    for case, r in res.items():
        for kind in ("no_quota", "quota"):
            m = r[kind]
            rows.append(
                (
                    case,
                    kind,
                    f"{m['cpu_s']:.4f}",
                    f"{m['wall_s']:.2f}",
                    f"{m['walks']:g}",
                    f"{m['watchdog_cpu_s']:.4f}",
                )  # fmt: skip
            )
    print_table(
        "per rollout (one sandbox, one 2 s command)",
        rows,
        ("workspace", "case", "cpu s", "wall s", "walks", "watchdog cpu s"),
    )
    ratios = {
        f"{case}_cpu_quota_over_none": round(r["quota"]["cpu_s"] / r["no_quota"]["cpu_s"], 3)
        for case, r in res.items()
    }
    print("\n" + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    bounds = {f"{SMALL}_files": 0.01, f"{LARGE}_files": 0.05, f"{LARGE_QUICK}_files": 0.05}
    targets = {
        f"{case}_watchdog_cpu_share": target(
            r["quota"]["watchdog_cpu_s"] / HARNESS_S, bounds[case], at_least=False
        )
        for case, r in res.items()
    }
    path = write_result(
        "disk_quota",
        {case: r["quota"] for case, r in res.items()},
        {case: r["no_quota"] for case, r in res.items()},
        targets,
        ratios=ratios,
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(run())
