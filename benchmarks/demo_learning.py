"""Does the demo learn? Held-out toy success before and after RL, with GRPO and with PPO.

``python -m benchmarks.demo_learning [--quick] [--algo grpo|ppo ...] [--seed N ...]
[--harness NAME ...] [--steps N] [--keep DIR] [--extra 'DEMO FLAGS']``

Run by hand (not in CI): for each algorithm and seed (default: grpo and ppo, seeds 0 1 2) it
runs ``harnessrl demo`` with the defaults — RL from the shipped warm start ``tiny-agent``, then
``toy-eval`` for the warm start (the baseline, measured in the same run, same tasks and seeds)
and the RL policy — and reports the change in held-out success (with 95 % Wilson intervals),
the paired outcomes (held-out rollouts with the same task and sampling seed that succeed after
RL only / before only: their difference is the change, their sum its noise) and mean reward, the RL phase's rollouts/s, the per-phase timings against the 15-minute
budget, and the RL reward curve (batch reward by version, from the run's metrics.jsonl). The
warm start's own recorded held-out success (``harnessrl_recipe.json``) is reported beside it.
Target: success rises by >= 0.25 on at least 2 of 3 seeds per algorithm. Failures are reported
as they are.

``--harness NAME`` (repeat) runs the same demos through a real harness each (``harnessrl demo
--harness NAME``: RL and both evaluations through it, from the shipped policy that speaks it)
and writes ``demo_learning_<name>.json`` beside the reference harness's ``demo_learning.json``.
Target through a real harness: >= +0.15 on at least 2 of 3 seeds, the RL phase within 30
minutes (the held-out evaluation's time reported apart).

``--quick`` (< 1 minute, what CI runs) is a smoke test of the demo's pieces only: one SFT step
of ``tiny-1m`` on teacher trajectories through the whole pipeline, then the teacher and the
resulting policy on two held-out tasks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, print_table, target, wilson, write_result
from harnessrl.common.layout import StepLine, read_metrics
from harnessrl.common.run.demo import speaker

NAME = "demo_learning"
BUDGET_S = 15 * 60
TARGET_GAIN = 0.25
TARGET_GAIN_HARNESS = 0.15
"""Through a real harness (fewer, slower rollouts than the in-process reference harness)."""
RL_BUDGET_HARNESS_S = 30 * 60


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test, under a minute")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for NAME.json")
    p.add_argument("--algo", action="append", choices=["grpo", "ppo"], help="repeat; default both")
    p.add_argument("--seed", action="append", type=int, help="RL seed; repeat (default 0 1 2)")
    p.add_argument(
        "--harness",
        action="append",
        metavar="NAME",
        help="harness the demos run through; repeat (default: reference)",
    )
    p.add_argument("--steps", type=int, default=0, help="RL steps (default: the demo's)")
    p.add_argument(
        "--sft-steps", type=int, default=0, help="SFT steps (only with --extra --from-scratch)"
    )
    p.add_argument("--keep", type=Path, help="keep the demo folders here")
    p.add_argument("--extra", action="append", default=[], help="extra demo flag; repeat")
    p.add_argument(
        "--summarise",
        action="append",
        type=Path,
        metavar="DIR",
        help="report these finished demo folders instead of running demos; repeat",
    )
    p.add_argument(
        "--previous",
        type=Path,
        metavar="FILE",
        help="keep the runs of this earlier result file under earlier_runs (recorded only: "
        "the targets count this call's runs)",
    )
    p.add_argument("--only-harness", help=argparse.SUPPRESS)  # one harness of several
    return p.parse_args(argv)


def rl_curve(run_dir: Path) -> list[tuple[int, float]]:
    return [
        (ln.version, round(ln.reward_mean, 4))
        for ln in read_metrics(run_dir / "metrics.jsonl")
        if isinstance(ln, StepLine)
    ]


def run_demo(
    algo: str, seed: int, folder: Path, args: argparse.Namespace, harness: str = "reference"
) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "harnessrl.common.cli",
        "demo",
        "--algo",
        algo,
        "--out",
        str(folder),
    ]
    argv += ["--no-dashboard", "--seed", str(seed), "--harness", harness]
    if args.steps:
        argv += ["--steps", str(args.steps)]
    if args.sft_steps:
        argv += ["--sft-steps", str(args.sft_steps)]
    for extra in args.extra:
        argv += extra.split()
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (folder / "demo.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (folder / "demo.json").exists():
        return {
            "algo": algo,
            "seed": seed,
            "harness": harness,
            "exit": proc.returncode,
            "wall_s": round(wall, 1),
            "error": (proc.stdout + proc.stderr)[-2000:],
        }
    return summarise(folder, wall)


def fixed_broken(p: dict[str, int] | None) -> str:
    """``fixed/broken``: held-out rollouts (same task and seed) that succeed after RL only /
    before only (``demo.json``'s ``paired``; demos before it was recorded show ``-``)."""
    return f"{p['fixed']}/{p['broken']}" if p else "-"


def settings_label(r: dict[str, Any]) -> str:
    """The RL settings that differ between demo versions, short: groups per step, peak lr,
    the cosine floor (``const`` without decay), optimiser steps per batch (``K2``), PPO's
    group filter and value bounds, and the last version reached."""
    s = r.get("rl_settings") or {}
    ds = s.get("ds") or {}
    cosine = ds.get("lr_decay_versions") or ds.get("lr_decay_steps")  # (runs before the rename)
    decay = f"cos{ds.get('lr_min_ratio', 0.1):g}" if cosine else "const"
    last = r["rl_curve"][-1][0] if r.get("rl_curve") else "-"
    extra = f" K{s['updates_per_batch']}" if (s.get("updates_per_batch") or 1) > 1 else ""
    extra += " filter" if s.get("filter_groups") else ""
    bounds = (s.get("loss") or {}).get("value_bounds")
    extra += f" V in {bounds}" if bounds else ""
    group = f"{s.get('batch_groups')}x{s.get('group_size')}"
    return f"{group} lr {ds.get('lr', 0):g} {decay}{extra} v{last}"


def summarise(folder: Path, wall: float | None = None) -> dict[str, Any]:
    """The result of a finished demo folder (its demo.json, rl.toml and run metrics)."""
    import tomllib

    doc = json.loads((folder / "demo.json").read_text())
    rl = tomllib.loads((folder / "rl.toml").read_text())["learner"]
    result: dict[str, Any] = {
        "algo": doc["algo"],
        "seed": rl.get("feeder", {}).get("seed", 0),
        "folder": str(folder),
        "exit": 0,
        "wall_s": round(wall if wall is not None else doc["timings_s"]["total"], 1),
        "rl_settings": {
            k: rl.get(k)
            for k in (
                "group_size",
                "batch_groups",
                "max_staleness",
                "updates_per_batch",
                "filter_groups",
                "ds",
                "loss",
            )
        },
    }
    result["harness"] = next(iter(doc["before_after"]), "reference")
    ba = next(iter(doc["before_after"].values()), None)
    for side in ("before", "after"):
        if ba and ba.get(side):
            c = ba[side]
            c["ci95"] = wilson(c["success"] * c["n"], int(c["n"]))
    result.update(
        {
            "rl_rollouts_per_s": doc.get("rl_rollouts_per_s"),
            "timings_s": doc["timings_s"],
            "before": ba["before"] if ba else None,
            "after": ba["after"] if ba else None,
            "gain_success": (ba["after"]["success"] - ba["before"]["success"]) if ba else None,
            "gain_reward": (ba["after"]["reward"] - ba["before"]["reward"]) if ba else None,
            "paired": ba.get("paired") if ba else None,
            "rl_curve": rl_curve(folder / "rl"),
            "sft_curve": rl_curve(folder / "sft"),
        }
    )
    return result


def quick(out: Path) -> int:
    """One SFT step through the whole pipeline, then eval teacher vs the result."""
    from harnessrl.common.config import toml_text
    from harnessrl.common.run.demo import DemoConfig, final_weights, sft_run_file

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hrl-demo-quick-") as tmp:
        root = Path(tmp)
        cfg = DemoConfig(model="tiny-1m", steps=1, sft_steps=1, sft_batch=4, actors=1)
        tables = sft_run_file(cfg, "demoquick")
        tables["run"].update(dashboard=False, plot_interval_s=0.0)
        (root / "sft.toml").write_text(toml_text(tables))
        cmd = [sys.executable, "-m", "harnessrl.common.cli", "run", str(root / "sft.toml")]
        sft = subprocess.run(
            [*cmd, "--out", str(root / "sft")], capture_output=True, text=True, timeout=300
        )
        t_sft = time.monotonic() - t0
        if sft.returncode != 0:
            print(sft.stdout[-3000:] + sft.stderr[-3000:])
            return 1
        policy = final_weights(root / "sft", 1)
        ev = subprocess.run(
            [sys.executable, "-m", "harnessrl.common.cli", "eval", "--policy", "teacher"]
            + ["--policy", str(policy), "--suite", "toy-eval", "--limit", "2"]
            + ["--max-turns", "7", "--max-new-tokens", "200", "--out", str(root / "eval.json")]
            + ["--rollout.model", "tiny-1m"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if ev.returncode != 0:
            print(ev.stdout[-3000:] + ev.stderr[-3000:])
            return 1
        report = json.loads((root / "eval.json").read_text())
    wall = time.monotonic() - t0
    teacher = report["summary"]["teacher"]["reference"]
    trained = report["summary"][str(policy)]["reference"]
    print_table(
        "demo pieces (quick smoke: 1 SFT step of tiny-1m, 2 held-out tasks)",
        [("teacher", f"{teacher['reward']:.2f}"), ("after 1 SFT step", f"{trained['reward']:.2f}")],
        ("policy", "held-out reward"),
    )
    print(f"\nsft phase {t_sft:.0f}s, total {wall:.0f}s")
    path = write_result(
        NAME,
        metrics={"smoke_policy_reward": trained["reward"], "wall_s": round(wall, 1)},
        baseline={"teacher_reward": teacher["reward"]},
        targets={"teacher_solves": target(teacher["reward"], 1.0)},
        quick=True,
        out=out,
    )
    print(f"results: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.quick:
        return quick(args.out)
    algos = args.algo or ["grpo", "ppo"]
    seeds = args.seed or [0, 1, 2]
    harnesses = list(dict.fromkeys(args.harness or ["reference"]))
    harness = args.only_harness or harnesses[0]
    if len(harnesses) > 1 and not args.only_harness:
        code = 0
        for h in harnesses:  # one result file per harness
            code |= main([*(argv or sys.argv[1:]), "--only-harness", h])
        return code
    results = []
    with tempfile.TemporaryDirectory(prefix="hrl-demo-learning-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for folder in args.summarise or []:
            results.append(summarise(folder))
        for algo in algos if not args.summarise else []:
            for seed in seeds:
                tag = "" if harness == "reference" else f"-{harness}"
                folder = root / f"demo-{algo}{tag}-s{seed}"
                print(
                    f"running the demo with {algo}, seed {seed}, through {harness}, in {folder} ...",
                    flush=True,
                )
                results.append(run_demo(algo, seed, folder, args, harness))
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["algo"], r["seed"], "", "FAILED", "", "", "", "", f"{r['wall_s']:.0f}s"))
            continue
        b, a = r["before"], r["after"]
        rows.append(
            (
                r["algo"],
                r["seed"],
                settings_label(r),
                f"{b['success']:.3f} {b['ci95']} -> {a['success']:.3f} {a['ci95']}",
                f"{r['gain_success']:+.3f}",
                fixed_broken(r.get("paired")),
                f"{b['reward']:.3f} -> {a['reward']:.3f}",
                f"{r['rl_rollouts_per_s'] or 0:.2f}",
                f"{r['wall_s'] / 60:.1f} min",
            )
        )
    print_table(
        "held-out toy-eval: warm start -> after RL (95 % Wilson intervals)",
        rows,
        (
            "algo",
            "seed",
            "RL settings",
            "success",
            "gain",
            "fixed/broken",
            "mean reward",
            "RL rollouts/s",
            "wall",
        ),
    )
    for r in results:
        if "rl_curve" in r:
            curve = " ".join(f"v{v}:{x:.2f}" for v, x in r["rl_curve"])
            print(f"{r['algo']} seed {r['seed']} RL batch reward by version: {curve}")
    ok = [r for r in results if "error" not in r]
    targets = {}
    for algo in sorted({r["algo"] for r in ok}):
        mine = [r for r in ok if r["algo"] == algo]
        if harness == "reference":
            wins = sum(r["gain_success"] >= TARGET_GAIN for r in mine)
            targets[f"{algo}_seeds_with_gain"] = target(wins, min(2, len(seeds)))
            targets[f"{algo}_within_budget"] = target(
                max((r["wall_s"] for r in mine), default=0.0), BUDGET_S, at_least=False
            )
            continue
        wins = sum(r["gain_success"] >= TARGET_GAIN_HARNESS for r in mine)
        targets[f"{algo}_seeds_with_gain_0.15"] = target(wins, min(2, len(seeds)))
        rl_s = max((r["timings_s"].get("rl", 0.0) for r in mine), default=0.0)
        targets[f"{algo}_rl_within_30_min"] = target(rl_s, RL_BUDGET_HARNESS_S, at_least=False)
    earlier: dict[str, Any] = {}
    if args.previous:
        prev = json.loads(args.previous.read_text())["metrics"]
        earlier = dict(prev.get("earlier_runs", {}))
        for key, run in prev.get("runs", {}).items():
            earlier[key if key not in earlier else f"{key}-{len(earlier)}"] = run
    path = write_result(
        NAME if harness == "reference" else f"{NAME}_{harness.replace('-', '_')}",
        metrics={
            "harness": harness,
            "warm_start": warm_start_record(speaker([harness])),
            "runs": {f"{r['algo']}-s{r['seed']}-{i}": r for i, r in enumerate(results)},
            "earlier_runs": earlier,
        },
        baseline={
            "warm_start_same_run": {f"{r['algo']}-s{r['seed']}": r.get("before") for r in ok}
        },
        targets=targets,
        ratios={
            f"{r['algo']}-s{r['seed']}-{i}_gain_success": r["gain_success"]
            for i, r in enumerate(ok)
        },
        out=args.out,
    )
    print(f"results: {path}")
    return 0 if ok else 1


def warm_start_record(policy: str = "tiny-agent") -> dict[str, Any]:
    """What the shipped warm start's recipe recorded (held-out success, steps, minutes)."""
    from harnessrl.common.models import resolve_model

    try:
        doc = json.loads((resolve_model(policy) / "harnessrl_recipe.json").read_text())
    except (ValueError, OSError) as e:
        return {"error": str(e)}
    keys = ("held_out_success", "held_out", "steps", "train_minutes", "train_conversations")
    out = {k: doc.get(k) for k in keys}
    if doc.get("held_out_by_harness"):
        out["held_out_by_harness"] = doc["held_out_by_harness"]
    return {"policy": policy, **out}


if __name__ == "__main__":
    sys.exit(main())
