"""Does the demo learn? Held-out toy success before and after RL, with GRPO and with PPO.

``python -m benchmarks.demo_learning [--quick] [--algo grpo|ppo ...] [--steps N]
[--sft-steps N] [--keep DIR]``

Run by hand (not in CI): for each algorithm it runs ``harnessrl demo`` with the defaults (or the
given steps) — cold-start SFT on scripted-teacher trajectories, RL from the SFT weights, then
``toy-eval`` for the SFT policy (the baseline, measured in the same run) and the RL policy —
and reports the absolute change in held-out success and mean reward, the wall time against the
15-minute budget, and the RL reward curve (batch reward by version, from the run's
metrics.jsonl). Target: success rises by >= 0.25 over the cold-start policy. Failures are
reported as they are.

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

from benchmarks._common import RESULTS_DIR, print_table, target, write_result
from common.layout import StepLine, read_metrics

NAME = "demo_learning"
BUDGET_S = 15 * 60
TARGET_GAIN = 0.25


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test, under a minute")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for NAME.json")
    p.add_argument("--algo", action="append", choices=["grpo", "ppo"], help="repeat; default both")
    p.add_argument("--steps", type=int, default=0, help="RL steps (default: the demo's)")
    p.add_argument("--sft-steps", type=int, default=0, help="SFT steps (default: the demo's)")
    p.add_argument("--keep", type=Path, help="keep the demo folders here")
    p.add_argument("--extra", action="append", default=[], help="extra demo flag; repeat")
    return p.parse_args(argv)


def rl_curve(run_dir: Path) -> list[tuple[int, float]]:
    return [
        (ln.version, round(ln.reward_mean, 4))
        for ln in read_metrics(run_dir / "metrics.jsonl")
        if isinstance(ln, StepLine)
    ]


def run_demo(algo: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-m", "common.cli", "demo", "--algo", algo, "--out", str(folder)]
    argv += ["--no-dashboard"]
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
    result: dict[str, Any] = {"algo": algo, "exit": proc.returncode, "wall_s": round(wall, 1)}
    demo = folder / "demo.json"
    if proc.returncode != 0 or not demo.exists():
        result["error"] = (proc.stdout + proc.stderr)[-2000:]
        return result
    doc = json.loads(demo.read_text())
    ba = next(iter(doc["before_after"].values()), None)
    result.update(
        {
            "timings_s": doc["timings_s"],
            "before": ba["before"] if ba else None,
            "after": ba["after"] if ba else None,
            "gain_success": (ba["after"]["success"] - ba["before"]["success"]) if ba else None,
            "gain_reward": (ba["after"]["reward"] - ba["before"]["reward"]) if ba else None,
            "rl_curve": rl_curve(folder / "rl"),
            "sft_curve": rl_curve(folder / "sft"),
        }
    )
    return result


def quick(out: Path) -> int:
    """One SFT step through the whole pipeline, then eval teacher vs the result."""
    from common.config import toml_text
    from common.run.demo import DemoConfig, final_weights, sft_run_file

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hrl-demo-quick-") as tmp:
        root = Path(tmp)
        cfg = DemoConfig(model="tiny-1m", steps=1, sft_steps=1, sft_batch=4, actors=1)
        tables = sft_run_file(cfg, "demoquick")
        tables["run"].update(dashboard=False, plot_interval_s=0.0)
        (root / "sft.toml").write_text(toml_text(tables))
        cmd = [sys.executable, "-m", "common.cli", "run", str(root / "sft.toml")]
        sft = subprocess.run(
            [*cmd, "--out", str(root / "sft")], capture_output=True, text=True, timeout=300
        )
        t_sft = time.monotonic() - t0
        if sft.returncode != 0:
            print(sft.stdout[-3000:] + sft.stderr[-3000:])
            return 1
        policy = final_weights(root / "sft", 1)
        ev = subprocess.run(
            [sys.executable, "-m", "common.cli", "eval", "--policy", "teacher"]
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
    results = []
    with tempfile.TemporaryDirectory(prefix="hrl-demo-learning-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for algo in algos:
            folder = root / f"demo-{algo}"
            print(f"running the demo with {algo} in {folder} ...", flush=True)
            results.append(run_demo(algo, folder, args))
    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["algo"], "FAILED", "", "", "", f"{r['wall_s']:.0f}s"))
            continue
        b, a = r["before"], r["after"]
        rows.append(
            (
                r["algo"],
                f"{b['success']:.3f} -> {a['success']:.3f}",
                f"{r['gain_success']:+.3f}",
                f"{b['reward']:.3f} -> {a['reward']:.3f}",
                f"{r['gain_reward']:+.3f}",
                f"{r['wall_s'] / 60:.1f} min",
            )
        )
    print_table(
        "held-out toy-eval: cold-start SFT policy -> after RL",
        rows,
        ("algo", "success", "gain", "mean reward", "gain", "wall"),
    )
    for r in results:
        if "rl_curve" in r:
            curve = " ".join(f"v{v}:{x:.2f}" for v, x in r["rl_curve"])
            print(f"{r['algo']} RL batch reward by version: {curve}")
    ok = [r for r in results if "error" not in r]
    targets = {f"{r['algo']}_gain_success": target(r["gain_success"], TARGET_GAIN) for r in ok} | {
        f"{r['algo']}_within_budget": target(r["wall_s"], BUDGET_S, at_least=False) for r in ok
    }
    baseline = {r["algo"]: r.get("before") for r in ok}
    path = write_result(
        NAME,
        metrics={r["algo"]: r for r in results},
        baseline={"cold_start_sft": baseline},
        targets=targets,
        ratios={f"{r['algo']}_gain_success": r["gain_success"] for r in ok},
        out=args.out,
    )
    print(f"results: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
