"""Teacher data through real harnesses: rollouts/s, CPU per rollout, success, tokens.

``python -m benchmarks.teacher_harnesses [--quick] [--harness NAME ...] [--per-family N]
[--concurrency N] [--plan N]``

For each harness (default: mini-swe-agent and claude-code; those not installed are skipped
and said so) it records ``per-family`` toy tasks of every family with ``harnessrl teacher-data
--harness NAME`` — each a live rollout of the unmodified harness in a sandbox, behind its
proxy, with the scripted teacher as the model — and reports rollouts/s (depends on how busy
the machine is: the load average is reported with it), CPU seconds per rollout (the harness's,
measured inside its sandbox, plus this side's; independent of the load), the teacher's success
through the harness (target: every task), TITO misses and false forks (target: none), tokens
and calls per conversation. Baseline, in the same run: the same teacher through the
reference harness's loop in-process (what the shipped warm start was trained on).

``--plan N`` sizes a warm start of N live conversations per harness: CPU hours, hours on this
machine's cores when they are free, and hours at the rate measured now.

A harness with a preloaded start (mini-swe-agent: an interpreter that has imported its
libraries once, forked into each sandbox) is recorded a second time with cold starts, in the
same run: the ratio of the harness's CPU per rollout, cold over preloaded, is the preloaded
start's target (at least 2x).

``--quick`` (under a minute where Claude Code is installed): one task of two families through
the cheapest installed harness (cold starts are not measured).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, print_table, target, write_result

NAME = "teacher_harnesses"
CHEAPEST_FIRST = ("claude-code", "codex", "mini-swe-agent", "opencode", "openclaw")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two tasks, one harness")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for NAME.json")
    p.add_argument("--harness", action="append", help="repeat; default mini-swe-agent claude-code")
    p.add_argument("--per-family", type=int, default=5, help="tasks per toy family (20 families)")
    p.add_argument("--concurrency", type=int, default=4, help="rollouts at once")
    p.add_argument("--plan", type=int, default=3000, help="conversations to size a warm start")
    return p.parse_args(argv)


def cpu_now() -> float:
    """CPU seconds of this process and its reaped children (the reference agent's shell
    commands run as plain children here, outside any sandbox)."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def baseline(per_family: int, families: list[str]) -> dict[str, Any]:
    """The teacher through the reference harness's loop, in this process."""
    from harnessrl.actors import teacher_data

    cfg = teacher_data.TeacherDataConfig(per_family=per_family, families=families)
    tasks = teacher_data.tasks_for(cfg)
    t0, c0 = time.monotonic(), cpu_now()
    for t in tasks:
        teacher_data.trajectory(t)
    wall, cpu = time.monotonic() - t0, cpu_now() - c0
    return {
        "harness": "reference (in-process loop)",
        "rollouts": len(tasks),
        "rollouts_per_s": round(len(tasks) / wall, 2),
        "cpu_s_per_rollout": round(cpu / len(tasks), 4),
    }


def record(
    harness: str, args: argparse.Namespace, families: list[str], tmp: Path, preload: bool = True
) -> dict:
    from harnessrl.actors import teacher_data

    out = tmp / f"{harness}{'' if preload else '-cold'}.jsonl"
    cfg = teacher_data.TeacherDataConfig(
        harness_preload=preload,
        out=out,
        harness=harness,
        per_family=args.per_family,
        families=families,
        concurrency=args.concurrency,
        sandbox_root=tmp / "sandboxes",
        progress_s=120,
    )
    rc = teacher_data.main(cfg)
    stats = json.loads(Path(f"{out}.stats.json").read_text())
    stats["exit"] = rc
    return stats


def plan(stats: dict[str, Any], n: int) -> dict[str, float]:
    cpu = stats["cpu_s_per_rollout"]
    rate = stats["rollouts_per_s"] or 0.0
    return {
        "conversations": n,
        "cpu_hours": round(n * cpu / 3600, 2),
        "hours_on_free_cores": round(n * cpu / (os.cpu_count() or 1) / 3600, 2),
        "hours_at_measured_rate": round(n / rate / 3600, 2) if rate else float("nan"),
    }


