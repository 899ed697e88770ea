"""Config models of the learner-side processes (every field documented and bounded)."""

from __future__ import annotations

from pydantic import Field

from common.config import ServiceConfig


class AssemblerConfig(ServiceConfig):
    """``harnessrl assembler``: RolloutResults + CallRecords -> TreeSamples."""

    max_branches: int = Field(64, ge=1, le=100_000)
    """Discard a rollout whose retained leaves (root-to-leaf branches) exceed this."""
    straggler_wait_s: float = Field(10.0, ge=0, le=600)
    """How long to keep re-reading a rollout's calls while fewer than ``n_calls`` are present,
    before giving up with a ``missing_calls`` tombstone."""
    straggler_poll_s: float = Field(0.25, gt=0, le=10)
    """Interval between re-reads while waiting for straggler calls."""
    export_side_calls: bool = False
    """Keep ``subagent``/``compaction``/``aux`` calls as extra roots of the sample (trained on,
    with the rollout's reward) instead of dropping them."""
    ack_wait: float = Field(60.0, ge=1, le=3600)
    """Seconds a RolloutResult may stay unacknowledged (heartbeats extend it while working)
    before JetStream redelivers it, e.g. to a restarted assembler."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Rollouts assembled at the same time (mostly waiting on the bus)."""
    max_part_bytes: int = Field(6 * 1024 * 1024, ge=16 * 1024, le=64 * 1024 * 1024)
    """A sample whose encoding exceeds this is split into parts (``sample:<rid>:<part>``);
    keep it below the nats-server ``max_payload``."""
    remember: int = Field(100_000, ge=0, le=10_000_000)
    """Recently finished rollout ids kept in memory so a duplicate result is acked at once
    (after a restart, JetStream's msg-id de-duplication still prevents duplicate samples)."""
