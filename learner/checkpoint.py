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
The layout, ``LearnerState`` and the reader live in ``harnessrl.common.layout`` (``harnessrl run`` reads
the committed version without torch); this module commits and restores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harnessrl.common.files import atomic_write_json
from harnessrl.common.layout import (
    LATEST,
    STATE_FILE,
    LearnerState,
    latest_checkpoint,
    pick_learner_state,
    read_learner_state,
)

__all__ = ["STATE_FILE", "Checkpointer", "LearnerState"]


class Checkpointer:
    """Commits and restores ``LearnerState`` beside a ``LearnerEngine``'s DeepSpeed state."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def exists(self) -> bool:
        return (self.root / LATEST).exists()

    def latest_tag(self) -> str | None:
        return latest_checkpoint(self.root)

    def save(self, engine: Any, state: LearnerState) -> LearnerState:
        """Full commit: DeepSpeed state with ``state`` as client state, then the state file."""
        state.seq += 1
        state.ds_tag = ""
        path = engine.save_checkpoint(self.root, state.to_json(), keep=self.keep)
        state.ds_tag = Path(path).name
        atomic_write_json(self.root / STATE_FILE, state.to_json(), fsync=True)
        return state

    def save_state(self, state: LearnerState) -> LearnerState:
        """State-only commit; ``state.ds_tag`` must be the current DeepSpeed checkpoint."""
        tag = self.latest_tag()
        if tag is None or state.ds_tag != tag:
            raise RuntimeError(
                f"state-only commit for {state.ds_tag!r} but the latest checkpoint is {tag!r}"
            )
        state.seq += 1
        atomic_write_json(self.root / STATE_FILE, state.to_json(), fsync=True)
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
        return read_learner_state(self.root)

    def _pick(self, client: dict[str, Any], tag: str) -> LearnerState:
        return pick_learner_state(self.root, client, tag)
