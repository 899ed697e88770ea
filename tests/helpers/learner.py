"""Learner test inputs: synthetic tree samples over the tiny vocabulary, GRPO groups of them,
publishing them, and ``harnessrl learner`` as a child process (one rank or under torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harnessrl.common.bus import Bus
from harnessrl.common.procs import popen_child
from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 8192


def synthetic_sample(
    group_id: str,
    k: int,
    *,
    reward: float = 0.0,
    group_size: int = 4,
    attempt: int = 1,
    weight_version: int = 0,
    tombstone: str = "",
    seed: int | None = None,
    tokens: int = 12,
    is_eval: bool = False,
) -> TreeSample:
    """A small random tree over the tiny vocabulary: a prompt, then 1-3 model/env branches."""
    rng = np.random.default_rng(seed if seed is not None else hash((group_id, k, attempt)) % 2**32)
    rid = f"{group_id}-{k}-{attempt}"
    common = {
        "rollout_id": rid,
        "group_id": group_id,
        "k": k,
        "attempt": attempt,
        "group_size": group_size,
        "reward": reward,
        "task_id": "synthetic",
        "harness": "reference",
        "is_eval": is_eval,
    }
    if tombstone:
        return TreeSample(**common, dropped_reason=tombstone)
    nodes = [TreeNode(parent=-1, token_ids=pack_ids(rng.integers(3, VOCAB, tokens)))]
    for _ in range(int(rng.integers(1, 4))):
        parent = int(rng.integers(0, len(nodes)))
        for is_model in (True, False):
            m = int(rng.integers(2, 6))
            nodes.append(
                TreeNode(
                    parent=parent,
                    token_ids=pack_ids(rng.integers(3, VOCAB, m)),
                    logprobs=pack_f32(rng.uniform(-9.5, -8.5, m) if is_model else np.zeros(m)),
                    loss_mask=pack_u8(np.full(m, int(is_model))),
                    weight_version=weight_version if is_model else -1,
                )
            )
            parent = len(nodes) - 1
    return TreeSample(**common, weight_version=weight_version, nodes=nodes)


def start_learner(
    nats_url: str, run: str, run_dir: Path, *extra: str, ranks: int = 1
) -> subprocess.Popen:
    """``harnessrl learner`` on the test's samples; with ``ranks`` > 1 under torchrun."""
    argv = [
        sys.executable, "-m", "harnessrl.learner.learner_cmd",
        "--nats", nats_url, "--run", run, "--model", "tiny-1m", "--algo", "grpo",
        "--no-feeder.enabled", "--group-size", "4", "--min-group-size", "2",
        "--batch-groups", "1", "--max-staleness", "2", "--run-dir", str(run_dir),
        "--checkpoint-every", "1", "--ack-wait", "4", "--metrics-port", "-1",
        "--pack.max-tokens", "256", "--ds.lr", "1e-4", "--log-level", "warning", "--threads", "1",
        *extra,
    ]  # fmt: skip
    if ranks > 1:
        argv[1:2] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     str(ranks), "--max-restarts", "0", "-m", "--"]  # fmt: skip
    log = open(run_dir.parent / f"learner-{time.time():.0f}.log", "a")  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return popen_child(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def grpo_group(gid: str, rewards: list[float], version: int, **kw) -> list:
    """One synthetic sample per reward, a group of ``len(rewards)`` made at ``version``."""
    return [
        synthetic_sample(gid, k, reward=r, group_size=len(rewards), weight_version=version, **kw)
        for k, r in enumerate(rewards)
    ]


async def publish(bus: Bus, samples: list) -> None:
    """Publish samples as the assembler does (on the samples subject, by message id)."""
    await bus.publish_many([(bus.subjects.samples, s, s.msg_id()) for s in samples])


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests (import it into the module: it is autouse).
    Tiny models gain nothing from intra-op threads; on a shared CPU they spin at barriers
    (10x slower under load)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
