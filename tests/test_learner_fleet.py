"""The learner as a fleet of data-parallel ranks (``harnessrl.learner.fleet``), world size 2 on CPU/gloo.

* A step on two ranks equals a step on one rank on the same batch (loss terms, gradient norm,
  post-step weights, within 1e-5 relative in fp32), with every scored token of the batch
  trained by exactly one rank; under ZeRO-3 the broadcast gathers the sharded weights and a
  checkpoint written by both ranks round-trips.
* Killing one rank stops the other: it exits with an error instead of hanging in a
  collective, and the last commit stays whole.
* ``harnessrl learner`` under torchrun (2 ranks) trains on samples from a real nats-server,
  commits, and stops cleanly on SIGTERM.

Ranks are started as processes with the launcher's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``...), as torchrun would.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks._learner_fleet import finish, launch
from harnessrl.common.run.config import RunConfig
from harnessrl.learner.fleet import shard_rows
from tests.helpers.wait import wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.unit
def test_shard_rows_gives_each_row_to_exactly_one_rank() -> None:
    """Contiguous shards cover every row once, for any row and rank count."""
    for n in range(0, 12):
        for ranks in range(1, 5):
            parts = shard_rows(n, ranks)
            assert len(parts) == ranks
            assert sorted(i for p in parts for i in p) == list(range(n))
            assert max(len(p) for p in parts) == -(-n // ranks)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two fleets start one after the other (~1 min on an idle machine)
@pytest.mark.parametrize(
    "stage,loss",
    [
        (0, {"algo": "grpo"}),
        (3, {"algo": "grpo", "norm": "sequence", "is_level": "sequence"}),
    ],
    ids=["zero0-token-norm", "zero3-sequence-norm-and-is"],
)
def test_two_ranks_step_equals_one_rank(tmp_path: Path, stage: int, loss: dict) -> None:
    """World size 2 vs 1 on the same batch (an odd number of rows: one rank is padded)."""
    results = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        spec = {
            "ds": {"zero_stage": stage, "lr": 1e-3, "micro_batch_rows": 1, "grad_clip": 0.0},
            "loss": loss,
            "samples": 4,
            "budget": 64,
            "ckpt": str(tmp_path / f"ckpt{world}"),
        }
        finish(launch("parity", out, spec, world), out)
        results[world] = torch.load(out, weights_only=False)
    one, two = results[1], results[2]
    assert one["rows"] % 2 == 1 and one["rows"] >= 3
    for key in ("loss/total", "loss/pg", "grad_norm", "tokens", "tokens_computed"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    assert two["metrics"]["ranks"] == 2
    # the whole gradient within 1e-5 relative; each tensor within 1e-4 of its own norm (a
    # tensor whose terms nearly cancel keeps only the noise of adding the ranks' partial sums,
    # which ZeRO-3 reduces after every micro-batch, in another order)
    assert one["grads"] and one["grads"].keys() == two["grads"].keys()
    flat = {
        w: torch.cat([r["grads"][k].flatten() for k in one["grads"]]) for w, r in results.items()
    }
    assert float((flat[2] - flat[1]).norm()) <= 1e-5 * float(flat[1].norm())
    for k, g in one["grads"].items():
        assert float((two["grads"][k] - g).norm()) <= 1e-4 * float(g.norm()) + 1e-12, k
    assert one["weights"].keys() == two["weights"].keys()
    for k in one["weights"]:  # Adam's first step is ~ lr * sign(g): same bound, scaled by lr
        torch.testing.assert_close(two["weights"][k], one["weights"][k], rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(a, b) for a, b in zip(one["before"], one["after"], strict=True))
    for r in results.values():  # the step's own log-probs, gathered from the ranks in row order
        assert len(r["kept"]) == len(r["before"]) == r["rows"]
        for k, b in zip(r["kept"], r["before"], strict=True):
            np.testing.assert_allclose(k, b, rtol=0, atol=1e-5)
    # every scored token of the batch was trained once: on one rank, or split over two
    alone = np.array(one["split"])[0]
    per_rank = np.array(two["split"])
    assert per_rank.sum(axis=0).tolist() == alone.tolist()
    assert all(r.sum() > 0 for r in per_rank)
    for a, b in zip(one["after"], two["after"], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert two["restored"] == {"version": 1} and two["round_trip"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("killed", [1, 0], ids=["follower-killed", "rank0-killed"])
def test_killing_a_rank_stops_the_other_without_a_half_commit(tmp_path: Path, killed: int) -> None:
    """SIGKILL one rank while rank 0 steps, commits and idles: the other exits with an error
    within seconds (no hang in a collective: the 120 s collective timeout is not what ends it)
    and ``latest`` still names a whole checkpoint."""
    out, ckpt = tmp_path / "loop", tmp_path / "ckpt"
    spec = {"ds": {"lr": 1e-3, "rank_timeout_s": 120}, "ckpt": str(ckpt)}
    procs = launch("loop", out, spec, 2)
    survivor = procs[1 - killed]
    try:
        step = Path(f"{out}.step")
        wait_until(lambda: step.exists() and int(step.read_text() or 0) >= 2, 600, "2 commits")
        procs[killed].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code = survivor.wait(100)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    log = Path(f"{out}.log{1 - killed}").read_text()
    assert code != 0, log[-2000:]
    assert "Connection closed by peer" in log or "Connection reset" in log, log[-2000:]
    if killed == 1:
        assert "FleetBroken" in log, log[-2000:]
    assert took < 100
    tag = (ckpt / "latest").read_text().strip()
    meta = json.loads((ckpt / tag / "client_state.json").read_text())
    assert meta["client_state"]["version"] >= 2
    if killed == 1:  # rank 0 wrote OUT.step after each commit and committed nothing after
        assert meta["client_state"]["version"] == int(step.read_text())
    assert not any(p.name.startswith("step-") and p.name > tag for p in ckpt.iterdir())


@pytest.mark.integration
def test_run_starts_the_learner_ranks_with_torchrun(tmp_path: Path) -> None:
    """``[run] learner_ranks = 2``: the learner child is ``torchrun --nproc-per-node 2 -m
    harnessrl.common.cli learner ...`` with its usual flags, given time to commit when stopped."""
    from harnessrl.common.run.plan import SECTIONS, Paths, Plan, display_command

    sections = {s: {} for s in SECTIONS}
    one = Plan(RunConfig(name="r1"), sections, Paths(tmp_path / "a"))
    two = Plan(RunConfig(name="r2", learner_ranks=2), sections, Paths(tmp_path / "b"))
    argv = two.learner_argv()
    shown = display_command(argv)
    assert shown.startswith("torchrun --standalone --nproc-per-node 2 --max-restarts 0 -m -- ")
    assert "harnessrl.common.cli learner --config" in shown
    tail = argv[argv.index("learner") + 1 :]
    assert tail[tail.index("--max-steps") + 1] == "20" and "--run-dir" in tail
    assert display_command(one.learner_argv()).startswith("harnessrl learner --config")
    spec = next(s for s in two.specs()["core"] if s.name == "learner")
    assert int(spec.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_learner_under_torchrun_trains_commits_and_stops(
    nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """``torchrun --nproc-per-node 2 -m harnessrl.learner.learner_cmd`` on a real nats-server: both
    ranks train every step, rank 0 commits and acks every sample once, SIGTERM stops both."""
    from harnessrl.common.bus import connect
    from harnessrl.common.layout import StepLine, read_metrics
    from harnessrl.learner.checkpoint import Checkpointer
    from tests.helpers.learner import grpo_group, publish, start_learner

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ckpt = Checkpointer(run_dir / "checkpoints")
    bus = await connect(nats_url, run_name)
    samples = grpo_group("a", [0, 1, 0.5, 0.25], 0) + grpo_group("b", [1, 0, 0, 1], 0)
    await publish(bus, samples)
    proc = start_learner(nats_url, run_name, run_dir, ranks=2)
    try:
        version = lambda: ckpt.read().version if ckpt.exists() else 0  # noqa: E731
        wait_until(lambda: version() >= 2, 600, "version 2", proc=proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)  # torchrun itself exits 1 after a signal, however its ranks ended
    finally:
        if proc.poll() is None:
            proc.kill()
    log = max((tmp_path).glob("learner-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert "forcefully exiting" not in log, log[-3000:]  # every rank stopped on SIGTERM
    state = ckpt.read()
    assert state.version == 2
    assert set(state.ledger["trained"]) == {s.rollout_id for s in samples}
    steps = [m for m in read_metrics(run_dir / "metrics.jsonl") if isinstance(m, StepLine)]
    assert [s.version for s in steps] == [1, 2]
    assert all(s.metrics["ranks"] == 2 and s.metrics["tokens_computed"] > 0 for s in steps)
    assert await bus.stream_count("SAMPLES") == 0
    await bus.close()
