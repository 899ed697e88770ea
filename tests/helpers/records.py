"""Sample wire records for tests of the records and the bus."""

from __future__ import annotations

from harnessrl.common import records as r


def sample_records() -> list[r.Record]:
    """One record of each type, with every kind of field set (ids, floats, nested nodes)."""
    ids = list(range(100, 2100))
    return [
        r.TaskRequest(group_id="g-1", k=2, group_size=4, issued_version=7, task_id="toy/read-1"),
        r.CallRecord(
            rollout_id="g-1-2-1",
            seq=3,
            parent_seq=2,
            prefix_len=1500,
            suffix_ids=r.pack_ids(ids[1500:]),
            input_len=2000,
            input_hash=r.ids_hash(ids),
            output_ids=r.pack_ids([5, 6, 7]),
            output_logprobs=r.pack_f32([-0.1, -0.2, -0.3]),
            finish_reason="stop",
            weight_version_start=3,
            weight_version_end=4,
            requested={"temperature": 0.2, "max_tokens": 99},
        ),
        r.RolloutResult(
            rollout_id="g-1-2-1",
            task_id="toy/read-1",
            group_id="g-1",
            k=2,
            attempt=1,
            issued_version=7,
            status="timeout",
            reward=0.0,
            metrics={"file_exists": 1.0},
        ),
        r.TreeSample(
            rollout_id="g-1-2-1",
            group_id="g-1",
            k=2,
            nodes=[
                r.TreeNode(
                    parent=-1, token_ids=r.pack_ids([1, 2, 3]), loss_mask=r.pack_u8([0, 0, 0])
                ),
                r.TreeNode(
                    parent=0,
                    token_ids=r.pack_ids([4]),
                    logprobs=r.pack_f32([-0.5]),
                    loss_mask=r.pack_u8([1]),
                    weight_version=4,
                ),
            ],
            counters=r.TreeCounters(
                n_calls=1, n_leaves=1, unique_tokens=4, dropped={"dead_leaf": 1}
            ),
        ),
        r.TreeSample(rollout_id="g-1-3-1", group_id="g-1", k=3, dropped_reason="bad_delta"),
        r.WeightsReady(version=5, n_chunks=2, total_bytes=10, digest="ab"),
        r.WeightChunk(version=5, index=1, n_chunks=2, data=b"\x00" * 10),
        r.DeadLetter(stream="S", subject="x", seq=1, consumer="c", reason="bad", data=b"junk"),
    ]
