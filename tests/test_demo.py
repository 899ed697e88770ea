"""``harnessrl demo``: its run files are valid ``harnessrl run`` configs, bad input is refused
with a message naming the field, and a tiny demo runs all three phases end to end (SFT on
teacher trajectories through the real pipeline, PPO from the SFT weights, held-out eval)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.common.config import toml_text
from harnessrl.common.procs import pid_alive
from harnessrl.common.run.demo import (
    DemoConfig,
    final_weights,
    paired,
    rl_run_file,
    sft_run_file,
    sft_steps,
    train_suite,
)
from harnessrl.common.run.plan import resolve
from harnessrl.common.tasks.toy import FAMILIES
from tests.helpers.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
HRL = [sys.executable, "-m", "harnessrl.common.cli"]


def _resolve(tmp_path: Path, name: str, tables: dict) -> tuple:
    path = tmp_path / f"{name}.toml"
    path.write_text(toml_text(tables))
    return resolve(argparse.Namespace(run_file=str(path), config=None))


@pytest.mark.unit
def test_phase_run_files_are_valid_run_configs(tmp_path: Path) -> None:
    """What the demo writes to ``sft.toml``/``rl.toml`` parses as a run file, with the
    demo's choices carried into the right tables."""
    cfg = DemoConfig(
        steps=3,
        algo="ppo",
        harnesses=["reference", "codex"],
        sft_minutes=2,
        engine_threads=1,
        learner_threads=2,
    )
    run, sections = _resolve(tmp_path, "sft", sft_run_file(cfg, "d-sft", "/x/toy-train"))
    assert run.engine_kind == "teacher" and not run.weights_sync
    assert run.teacher_suites == ["/x/toy-train"]
    assert sections["learner"]["feeder"]["suites"] == ["/x/toy-train"]
    assert run.steps == sft_steps(cfg) == 45 and run.time_limit_s == 120
    assert sections["learner"]["sft"] is True
    assert sections["learner"]["feeder"]["harnesses"] == ["reference"]  # the teacher's tools

    policy = tmp_path / "policy"
    run, sections = _resolve(tmp_path, "rl", rl_run_file(cfg, "d-rl", policy))
    assert run.steps == 3 and run.weights_sync
    assert sections["learner"]["algo"] == "ppo" and sections["learner"]["model"] == str(policy)
    assert sections["engine"]["model"] == str(policy) == sections["actor"]["model"]
    assert sections["learner"]["feeder"]["harnesses"] == ["reference", "codex"]
    assert sections["engine"]["threads"] == 1 and sections["learner"]["threads"] == 2
    ds = sections["learner"]["ds"]
    assert ds["lr_decay_versions"] == 3 and ds["lr_min_ratio"] == 0.1  # cosine to the last step
    # the measured defaults per algorithm: PPO one optimiser step per batch, GRPO two
    assert sections["learner"]["updates_per_batch"] == 1
    grpo = cfg.model_copy(update={"algo": "grpo"})
    assert rl_run_file(grpo, "d-rl", policy)["learner"]["updates_per_batch"] == 2
    # with the shape fields at 0, each algorithm gets its measured shape: GRPO 120 steps of
    # 2 groups of 8, PPO 280 steps of 4 groups of 4; a field set by hand wins
    for algo, shape in (("grpo", (120, 8, 2)), ("ppo", (280, 4, 4))):
        run, sections = _resolve(tmp_path, algo, rl_run_file(DemoConfig(algo=algo), "d", policy))
        lrn = sections["learner"]
        assert (run.steps, lrn["group_size"], lrn["batch_groups"]) == shape
        assert lrn["ds"]["lr_decay_versions"] == shape[0]
    mine = DemoConfig(algo="ppo", group_size=8, batch_groups=2)
    assert rl_run_file(mine, "d", policy)["learner"]["group_size"] == 8
    assert rl_run_file(mine, "d", policy)["learner"]["batch_groups"] == 2
    k3 = cfg.model_copy(update={"updates_per_batch": 3})
    assert rl_run_file(k3, "d-rl", policy)["learner"]["updates_per_batch"] == 3
    # PPO's critic options reach the learner; GRPO has no critic to configure
    critic = cfg.model_copy(update={"value_baseline": "token", "value_lr_scale": 2.0})
    _, sections = _resolve(tmp_path, "critic", rl_run_file(critic, "d-rl", policy))
    assert sections["learner"]["loss"]["value_baseline"] == "token"
    assert sections["learner"]["ds"]["value_lr_scale"] == 2.0
    learner = rl_run_file(grpo, "d-rl", policy)["learner"]
    assert "value_baseline" not in learner["loss"] and "value_lr_scale" not in learner["ds"]
    # the KL to the warm start: PPO's measured default 0.1, GRPO none; a value set by hand wins
    assert sections["learner"]["loss"]["kl_coef"] == 0.1 and learner["loss"]["kl_coef"] == 0.0
    mine = cfg.model_copy(update={"kl_coef": 0.0})
    assert rl_run_file(mine, "d-rl", policy)["learner"]["loss"]["kl_coef"] == 0.0
    # replies cut off at the token limit: kept and paid as scored unless asked otherwise
    assert "truncated_reward" not in sections["learner"]
    assert sections["assembler"].get("drop_truncated", False) is False
    cut = cfg.model_copy(update={"truncated_reward": 0.0, "drop_truncated": True})
    _, sections = _resolve(tmp_path, "cut", rl_run_file(cut, "d-rl", policy))
    assert sections["learner"]["truncated_reward"] == 0.0
    assert sections["assembler"]["drop_truncated"] is True

    external = DemoConfig(engines=["http://gpu-0:30000"], nats="nats://n:4222")
    run, _ = _resolve(tmp_path, "ext", rl_run_file(external, "d-rl", policy))
    assert run.engines == ["http://gpu-0:30000"] and run.nats == "nats://n:4222"