def table_row(label: str, s: dict[str, Any]) -> tuple[str, ...]:
    """One harness's recording as a row of the printed table."""
    return (
        label,
        str(s["rollouts"]),
        f"{s['rollouts_per_s']}",
        f"{s['cpu_s_per_rollout']} ({s['cpu_s_per_rollout_harness']} harness)",
        f"{s['success_rate']}",
        f"{s['tokens_per_conversation']}",
        f"{s['calls_per_conversation']}",
        f"{s['tito_misses']}/{s['false_forks']}",
    )


def main(argv: list[str] | None = None) -> int:
    from harnessrl.actors.harnesses import default_cache_dir, get_adapter

    args = parse(argv)
    wanted = args.harness or ["mini-swe-agent", "claude-code"]
    installed = [h for h in wanted if get_adapter(h).is_installed(default_cache_dir())]
    for h in sorted(set(wanted) - set(installed)):
        print(f"{h}: not installed (harnessrl harness install {h}); skipped")
    families: list[str] = []
    if args.quick:
        installed = [h for h in CHEAPEST_FIRST if h in installed][:1]
        args.per_family, families = 1, ["copy", "count_word"]
    if not installed:
        print("no harness to measure")
        return 1
    base = baseline(args.per_family, families)
    results: dict[str, Any] = {}
    cold: dict[str, Any] = {}  # harnesses with a preloaded start, measured cold too
    with tempfile.TemporaryDirectory(prefix="hrl-bench-teacher-") as tmp:
        for h in installed:
            results[h] = record(h, args, families, Path(tmp))
            results[h]["plan"] = plan(results[h], args.plan)
            if getattr(get_adapter(h), "preload_modules", ()) and not args.quick:
                cold[h] = record(h, args, families, Path(tmp), preload=False)
    rows = [
        (
            "reference, in-process (baseline)",
            str(base["rollouts"]),
            f"{base['rollouts_per_s']:.1f}",
            f"{base['cpu_s_per_rollout']:.4f}",
            "-",
            "-",
            "-",
            "-",
        )
    ]
    targets: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for h, s in results.items():
        rows.append(table_row(f"{h} {s['harness_version']}", s))
        targets[f"{h}_success"] = target(s["success_rate"] or 0.0, 0.99)
        targets[f"{h}_tito_misses"] = target(s["tito_misses"], 0, at_least=False)
        targets[f"{h}_false_forks"] = target(s["false_forks"], 0, at_least=False)
        ratios[f"{h}_cpu_per_rollout_vs_baseline"] = round(
            s["cpu_s_per_rollout"] / max(base["cpu_s_per_rollout"], 1e-9), 1
        )
        if h in cold:
            c = cold[h]
            rows.append(table_row(f"{h} {c['harness_version']}, cold start", c))
            speedup = c["cpu_s_per_rollout_harness"] / max(s["cpu_s_per_rollout_harness"], 1e-9)
            ratios[f"{h}_harness_cpu_cold_vs_preloaded"] = round(speedup, 2)
            targets[f"{h}_preloaded_harness_cpu_speedup"] = target(round(speedup, 2), 2.0)
    header = ("harness", "rollouts", "rollouts/s", "CPU s/rollout", "success", "tokens/conv")
    header += ("calls/conv", "TITO miss/false fork")
    load = next(iter(results.values()))["loadavg_at_end"]
    print_table(f"teacher data through real harnesses (load average {load})", rows, header)
    for h, s in results.items():
        p = s["plan"]
        print(
            f"{h}: {p['conversations']} conversations = {p['cpu_hours']} CPU h, "
            f"{p['hours_on_free_cores']} h on {os.cpu_count()} free cores, "
            f"{p['hours_at_measured_rate']} h at the rate measured now"
        )
    for h, c in cold.items():
        results[f"{h} (cold start)"] = c
    path = write_result(NAME, results, base, targets, ratios=ratios, quick=args.quick, out=args.out)
    print(f"\nresults: {path}")
    return 0 if all(t["met"] for t in targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
