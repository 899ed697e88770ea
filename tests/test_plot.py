"""The reward plot: the moving average over noisy per-version rewards, the held-out points
with their intervals, and the demo's before/after evaluation drawn on the RL phase's plot."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from harnessrl.common.layout import read_metrics
from harnessrl.common.run.plot import HeldOut, draw, interval95, plot_run, series, smooth, window

pytestmark = pytest.mark.unit


def test_smooth_weights_every_rollout_once() -> None:
    """A version with 30 rollouts counts 30 times as much as one with 1; a constant curve stays
    constant; the window is a twentieth of the curve, at least a 3-point average."""
    pts = [(0, 0.0, 30), (1, 1.0, 1), (2, 0.0, 30), (3, 1.0, 1), (4, 0.0, 30)]
    sm = dict(smooth(pts, half=1))
    assert sm[2] == pytest.approx(2 / 32)  # versions 1-3: 2 successes in 32 rollouts
    assert sm[0] == pytest.approx(1 / 31)  # the window is cut at the ends
    flat = [(v, 0.4, 8) for v in range(50)]
    assert [m for _, m in smooth(flat)] == pytest.approx([0.4] * 50)
    assert smooth(flat[:4]) == []  # too few points to smooth
    assert (window(10), window(120), window(280)) == (1, 6, 14)


def test_smooth_recovers_a_trend_from_noise() -> None:
    """Per-version means of 8 rollouts around a rising trend: the moving average is several
    times closer to the trend than the points it averages."""
    rng = random.Random(0)
    trend = [0.2 + 0.5 * v / 119 for v in range(120)]
    pts = [(v, sum(rng.random() < p for _ in range(8)) / 8, 8) for v, p in enumerate(trend)]
    raw_err = sum(abs(m - trend[v]) for v, m, _ in pts) / len(pts)
    sm_err = sum(abs(m - trend[v]) for v, m in smooth(pts)) / len(pts)
    assert sm_err < raw_err / 2.5


def test_interval95() -> None:
    assert interval95(0.5, 100) == pytest.approx(0.098)
    assert interval95(0.0, 50) == 0.0 and interval95(0.3, 0) == 0.0
    assert interval95(1.2, 10) == 0.0  # clamped to [0, 1]


def metrics(tmp_path: Path) -> Path:
    rng = random.Random(1)
    rows: list[dict] = [{"time": 0, "event": "start", "version": 0}]
    for v in range(40):
        s = sum(rng.random() < 0.3 + v / 100 for _ in range(8))
        rewards = {"train/mini-swe-agent": {str(v): [s, 8]}}
        if v % 10 == 0:
            rewards["eval/mini-swe-agent"] = {str(v): [0.25 * 20 + v / 10, 20]}
        rows.append({"time": v + 1, "source": "run", "event": "rollup", "rewards": rewards})
        rows.append({"time": v + 1, "event": "step", "version": v + 1, "reward_mean": s / 8})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / "metrics.jsonl"


def test_series_smooths_training_rewards_not_held_out_ones(tmp_path: Path) -> None:
    data = series(read_metrics(metrics(tmp_path)))
    assert set(data["smoothed"]) == {"train/mini-swe-agent"}
    assert len(data["smoothed"]["train/mini-swe-agent"]) == 40
    assert data["counts"]["eval/mini-swe-agent"][1] == (10, pytest.approx(0.3), 20)


def test_plot_draws_the_average_and_the_held_out_points(tmp_path: Path) -> None:
    """The reward panel's legend names the moving average, the run's held-out rollouts and the
    before/after evaluation; each held-out point has its interval."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    data = series(read_metrics(metrics(tmp_path)))
    held = [HeldOut(0, 0.3, 200, "mini-swe-agent", "before"), HeldOut(40, 0.5, 200, "mini-swe-agent", "after")]  # fmt: skip
    fig = draw(Figure, data, "t", held)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "train/mini-swe-agent (5-version avg)" in labels
    assert "eval/mini-swe-agent" in labels
    assert "held-out before (mini-swe-agent, n=200)" in labels
    assert "held-out after (mini-swe-agent, n=200)" in labels
    bars = [c for c in ax.containers if c.get_label().startswith("held-out")]
    (_, caps, (segments,)) = bars[1]
    (_, lo), (_, hi) = segments.get_segments()[0]
    assert (lo, hi) == pytest.approx((0.5 - interval95(0.5, 200), 0.5 + interval95(0.5, 200)))
    path = plot_run(tmp_path, "t", held)
    assert path is not None and path.stat().st_size > 1000


def test_demo_redraws_the_rl_plot_with_its_evaluation(tmp_path: Path) -> None:
    """The demo puts its before/after evaluation on the RL phase's plot: the starting policy at
    version 0, the trained one at the last version, per harness."""
    from harnessrl.common.run.demo import held_out_points

    rows = [("reference", {"reward": 0.4, "n": 200}, {"reward": 0.6, "n": 200})]
    (before, after) = held_out_points(rows, 120)
    assert (before.version, before.mean, before.label) == (0, 0.4, "before")
    assert (after.version, after.mean, after.n, after.harness) == (120, 0.6, 200, "reference")