@pytest.mark.unit
def test_training_suite_is_generated_once_and_holds_out_toy_eval(tmp_path: Path) -> None:
    from harnessrl.common.tasks import list_tasks

    assert train_suite(DemoConfig(train_per_family=6), tmp_path) == "toy"
    path = train_suite(DemoConfig(train_per_family=8), tmp_path)
    tasks = list_tasks(path, split="train")
    assert len(tasks) == 8 * len(FAMILIES)
    builtin = {t.id: t for t in list_tasks("toy")}
    mine = {t.id: t for t in tasks}
    assert set(builtin) < set(mine)  # the built-in tasks come first, unchanged
    for tid, t in builtin.items():
        ws, ws2 = t.path / "workspace", mine[tid].path / "workspace"
        files = sorted(p.relative_to(ws) for p in ws.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(ws2) for p in ws2.rglob("*") if p.is_file())
        assert all((ws / f).read_bytes() == (ws2 / f).read_bytes() for f in files)

    def content(t) -> tuple:
        ws = t.path / "workspace"
        files = {str(p.relative_to(ws)): p.read_text() for p in ws.rglob("*") if p.is_file()}
        return (t.instruction, tuple(sorted(files.items())))

    assert not {content(t) for t in tasks} & {content(t) for t in list_tasks("toy-eval")}
    (Path(path) / "copy_01" / "marker").write_text("kept")
    assert train_suite(DemoConfig(train_per_family=8), tmp_path) == path  # not rewritten
    assert (Path(path) / "copy_01" / "marker").exists()


@pytest.mark.unit
def test_paired_outcomes_match_task_and_seed() -> None:
    """Before/after rollouts pair by (task, k) within a harness; unmatched ones are left out."""

    def r(policy: str, task: str, k: int, reward: float, harness: str = "reference") -> dict:
        return {"policy": policy, "task": task, "k": k, "reward": reward, "harness": harness}

    report = {
        "results": [
            *(r("A", "t1", k, x) for k, x in enumerate([1.0, 0.0, 1.0, 0.5])),
            *(r("B", "t1", k, x) for k, x in enumerate([1.0, 1.0, 0.0, 0.5])),
            r("B", "t2", 0, 1.0),  # no twin
            r("A", "t1", 0, 0.0, "codex"),  # another harness
        ]
    }
    assert paired(report, "A", "B", "reference") == {
        "fixed": 1,
        "broken": 1,
        "both": 1,
        "neither": 1,
    }


