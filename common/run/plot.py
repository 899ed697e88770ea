"""Reward and throughput plot of a run, drawn from its ``metrics.jsonl`` alone.

Three panels: reward mean by weight version (the learner's batch reward, and from the rollout
results the mean per harness for training and held-out eval rollouts, by the version they were
issued at), the learner's loss by version (``loss/sft`` for SFT, ``loss/total`` otherwise, with
the policy entropy when reported), and throughput over wall time (rollouts/s, samples
trained/min, generated tokens/s).
Uses matplotlib's object API with the Agg backend (no display, no pyplot state, safe in a
worker thread) and replaces the PNG atomically, so a viewer never sees half a file.

    python -m harnessrl.common.run.plot RUN_DIR     # (re)draw RUN_DIR/plot.png
"""

from __future__ import annotations

import io
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from harnessrl.common.files import atomic_write
from harnessrl.common.layout import MetricsLine, RollupLine, effective_steps, read_metrics

PLOT_NAME = "plot.png"


def series(lines: list[MetricsLine]) -> dict[str, Any]:
    """What the plot shows, from metrics.jsonl lines (learner step lines + rollup lines)."""
    steps = effective_steps(lines)  # without the steps a learner restart rolled back
    acc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    rollups = [ln for ln in lines if isinstance(ln, RollupLine)]
    for ln in rollups:
        for key, per in ln.rewards.items():
            for v, (s, n) in per.items():
                acc[key][int(v)][0] += s
                acc[key][int(v)][1] += n
    rewards = {
        k: sorted((v, s / n) for v, (s, n) in per.items() if n) for k, per in sorted(acc.items())
    }
    t0 = lines[0].time if lines else 0.0
    loss = []
    for s in steps:
        m = s.metrics
        value = m.get("loss/sft", m.get("loss/total"))
        if value is not None:
            loss.append((s.version, float(value), m.get("entropy")))
    return {
        "batch": [(s.version, s.reward_mean) for s in steps],
        "loss": loss,
        "rewards": rewards,
        "throughput": [
            ((r.time - t0) / 60, r.rollouts_per_s, r.samples_per_min, r.gen_tokens_per_s)
            for r in rollups
        ],
    }


def plot_run(run_dir: str | Path, title: str = "") -> Path | None:
    """Draw ``<run_dir>/plot.png``; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    run_dir = Path(run_dir)
    data = series(read_metrics(run_dir / "metrics.jsonl"))
    fig = Figure(figsize=(15, 4.2), dpi=100)
    ax_r, ax_l, ax_t = fig.subplots(1, 3)
    if data["batch"]:
        xs, ys = zip(*data["batch"], strict=True)
        ax_r.plot(xs, ys, color="0.6", lw=1, label="train batch (learner)")
    for key, pts in data["rewards"].items():
        if pts:
            xs, ys = zip(*pts, strict=True)
            style = "-o" if key.startswith("eval/") else "-"
            ax_r.plot(xs, ys, style, ms=3, lw=1.5, label=key)
    ax_r.set_xlabel("weight version")
    ax_r.set_ylabel("reward mean")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_title("reward")
    ax_r.grid(alpha=0.3)
    if ax_r.lines:
        ax_r.legend(fontsize=8, loc="best")
    if data["loss"]:
        xs = [v for v, _, _ in data["loss"]]
        ax_l.plot(xs, [x for _, x, _ in data["loss"]], color="tab:purple", label="loss")
        ent = [(v, e) for v, _, e in data["loss"] if e is not None]
        if ent:
            ax_l.plot(*zip(*ent, strict=True), color="tab:green", lw=1, label="entropy")
        ax_l.legend(fontsize=8, loc="best")
    ax_l.set_xlabel("weight version")
    ax_l.set_title("learner")
    ax_l.grid(alpha=0.3)
    if data["throughput"]:
        t, rps, spm, tps = zip(*data["throughput"], strict=True)
        ax_t.plot(t, [60 * x for x in rps], label="rollouts/min")
        ax_t.plot(t, spm, label="samples trained/min")
        ax_t.set_ylabel("per minute")
        lines = ax_t.get_lines()
        if any(tps):  # a scripted engine reports no token counts
            ax_tok = ax_t.twinx()
            ax_tok.plot(t, tps, color="tab:red", lw=1, alpha=0.6, label="generated tok/s")
            ax_tok.set_ylabel("tokens/s", color="tab:red")
            lines += ax_tok.get_lines()
        ax_t.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
    ax_t.set_xlabel("minutes")
    ax_t.set_title("throughput")
    ax_t.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write(run_dir / PLOT_NAME, buf.getvalue())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m harnessrl.common.run.plot RUN_DIR", file=sys.stderr)
        sys.exit(2)
    path = plot_run(sys.argv[1])
    print(path if path else "matplotlib is not installed (pip install 'harnessrl[train]')")
