"""``harnessrl run`` end to end, as a subprocess on a tiny budget: a real nats-server, the
embedded engine with its weights-sync updater, two actors running the reference harness in
bubblewrap sandboxes, the assembler and the DeepSpeed learner (PPO: a random tiny model scores
0 everywhere, which gives GRPO groups no variance to learn from, while PPO trains on any
sample). Everything is asserted from what the run recorded."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.common.config import undocumented_fields
from harnessrl.common.natsauth import ROLES
from harnessrl.common.procs import pid_alive
from harnessrl.common.run.config import RunConfig
from tests.helpers.runs import RUN_FILE

REPO = Path(__file__).resolve().parents[1]
STEPS = 2


@pytest.mark.unit
def test_run_config_is_documented() -> None:
    """Every RunConfig field has a docstring (it is the [run] table users edit)."""
    assert undocumented_fields(RunConfig) == []


def read_lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_run_trains_broadcasts_and_cleans_up(tmp_path: Path) -> None:
    """A few steps: samples trained, new weights reached the engine, every issued rollout is a
    sample or a tombstone, no error anywhere, nothing left running or on disk."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    sandboxes = tmp_path / "sandboxes"
    run_file = tmp_path / "run.toml"
    run_file.write_text(RUN_FILE.format(steps=STEPS, sandboxes=sandboxes))
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "harnessrl.common.cli", "run", str(run_file), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    lines = read_lines(out / "metrics.jsonl")
    steps = [ln for ln in lines if ln.get("event") == "step"]
    summary = [ln for ln in lines if ln.get("event") == "summary"][-1]
    assert summary["outcome"] == "done", summary

    # trained, and the new weights reached the engine
    assert sum(s["samples"] for s in steps) > 0
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert summary["version"] == STEPS
    assert summary["engine_versions"] == {"engine-0": str(STEPS)}
    sync_log = (out / "logs" / "weights-sync-0.log").read_text()
    assert f"applied weight version {STEPS}" in sync_log

    # every issued rollout ended as exactly one sample or tombstone
    assert summary["issued"] > 0
    assert summary["unaccounted"] == 0, summary
    assert summary["samples"] + sum(summary["tombstones"].values()) == summary["issued"]
    assert summary["members_with_result"] == summary["issued"]

    # no errors: no restart, no failed rollout, no traceback in any log
    assert summary["restarts"] == {} and summary["failures"] == {}
    assert set(summary["results"]) <= {"ok", "timeout"}, summary["results"]
    for log in (out / "logs").glob("*.log"):
        text = log.read_text()
        assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"

    # the run folder holds what it promises
    for name in ("config.toml", "engine.toml", "commands.sh", "plot.png", "supervisor.log"):
        assert (out / name).exists(), name
    assert (out / "checkpoints" / "latest").exists()
    assert "harnessrl actor" in (out / "commands.sh").read_text()

    # clean shutdown: no child, no nats-server, no sandbox left
    assert summary["leftover_pids"] == []
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", (out / "supervisor.log").read_text())]
    pids += [int(p) for p in re.findall(r"pid (\d+)\)", (out / "logs" / "nats.log").read_text())]
    assert pids and not [p for p in pids if pid_alive(p)]
    assert not sandboxes.exists() or list(sandboxes.iterdir()) == []
    print(f"e2e run: {elapsed:.0f}s, {summary['issued']} rollouts, {summary['samples']} samples")

    # --resume continues the same run from its checkpoint, in the same folder
    proc = subprocess.run(
        [sys.executable, "-m", "harnessrl.common.cli", "run", "--out", str(out), "--resume"]
        + ["--steps", str(STEPS + 1)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = read_lines(out / "metrics.jsonl")
    starts = [ln for ln in lines if ln.get("event") == "start"]
    assert [s["resumed"] for s in starts] == [False, True] and starts[1]["version"] == STEPS
    versions = [ln["version"] for ln in lines if ln.get("event") == "step"]
    assert versions == list(range(1, STEPS + 2))  # each learner line copied exactly once
    summary = [ln for ln in lines if ln.get("event") == "summary"][-1]
    assert summary["outcome"] == "done" and summary["version"] == STEPS + 1
    assert summary["engine_versions"] == {"engine-0": str(STEPS + 1)}
    assert summary["leftover_pids"] == []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_run_with_credentials_tls_and_engine_key(tmp_path: Path) -> None:
    """One step of a run whose bus requires per-role credentials and TLS and whose engine
    requires its API key (the defaults): it trains and broadcasts, no process was refused
    anything (the role permissions cover a real run), and no secret is on a command line."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    sandboxes = tmp_path / "sandboxes"
    run_file = tmp_path / "run.toml"
    run_file.write_text(RUN_FILE.format(steps=1, sandboxes=sandboxes))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "harnessrl.common.cli", "run", str(run_file), "--out", str(out)]
        + ["--actors", "1", "--drain-timeout-s", "30"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = read_lines(out / "metrics.jsonl")
    summary = [ln for ln in lines if ln.get("event") == "summary"][-1]
    assert summary["outcome"] == "done" and summary["version"] == 1, summary
    assert summary["samples_trained"] > 0
    assert summary["engine_versions"] == {"engine-0": "1"}  # updater and monitor sent the key

    commands = (out / "commands.sh").read_text()
    assert "tls://" in commands and "--nats-creds" in commands and "--nats-ca" in commands
    assert "--api-key-file" in commands and "--insecure" not in commands
    auth = out / "auth"
    assert auth.stat().st_mode & 0o077 == 0
    secrets = [(auth / "engine-api-key").read_text().strip()]
    creds = sorted((auth / "nats").glob("*.cred")) + sorted((auth / "nats").glob("actors/*"))
    for cred in creds:
        assert cred.stat().st_mode & 0o777 == 0o600, cred
        secrets.append(cred.read_text().strip().split(":", 1)[1])
    # the engine key, every role, the routes' own, one per actor (the run has one actor)
    assert len(secrets) == 1 + len(ROLES) + 1 + 1
    for secret in secrets:
        assert secret not in commands
        for resolved in (out / "resolved").glob("*.toml"):
            assert secret not in resolved.read_text(), resolved
    for role in ("actors/actor-0", "assembler", "learner", "weights_sync"):
        assert f"auth/nats/{role}.cred" in commands
    for log in [*(out / "logs").glob("*.log"), out / "nats" / "nats-server.log"]:
        text = log.read_text().lower()
        assert "permission" not in text and "authorization violation" not in text, log.name
        assert "traceback" not in text, log.name


# ---------------------------------------------------------------------------------------------
# the pieces of the run's bookkeeping (no processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_counters_survive_a_restart() -> None:
    """A counter that goes down means the process restarted: its old total is carried."""
    from harnessrl.common.run.dashboard import Scraped, total

    s = Scraped()
    key = ("hrl_actor_rollouts_total", (("status", "ok"),))
    gauge = ("hrl_actor_rollouts_inflight", ())
    s.update({key: 5.0, gauge: 3.0})
    s.update({key: 2.0, gauge: 1.0})  # restarted, counted 2 more
    s.update({key: 4.0, gauge: 0.0})
    assert total([s], "hrl_actor_rollouts_total") == 9.0
    assert total([s], "hrl_actor_rollouts_inflight") == 0.0


@pytest.mark.unit
def test_monitor_copies_learner_lines_once(tmp_path: Path) -> None:
    """Learner lines are copied verbatim and only once, also by a resumed supervisor."""
    from harnessrl.common.layout import RollupLine
    from harnessrl.common.run.dashboard import Monitor

    learner = tmp_path / "learner.jsonl"
    learner.write_text(
        json.dumps({"time": 1, "event": "start", "version": 0})
        + "\n"
        + json.dumps({"time": 2, "event": "step", "version": 1, "samples": 4, "reward_mean": 0.5})
        + "\n"
    )
    m = Monitor("r", tmp_path, steps=3, learner_metrics=learner)
    m.copy_learner_lines()
    m.write_line(RollupLine(version=1))
    with open(learner, "a") as f:
        f.write(json.dumps({"time": 3, "event": "step", "version": 2, "samples": 4}) + "\n")
        f.write('{"time": 4, "event": "st')  # a line still being written
    m2 = Monitor("r", tmp_path, steps=3, learner_metrics=learner)
    m2.resume_copy()
    m2.copy_learner_lines()
    lines = read_lines(tmp_path / "metrics.jsonl")
    assert [ln.get("version") for ln in lines if ln.get("source") != "run"] == [0, 1, 2]
    assert m2.status().samples_trained == 8 and m2.reward_train[1] == 0.5


@pytest.mark.unit
def test_plot_from_metrics(tmp_path: Path) -> None:
    """The plot is drawn from metrics.jsonl alone (rollup reward deltas summed per version)."""
    pytest.importorskip("matplotlib")
    from harnessrl.common.layout import read_metrics
    from harnessrl.common.run.plot import plot_run, series

    rows = [
        {"time": 0, "event": "start", "version": 0},
        {"time": 5, "event": "step", "version": 1, "reward_mean": 0.25},
        {"time": 6, "source": "run", "event": "rollup", "rewards": {"train/ref": {"0": [1, 4]}}},
        {"time": 9, "source": "run", "event": "rollup", "rewards": {"train/ref": {"0": [1, 4]}}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = series(read_metrics(tmp_path / "metrics.jsonl"))
    assert data["rewards"] == {"train/ref": [(0, 0.25)]} and data["batch"] == [(1, 0.25)]
    path = plot_run(tmp_path)
    assert path is not None and path.stat().st_size > 1000


@pytest.mark.unit
def test_run_file_round_trip(tmp_path: Path) -> None:
    """The resolved run file parses back to the same tables; [run] is complete and typed."""
    import tomllib

    from harnessrl.common.config import toml_text
    from harnessrl.common.run.plan import resolve

    run_file = tmp_path / "run.toml"
    run_file.write_text(RUN_FILE.format(steps=3, sandboxes=tmp_path / "sb"))
    ns = argparse.Namespace(run_file=str(run_file), config=None, cfg__steps=5, cfg__actors=None)
    cfg, sections = resolve(ns)
    assert cfg.steps == 5 and cfg.actors == 2 and cfg.name == "e2e"  # flag > file > default
    text = toml_text({"run": json.loads(cfg.model_dump_json()), **sections})
    back = tomllib.loads(text)
    assert back["learner"] == sections["learner"] and back["actor"] == sections["actor"]
    assert back["run"]["steps"] == 5 and back["run"]["on_exit"]["learner"] == "stop"


@pytest.mark.unit
def test_run_file_errors_name_the_problem(tmp_path: Path) -> None:
    from harnessrl.common.config import ConfigError
    from harnessrl.common.run.plan import resolve

    bad = tmp_path / "bad.toml"
    for text, expected in (
        ("[run]\nstep = 3\n", "'step': unknown field"),
        ("[run]\n[lerner]\n", "unknown tables ['lerner']"),
        ("steps = 3\n", "belong in a table"),
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(expected)):
            resolve(argparse.Namespace(run_file=str(bad), config=None))


@pytest.mark.integration
def test_a_run_file_that_fails_validation_creates_nothing(tmp_path: Path) -> None:
    """A wrong field in a process's table is refused, naming it, before the run folder exists
    (else the corrected command would find a run there: "already holds a run")."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner]\ngroup_size = 2\n\n[learner.ds]\nlr = -1\n")
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "harnessrl.common.cli", "run", str(bad), "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "[learner]" in proc.stderr and "ds.lr" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def _argv_pairs(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}


@pytest.mark.integration
def test_plan_gives_each_role_its_own_credential_and_no_secret(tmp_path: Path) -> None:
    """Embedded defaults: TLS URL, the server made for this run, each child its own role's
    credential file, the CA and the engine key file; ``nats_insecure`` drops them all; an
    external server's credentials come from ``nats_auth_dir``."""
    from harnessrl.common.run.plan import SECTIONS, Paths, Plan

    sections = {s: {} for s in SECTIONS}
    plan = Plan(RunConfig(name="p1"), sections, Paths(tmp_path / "a"))
    auth = plan.paths.nats_auth
    assert plan.nats_url.startswith("tls://127.0.0.1:")
    nats = _argv_pairs(plan.nats_argv())
    assert nats["--runs"] == "p1" and nats["--auth-dir"] == str(auth)
    assert "--insecure" not in plan.nats_argv()
    assert nats["--actors"] == str(plan.cfg.actors)  # one credential per actor
    for role, argv in [
        ("actors/actor-0", plan.actor_argv(0)),
        ("actors/actor-1", plan.actor_argv(1)),
        ("assembler", plan.assembler_argv()),
        ("learner", plan.learner_argv()),
        ("weights_sync", plan.weights_sync_argv("engine-0")),
    ]:
        flags = _argv_pairs(argv)
        assert flags["--nats-creds"] == str(auth / f"{role}.cred"), role
        assert flags["--nats-ca"] == str(auth / "tls" / "ca.pem"), role
    key = str(plan.paths.engine_key)
    assert _argv_pairs(plan.engine_argv("engine-0"))["--api-key-file"] == key
    assert _argv_pairs(plan.actor_argv(0))["--engine-api-key-file"] == key
    assert _argv_pairs(plan.learner_argv())["--broadcast.engine-api-key-file"] == key

    open_plan = Plan(RunConfig(name="p2", nats_insecure=True), sections, Paths(tmp_path / "b"))
    assert open_plan.nats_url.startswith("nats://") and "--insecure" in open_plan.nats_argv()
    assert "--nats-creds" not in open_plan.actor_argv(0)

    ext_auth = tmp_path / "ext"
    (ext_auth / "tls").mkdir(parents=True)
    (ext_auth / "tls" / "ca.pem").write_text("x")
    cfg = RunConfig(name="p3", nats="tls://nats.example:4222", nats_auth_dir=str(ext_auth))
    ext = Plan(cfg, sections, Paths(tmp_path / "c"))
    flags = _argv_pairs(ext.assembler_argv())
    assert flags["--nats"] == "tls://nats.example:4222"
    assert flags["--nats-creds"] == str(ext_auth / "assembler.cred")
    assert flags["--nats-ca"] == str(ext_auth / "tls" / "ca.pem")
    assert ext.nats_creds("admin") == str(ext_auth / "admin.cred")
    assert _argv_pairs(ext.actor_argv(3))["--nats-creds"] == str(ext_auth / "actors/actor-3.cred")
    assert ext.specs()["nats"] == []