@pytest.mark.unit
def test_default_policy_is_the_shipped_one_that_speaks_the_harnesses() -> None:
    """No ``--model``: the reference harness starts from ``tiny-agent``, mini-swe-agent and
    Claude Code (alone or mixed with reference) from ``tiny-agent-harness``, whose recipe lists
    them; a harness no shipped policy speaks runs ``tiny-agent``; an explicit model wins."""
    assert DemoConfig().model == "tiny-agent"
    for hs in (["mini-swe-agent"], ["claude-code"], ["reference", "mini-swe-agent", "claude-code"]):
        assert DemoConfig(harnesses=hs).model == "tiny-agent-harness", hs
    assert DemoConfig(harnesses=["codex"]).model == "tiny-agent"
    assert DemoConfig(harnesses=["claude-code"], model="tiny-agent").model == "tiny-agent"
    assert DemoConfig(from_scratch=True, harnesses=["claude-code"]).model == "tiny-1m"
    # the RL phase's time limit: longer through a real harness (slower rollouts)
    assert DemoConfig().rl_minutes == 12 and DemoConfig(harnesses=["claude-code"]).rl_minutes == 28
    assert DemoConfig(harnesses=["mini-swe-agent"], rl_minutes=5).rl_minutes == 5


@pytest.mark.unit
def test_sft_steps_default_follows_rl_steps() -> None:
    assert sft_steps(DemoConfig(steps=4)) == 60
    assert sft_steps(DemoConfig(steps=100)) == 400
    assert sft_steps(DemoConfig(steps=4, sft_steps=7)) == 7


@pytest.mark.unit
def test_final_weights_falls_back_to_the_last_version(tmp_path: Path) -> None:
    weights = tmp_path / "learner" / "weights"
    with pytest.raises(RuntimeError, match="no weights"):
        final_weights(tmp_path, 5)
    for v in (3, 4):
        (weights / f"v{v:09d}").mkdir(parents=True)
    (weights / "v000000004" / "model.safetensors").write_bytes(b"x")
    assert final_weights(tmp_path, 4).name == "v000000004"
    assert final_weights(tmp_path, 9).name == "v000000004"  # a time limit ended it early


