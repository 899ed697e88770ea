"""Reward and throughput plot of a run, drawn from its ``metrics.jsonl`` alone.

Three panels: reward mean by weight version (the learner's batch reward, and from the rollout
results the mean per harness for training and held-out eval rollouts, by the version they were
issued at), the learner's loss by version (``loss/sft`` for SFT, ``loss/total`` otherwise, with
the policy entropy when reported), and throughput over wall time (rollouts/s, samples
trained/min, generated tokens/s).
In the reward panel each harness's training reward is drawn twice: its per-version means as
faint points (noisy: a version holds a few groups) and a moving average over them (`smooth`:
the mean of every rollout within ``window`` versions either side, so it follows the rollouts,
not the versions); held-out rewards are points with a 95 % interval, the run's periodic
``eval/<harness>`` rollouts and, where given (``harnessrl demo`` after its evaluation), the
before/after evaluation of the starting and the final policy (`HeldOut`).
Uses matplotlib's object API with the Agg backend (no display, no pyplot state, safe in a
worker thread) and replaces the PNG atomically, so a viewer never sees half a file.

    python -m harnessrl.common.run.plot RUN_DIR     # (re)draw RUN_DIR/plot.png
"""

from __future__ import annotations

import io
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.common.files import atomic_write
from harnessrl.common.layout import MetricsLine, RollupLine, effective_steps, read_metrics

PLOT_NAME = "plot.png"


@dataclass(frozen=True)
class HeldOut:
    """One held-out measurement drawn as a point: the mean reward of ``n`` rollouts of the
    policy at weight ``version`` through ``harness`` (``label``: e.g. "before", "after")."""

    version: int
    mean: float
    n: int
    harness: str = ""
    label: str = ""


def interval95(mean: float, n: int) -> float:
    """Half-width of a conservative 95 % interval of a mean of ``n`` rewards in [0, 1] (a
    reward's variance is at most ``mean * (1 - mean)``, a success's exactly that)."""
    if n <= 0:
        return 0.0
    m = min(max(mean, 0.0), 1.0)
    return 1.96 * math.sqrt(m * (1 - m) / n)


def window(n_points: int) -> int:
    """Versions either side of a point in its moving average: a twentieth of the curve, at
    least one (a 3-point average) — about 13 versions in a 120-version run."""
    return max(1, round(n_points / 20))


def smooth(
    points: list[tuple[int, float, int]], half: int | None = None
) -> list[tuple[int, float]]:
    """Moving average of per-version means ``(version, mean, n)``, weighted by ``n`` (every
    rollout counts once) over the ``half`` points either side (`window` by default); empty
    when there are too few points to smooth (fewer than 5)."""
    if len(points) < 5:
        return []
    half = window(len(points)) if half is None else half
    out = []
    for i, (v, _, _) in enumerate(points):
        near = points[max(0, i - half) : i + half + 1]
        n = sum(k for _, _, k in near)
        out.append((v, sum(m * k for _, m, k in near) / n if n else float("nan")))
    return out


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
    counted = {
        k: sorted((v, s / n, int(n)) for v, (s, n) in per.items() if n)
        for k, per in sorted(acc.items())
    }
    rewards = {k: [(v, m) for v, m, _ in pts] for k, pts in counted.items()}
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
        "counts": counted,
        "smoothed": {k: smooth(pts) for k, pts in counted.items() if not k.startswith("eval/")},
        "throughput": [
            ((r.time - t0) / 60, r.rollouts_per_s, r.samples_per_min, r.gen_tokens_per_s)
            for r in rollups
        ],
    }


def plot_run(
    run_dir: str | Path, title: str = "", held_out: list[HeldOut] | None = None
) -> Path | None:
    """Draw ``<run_dir>/plot.png`` (``held_out``: evaluations made outside the run, drawn as
    points with their intervals); None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    run_dir = Path(run_dir)
    fig = draw(Figure, series(read_metrics(run_dir / "metrics.jsonl")), title, held_out)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write(run_dir / PLOT_NAME, buf.getvalue())


def draw(
    figure: Any, data: dict[str, Any], title: str = "", held_out: list[HeldOut] | None = None
) -> Any:
    """The figure of `series` ``data`` (``figure``: matplotlib's ``Figure`` class)."""
    fig = figure(figsize=(15, 4.2), dpi=100)
    ax_r, ax_l, ax_t = fig.subplots(1, 3)
    if data["batch"]:
        xs, ys = zip(*data["batch"], strict=True)
        ax_r.plot(xs, ys, color="0.75", lw=0.8, label="train batch (learner)")
    colors: dict[str, Any] = {}

    def color(harness: str) -> Any:
        return colors.setdefault(harness, f"C{len(colors) % 10}")

    for key, pts in data["counts"].items():
        if not pts:
            continue
        kind, _, harness = key.partition("/")
        xs = [v for v, _, _ in pts]
        ys = [m for _, m, _ in pts]
        c = color(harness)
        if kind == "eval":
            err = [interval95(m, n) for _, m, n in pts]
            ax_r.errorbar(xs, ys, yerr=err, fmt="D", ms=4, color=c, capsize=2, lw=1, label=key)
            continue
        sm = data["smoothed"].get(key) or []
        ax_r.plot(xs, ys, ".", ms=3, alpha=0.35 if sm else 1.0, color=c, label=None if sm else key)
        if sm:
            w = 2 * window(len(pts)) + 1
            ax_r.plot(*zip(*sm, strict=True), "-", lw=2, color=c, label=f"{key} ({w}-version avg)")
    for h in held_out or []:
        c = color(h.harness)
        label = f"held-out {h.label}".strip() + (f" ({h.harness}, n={h.n})" if h.harness else "")
        ax_r.errorbar(
            [h.version], [h.mean], yerr=[interval95(h.mean, h.n)], fmt="*", ms=11, color=c,
            mec="black", mew=0.6, capsize=3, lw=1.2, label=label,
        )  # fmt: skip
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
    return fig


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m harnessrl.common.run.plot RUN_DIR", file=sys.stderr)
        sys.exit(2)
    path = plot_run(sys.argv[1])
    print(path if path else "matplotlib is not installed (pip install 'harnessrl[train]')")
