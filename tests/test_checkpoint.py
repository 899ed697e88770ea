"""Checkpoint commits: full and state-only commits, and which state a crash leaves loadable.

The engine here is a stand-in with ``LearnerEngine``'s checkpoint contract (atomic step folder
with ``client_state.json``, then ``latest``); the real DeepSpeed round trip runs in
``test_learner_service``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harnessrl.learner.batching import Ledger
from harnessrl.learner.checkpoint import STATE_FILE, Checkpointer, LearnerState

pytestmark = pytest.mark.unit


class FakeEngine:
    """Checkpoints like ``LearnerEngine.save_checkpoint``/``load_checkpoint``, no weights."""

    def __init__(self) -> None:
        self.global_steps = 0
        self.loaded: str | None = None

    def save_checkpoint(self, root: Path, client_state: dict[str, Any], *, keep: int = 2) -> Path:
        tag = f"step-{self.global_steps:09d}"
        tmp, final = root / f".tmp-{tag}", root / tag
        tmp.mkdir(parents=True)
        meta = {"tag": tag, "global_steps": self.global_steps, "client_state": client_state}
        (tmp / "client_state.json").write_text(json.dumps(meta))
        os.rename(tmp, final)
        (root / "latest").write_text(tag)
        return final

    def load_checkpoint(self, root: Path) -> dict[str, Any] | None:
        tag = (root / "latest").read_text()
        self.loaded = tag
        return json.loads((root / tag / "client_state.json").read_text())["client_state"]


def state(version: int, dropped: dict[str, str] | None = None) -> LearnerState:
    led = Ledger()
    led.train([f"g{version}-0-1"], version, [])
    for rid, why in (dropped or {}).items():
        led.drop(rid, why)
    return LearnerState(version=version, ledger=led.state(), feeder={"next_group": version})


def test_full_commit_round_trip(tmp_path: Path) -> None:
    ck, eng = Checkpointer(tmp_path), FakeEngine()
    assert ck.read() is None and not ck.exists()
    eng.global_steps = 3
    ck.save(eng, state(3))
    got = ck.load(FakeEngine())
    assert got is not None and got.version == 3 and got.ds_tag == "step-000000003"
    assert Ledger.from_state(got.ledger).outcome("g3-0-1") == "trained"


def test_state_only_commit_is_picked_for_the_same_weights(tmp_path: Path) -> None:
    """Drops committed without a step land in the state file and win on load."""
    ck, eng = Checkpointer(tmp_path), FakeEngine()
    eng.global_steps = 1
    st = ck.save(eng, state(1))
    st.ledger = state(1, {"x-0-1": "stale"}).ledger
    ck.save_state(st)
    got = ck.read()
    assert got is not None and got.seq == 2
    assert Ledger.from_state(got.ledger).outcome("x-0-1") == "stale"


def test_state_only_commit_refuses_other_weights(tmp_path: Path) -> None:
    ck, eng = Checkpointer(tmp_path), FakeEngine()
    eng.global_steps = 1
    st = ck.save(eng, state(1))
    eng.global_steps = 2
    ck.save(eng, state(2))
    with pytest.raises(RuntimeError, match="state-only commit"):
        ck.save_state(st)


def test_crash_between_weights_and_state_file_uses_weights_state(tmp_path: Path) -> None:
    """A full commit interrupted after the DeepSpeed folder + latest but before the state
    file: the state stored with the weights is used, never the older state file."""
    ck, eng = Checkpointer(tmp_path), FakeEngine()
    eng.global_steps = 1
    ck.save(eng, state(1, {"a-0-1": "stale"}))
    eng.global_steps = 2
    st2 = state(2)
    st2.seq = 5
    eng.save_checkpoint(tmp_path, st2.to_json())  # ... and the process dies here
    got = ck.read()
    assert got is not None and got.version == 2 and got.ds_tag == "step-000000002"
    assert json.loads((tmp_path / STATE_FILE).read_text())["version"] == 1


def test_ledger_state_round_trip_and_bound() -> None:
    led = Ledger(remember=1000)
    led.train([f"r{i}-0-1" for i in range(1500)], 7, [])
    led.drop("d-0-1", "zero_variance")
    led.close_group("g")
    back = Ledger.from_state(json.loads(json.dumps(led.state())), remember=1000)
    assert len(back.trained) == 1000 and back.outcome("r1499-0-1") == "trained"
    assert back.outcome("r0-0-1") is None  # forgotten: the oldest beyond ``remember``
    assert back.n_trained == 1500 and back.counts["zero_variance"] == 1 and "g" in back.closed
    assert back.committed("d-0-1")
