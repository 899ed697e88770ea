"""Learner checkpoints: DeepSpeed state + the learner's own state, committed atomically.

Layout of a checkpoint folder::

    latest                  # name of the newest DeepSpeed checkpoint (atomic replace)
    step-000000012/         # DeepSpeed state + client_state.json (``LearnerEngine``)
    learner-state.json      # newest learner state for that DeepSpeed checkpoint (atomic replace)

A *full* commit writes a DeepSpeed checkpoint whose client state is the learner state
(``LearnerEngine.save_checkpoint``: temp dir + rename, then ``latest``), then
``learner-state.json``. A *state-only* commit rewrites ``learner-state.json`` alone; it is used
when no optimiser step happened since the last full commit (e.g. samples dropped while the
learner waits for data), so the weights on disk already match the state it records.

Loading picks ``latest``'s client state, or ``learner-state.json`` when it names the same
DeepSpeed checkpoint with a newer commit sequence. A crash between the two writes of a full
commit therefore falls back to the client state stored with the weights: never a state newer
or older than the weights it is loaded with.

The learner state (``LearnerState``) holds the version counter, the ledger of rollout outcomes
(trained ids with their version, dropped ids with their reason, closed groups), the feeder's
counters and open groups, and the weight versions whose broadcast data may still be stored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "learner-state.json"


@dataclass
class LearnerState:
    """Everything besides weights and optimiser that a restarted learner needs."""

    version: int = 0
    """Policy version (optimiser steps taken by this lineage)."""
    seq: int = 0
    """Commit sequence number (increases with every commit, full or state-only)."""
    ds_tag: str = ""
    """DeepSpeed checkpoint this state belongs to."""
    ledger: dict[str, Any] = field(default_factory=dict)
    """``batching.Ledger.state()``."""
    feeder: dict[str, Any] = field(default_factory=dict)
    """``feeder.Feeder.state()``."""
    broadcast: dict[str, Any] = field(default_factory=dict)
    """Weight publisher state (versions whose data may still be stored)."""
    totals: dict[str, float] = field(default_factory=dict)
    """Cumulative counters carried across restarts (wall/idle seconds, samples, tokens)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LearnerState:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class Checkpointer:
    """Commits and restores ``LearnerState`` beside a ``LearnerEngine``'s DeepSpeed state."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def exists(self) -> bool:
        return (self.root / "latest").exists()

    def latest_tag(self) -> str | None:
        p = self.root / "latest"
        return p.read_text().strip() if p.exists() else None

    def save(self, engine: Any, state: LearnerState) -> LearnerState:
        """Full commit: DeepSpeed state with ``state`` as client state, then the state file."""
        state.seq += 1
        state.ds_tag = ""
        path = engine.save_checkpoint(self.root, state.to_json(), keep=self.keep)
        state.ds_tag = Path(path).name
        _write_json_atomic(self.root / STATE_FILE, state.to_json())
        return state

    def save_state(self, state: LearnerState) -> LearnerState:
        """State-only commit; ``state.ds_tag`` must be the current DeepSpeed checkpoint."""
        tag = self.latest_tag()
        if tag is None or state.ds_tag != tag:
            raise RuntimeError(
                f"state-only commit for {state.ds_tag!r} but the latest checkpoint is {tag!r}"
            )
        state.seq += 1
        _write_json_atomic(self.root / STATE_FILE, state.to_json())
        return state

    def load(self, engine: Any) -> LearnerState | None:
        """Restore the DeepSpeed state into ``engine``; return the matching learner state."""
        if not self.exists():
            return None
        client = engine.load_checkpoint(self.root)
        if client is None:
            return None
        return self._pick(client, self.latest_tag() or "")

    def read(self) -> LearnerState | None:
        """The learner state of the latest checkpoint, without loading weights (tools, tests)."""
        tag = self.latest_tag()
        if tag is None:
            return None
        meta = json.loads((self.root / tag / "client_state.json").read_text())
        return self._pick(meta["client_state"], tag)

    def _pick(self, client: dict[str, Any], tag: str) -> LearnerState:
        state = LearnerState.from_json(client)
        state.ds_tag = tag
        f = self.root / STATE_FILE
        if f.exists():
            newer = LearnerState.from_json(json.loads(f.read_text()))
            if newer.ds_tag == tag and newer.seq >= state.seq:
                return newer
        return state


def _write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