@pytest.mark.integration
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--algo", "sac"], "algo"),
        (["--steps", "-1"], "steps"),
        (["--group-size", "1"], "group_size"),
        (["--sft-minutes", "-1"], "sft_minutes"),
    ],
)
def test_bad_flags_name_the_field(args: list[str], expected: str) -> None:
    res = subprocess.run([*HRL, "demo", *args], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 2, res.stderr
    assert expected in res.stderr.replace("-", "_"), res.stderr


@pytest.mark.integration
def test_refuses_a_finished_demo_folder(tmp_path: Path) -> None:
    (tmp_path / "demo.json").write_text("{}")
    res = subprocess.run(
        [*HRL, "demo", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO
    )
    assert res.returncode == 2 and "already holds a finished demo" in res.stderr


def run_tiny_demo(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """``harnessrl demo`` at its smallest (PPO: it steps on any batch; one RL step; two
    held-out tasks once), asserting it exits 0."""
    proc = subprocess.run(
        [*HRL, "demo", "--algo", "ppo", "--steps", "1", "--eval-limit", "2", "--eval-n", "1"]
        + ["--group-size", "4", "--batch-groups", "2", "--no-dashboard", "--out", str(out)]
        + list(flags),
        capture_output=True,
        text=True,
        timeout=570,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_demo_runs_every_phase(tmp_path: Path) -> None:
    """Two SFT steps on teacher trajectories, one PPO step, two held-out tasks: every phase
    finishes cleanly and the demo reports what it measured."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    out = tmp_path / "demo"
    t0 = time.monotonic()
    proc = run_tiny_demo(out, "--from-scratch", "--sft-steps", "2")
    doc = json.loads((out / "demo.json").read_text())
    sft, rl = doc["phases"]["sft"], doc["phases"]["rl"]

    # SFT: the teacher's trajectories all scored 1 and were trained on
    assert sft["outcome"] == "done" and sft["version"] == 2
    assert sft["samples_trained"] > 0 and sft["reward_first"] == 1.0
    assert Path(doc["sft_policy"]).name == "v000000002"
    # RL from the SFT weights: a step was taken and reached the engine
    assert rl["outcome"] == "done" and rl["version"] == 1
    assert rl["samples_trained"] > 0 and rl["engine_versions"] == {"engine-0": "1"}
    assert (out / "rl.toml").read_text().count(doc["sft_policy"]) >= 3
    for phase in (sft, rl):
        assert phase["restarts"] == {} and phase["failures"] == {}
        assert phase["leftover_pids"] == []
    # the before/after table: both policies scored on the held-out tasks
    eval_doc = json.loads((out / "eval.json").read_text())
    assert eval_doc["tasks"] == 2
    row = doc["before_after"]["reference"]
    assert row["before"]["n"] == 2 and row["after"]["n"] == 2
    assert sum(row["paired"].values()) == 2  # each held-out rollout paired with its twin
    assert "before: cold-start SFT v2" in proc.stdout and "after: PPO v1" in proc.stdout
    assert (out / "rl" / "plot.png").exists() and (out / "sft" / "plot.png").exists()
    for log in [*(out / "sft" / "logs").glob("*.log"), *(out / "rl" / "logs").glob("*.log")]:
        assert "Traceback" not in log.read_text(), log.name
    print(f"tiny demo: {time.monotonic() - t0:.0f}s")


@pytest.mark.unit
def test_example_run_file_is_valid() -> None:
    """``deploy/run-toy.toml`` (README's ``harnessrl run`` example) validates table by table
    against the config of the process that reads it."""
    import importlib

    from harnessrl.common import cli

    cfg, sections = resolve(
        argparse.Namespace(run_file=str(REPO / "deploy" / "run-toy.toml"), config=None)
    )
    assert cfg.name == "toy" and cfg.steps == 120
    for section, table in sections.items():
        module = cli.COMMANDS[section.replace("_", "-")].module
        importlib.import_module(module).CONFIG.model_validate(table)
    assert sections["learner"]["feeder"]["eval_suite"] == "toy-eval"


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc, children first)."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_demo_alone_stops_every_phase(tmp_path: Path, sig: int) -> None:
    """``kill -INT`` (or ``-TERM``) sent to the demo's PID alone, not to its process group as a
    terminal's Ctrl-C is: the running phase is stopped once, cleanly, and the demo exits
    128 + signal with nothing of it left running."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [*HRL, "demo", "--steps", "200", "--no-dashboard", "--no-eval", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        start_new_session=True,  # its own group: only the signal sent below reaches it
    )
    try:
        started = lambda: (out / "rl" / "metrics.jsonl").exists()  # noqa: E731
        wait_until(started, 200, "the RL phase to start", interval=0.5, proc=proc)

        def rl_processes() -> list[int] | None:
            tree = _descendants(proc.pid)
            names = " ".join(_cmdline(p) for p in tree)
            return tree if all(n in names for n in ("learner", "actor", "assembler")) else None

        tree = wait_until(rl_processes, 60, "the RL phase's processes", proc=proc)
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
        text = proc.stdout.read()
        assert rc == 128 + sig, text[-3000:]
        assert "interrupted" in text and "killing every process" not in text, text[-3000:]
        left = [p for p in tree if pid_alive(p)]
        assert left == [], left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
