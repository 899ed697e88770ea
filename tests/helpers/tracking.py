"""Experiment tracking test inputs and readers: a learner trained in process on synthetic
groups, and what Weights & Biases (its offline ``.wandb`` transaction log) and TensorBoard
(its event files) hold afterwards, read back with their own formats."""

from __future__ import annotations

import asyncio
import json
import struct
import uuid
from pathlib import Path
from typing import Any

from harnessrl.common.bus import Bus, connect
from harnessrl.learner.config import LearnerConfig
from harnessrl.learner.service import Learner
from tests.helpers.learner import synthetic_sample


def learner_config(tmp_path: Path, **kw: Any) -> LearnerConfig:
    base = {
        "model": "tiny-1m",
        "run": "trk",
        "run_dir": str(tmp_path / "run"),
        "metrics_port": -1,
        "group_size": 2,
        "batch_groups": 1,
        "checkpoint_every": 1,
        "feeder": {"enabled": False},
        "broadcast": {"transport": "none"},
        "pack": {"max_tokens": 128},
    }
    return LearnerConfig.model_validate({**base, **kw})


async def publish_groups(bus: Bus, n: int, tag: str) -> None:
    """``n`` trainable groups of 2, and one held-out (eval) sample with each."""
    samples = []
    for i in range(n):
        for k, reward in enumerate((0.0, 1.0)):
            samples.append(synthetic_sample(f"{tag}g{i}", k, reward=reward, group_size=2))
        ev = synthetic_sample(f"{tag}e{i}", 0, reward=0.5 * (i % 2), group_size=1, is_eval=True)
        ev.suite = "toy-eval"
        samples.append(ev)
    await bus.publish_many([(bus.subjects.samples, s, s.msg_id()) for s in samples])


async def train(cfg: LearnerConfig, groups: int) -> Learner:
    """Train ``cfg`` on ``groups`` fresh groups (and eval samples) until its ``max_steps``."""
    bus = await connect(f"memory://{uuid.uuid4().hex}", "trk")
    try:
        await publish_groups(bus, groups, tag=uuid.uuid4().hex[:6])
        learner = Learner(cfg, bus)
        assert await asyncio.wait_for(learner.run(), 240) == 0
        return learner
    finally:
        await bus.close()


def wandb_records(folder: Path) -> list[Any]:
    """The records of every offline W&B run under ``folder``, in order (W&B's transaction log:
    a 7-byte file header, then records in 32 KiB blocks, each a 7-byte header (crc, length,
    type: full, first, middle or last part) and a piece of a ``Record`` protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, buf = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if (left := 32768 - pos % 32768) < 7:
                pos += left
                continue
            _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
            buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
            if kind in (1, 4):  # a full record, or the last part of one
                record = pb.Record()
                record.ParseFromString(buf)
                out.append(record)
                buf = b""
    return out


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def wandb_config(records: list[Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        items = (
            r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        )
        config.update({i.key: json.loads(i.value_json) for i in items})
    return config


def tensorboard_events(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc
