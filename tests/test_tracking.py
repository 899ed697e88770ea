"""Experiment tracking (``harnessrl.common.tracking``): a real learner logs what it writes to
``metrics.jsonl`` to Weights & Biases (offline mode: the run's own ``.wandb`` log, read back
record by record) and TensorBoard (event files, read back with TensorBoard's own reader), and
imports neither when neither is asked for."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harnessrl.common.layout import CommitLine, StepLine, read_metrics
from harnessrl.common.tracking import TrackConfig, scalars
from tests.helpers.tracking import (
    learner_config,
    tensorboard_events,
    train,
    wandb_config,
    wandb_history,
    wandb_records,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
async def test_learner_logs_metrics_config_and_eval_to_wandb_and_tensorboard(
    tmp_path: Path,
) -> None:
    """Three steps with W&B (offline) and TensorBoard on: both hold every step's numbers as
    ``metrics.jsonl`` has them, at its version; the learner's config and the run file; the
    eval table. A resumed learner goes on with the same W&B run."""
    run_file = tmp_path / "config.toml"
    run_file.write_text('[run]\nname = "trk"\n\n[learner]\nmodel = "tiny-1m"\n')
    track = {
        "wandb": "hrl-test",
        "wandb_mode": "offline",
        "tensorboard": str(tmp_path / "tb"),
        "config_file": str(run_file),
    }
    cfg = learner_config(tmp_path, max_steps=3, track=track)
    await train(cfg, groups=3)
    lines = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [m for m in lines if isinstance(m, StepLine)]
    assert [s.version for s in steps] == [1, 2, 3] and any(s.eval for s in steps)

    records = wandb_records(tmp_path / "run")
    config = wandb_config(records)
    assert config["algo"] == "grpo" and config["ds"]["lr"] == cfg.ds.lr
    assert config["run_file"] == {"run": {"name": "trk"}, "learner": {"model": "tiny-1m"}}
    history = wandb_history(records)
    for s in steps:
        (row,) = [h for h in history if h.get("version") == s.version and "reward_mean" in h]
        expected = scalars(s)
        assert {k: row[k] for k in expected} == pytest.approx(expected)
        assert row["metrics/loss/total"] == pytest.approx(s.metrics["loss/total"])
    commits = [m for m in lines if isinstance(m, CommitLine)]
    assert commits and any("commit/checkpoint_s" in h for h in history)
    tables = [h["eval/table/path"] for h in history if h.get("eval/table/_type") == "table-file"]
    assert tables, history
    (run_files,) = (tmp_path / "run").glob("wandb/offline-run-*/files")
    table = json.loads((run_files / tables[-1]).read_text())
    eval_rows = [
        [s.version, *key.rpartition("/")[::2], v["mean"], v["n"]]
        for s in steps
        for key, v in sorted((s.eval or {}).items())
    ]
    assert table["columns"] == ["version", "suite", "harness", "mean", "n"]
    assert table["data"] == eval_rows  # the last table logged holds every eval result

    tb = tensorboard_events(tmp_path / "tb")
    got = {e.step: e.value for e in tb.Scalars("reward_mean")}
    assert got == pytest.approx({s.version: s.reward_mean for s in steps})
    assert {"config", "eval/table"} <= set(tb.Tags()["tensors"])

    run_id = (tmp_path / "run" / "wandb-run-id").read_text().strip()
    resumed = learner_config(tmp_path, max_steps=1, track=track, resume=True)
    await train(resumed, groups=1)
    ids = {r.run.run_id for r in wandb_records(tmp_path / "run") if r.HasField("run")}
    assert ids == {run_id}


@pytest.mark.unit
def test_scalars_are_the_numbers_of_the_line() -> None:
    """Every number of a line by its JSON path (a commit's under ``commit/``), nothing else."""
    line = StepLine(
        version=4,
        step=4,
        reward_mean=0.5,
        committed=True,
        staleness={"0": 3},
        metrics={"loss/total": 0.25},
        rollouts=["g-0-1"],
        eval={"toy-eval/reference": {"mean": 0.75, "n": 2}},
    )
    got = scalars(line)
    assert got["reward_mean"] == 0.5 and got["metrics/loss/total"] == 0.25
    assert got["staleness/0"] == 3 and got["eval/toy-eval/reference/mean"] == 0.75
    assert "version" not in got and "committed" not in got and "time" not in got
    assert not [k for k in got if k.startswith("rollouts")]
    commit = scalars(CommitLine(version=4, checkpoint_s=1.5, dropped={"stale": 2}))
    assert commit == {"commit/checkpoint_s": 1.5, "commit/dropped/stale": 2.0}


@pytest.mark.slow
def test_nothing_is_imported_without_tracking(tmp_path: Path) -> None:
    """A learner trained without ``--wandb``/``--tensorboard`` never imports either library
    and writes nothing of theirs (a fresh process: other tests may have imported them)."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from tests.helpers.tracking import learner_config, train
        cfg = learner_config(Path({str(tmp_path)!r}), max_steps=2)
        asyncio.run(train(cfg, groups=2))
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("wandb", "tensorboard")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    steps = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if isinstance(m, StepLine)]
    assert len(steps) == 2
    assert not list((tmp_path / "run").glob("wandb*"))


@pytest.mark.unit
def test_run_and_demo_pass_tracking_to_the_learner(tmp_path: Path) -> None:
    """``harnessrl run --wandb --tensorboard DIR`` fills the learner's ``[track]`` table (with
    the run file logged as config); the demo gives each phase a W&B run in its group and a
    TensorBoard folder of its own."""
    from harnessrl.common.run import run as run_cmd
    from harnessrl.common.run.demo import DemoConfig, rl_run_file
    from harnessrl.common.run.plan import resolve

    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    out = tmp_path / "r"
    args = parser.parse_args(["--wandb", "--tensorboard", str(tmp_path / "tb"), "--out", str(out)])
    _, sections = resolve(args)
    assert sections["learner"]["track"] == {
        "wandb": "harnessrl",
        "tensorboard": str(tmp_path / "tb"),
        "config_file": str(out.resolve() / "config.toml"),
    }
    _, plain = resolve(parser.parse_args(["--out", str(out)]))
    assert "track" not in plain["learner"]

    demo = DemoConfig(track=TrackConfig(wandb="p", tensorboard=str(tmp_path / "tb")))
    track = rl_run_file(demo, "demo7-rl", tmp_path)["learner"]["track"]
    assert track == {"wandb": "p", "wandb_group": "demo7", "tensorboard": str(tmp_path / "tb/rl")}
    assert "track" not in rl_run_file(DemoConfig(), "demo7-rl", tmp_path)["learner"]


@pytest.mark.unit
def test_demo_logs_its_held_out_table(tmp_path: Path) -> None:
    """The demo's before/after table goes to the trackers too (here TensorBoard ``DIR/eval``)."""
    import io

    from harnessrl.common.run.demo import Demo, DemoConfig

    cfg = DemoConfig(out=tmp_path / "demo", track=TrackConfig(tensorboard=str(tmp_path / "tb")))
    demo = Demo(cfg, out=io.StringIO())
    before_after = {
        "reference": {
            "before": {"reward": 0.25, "success": 0.2},
            "after": {"reward": 0.5, "success": 0.45},
            "paired": {"fixed": 7, "broken": 2},
        }
    }
    demo.track_held_out(before_after)
    tb = tensorboard_events(tmp_path / "tb" / "eval")
    (event,) = tb.Tensors("held_out")
    text = event.tensor_proto.string_val[0].decode()
    assert "| reference | 0.25 | 0.5 | 0.2 | 0.45 | 7 | 2 |" in text, text
