"""Learning through a real harness, on a fixed recorded batch: the learner steps on GRPO groups
recorded live through the unmodified mini-swe-agent, and the held-out log-prob of the teacher's
answers rises; the same steps with the advantage's sign flipped make it fall.

Both fixtures are ``harnessrl teacher-data --harness mini-swe-agent --model tiny-agent --split
eval`` output, gzipped: ``mini_swe_agent_teacher`` with the scripted teacher behind the proxy
(every task solved), ``mini_swe_agent_tiny_agent`` with ``--engine URL`` of ``harnessrl engine
--model tiny-agent`` (the shipped warm start's own attempts: it was never taught mini-swe-agent's
``bash`` tool, and fails every task). Every conversation's tokens are those mini-swe-agent 2.4.6
sent and received through the proxy — its system prompt, tool schema, format-error retries and
tool-result wrapping — assembled into a prefix tree, as the learner gets them.

A group is one ``toy-eval`` task of the first kind (``*_eval01``): the teacher's solution
(reward 1) and the warm start's attempt (reward 0), so GRPO's advantage is + for the first and -
for the second. Held out: the teacher solving the other task of each family (``*_eval02``).
Behaviour log-probs are the policy's own (the scripted teacher has none), so each step is
on-policy and its IS weights are 1.

Not a live asynchronous run: no harness starts here; the harness's part is in the recorded
tokens. A live run is what ``harnessrl demo --harness mini-swe-agent`` does.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import TreeSample
from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
from harnessrl.learner.losses import LossConfig, group_advantages
from harnessrl.learner.packing import PackConfig, pack
from harnessrl.learner.pretrain import as_sample, encode_file
from tests.helpers.learner import one_torch_thread  # noqa: F401  (autouse)

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "teacher"
MODEL = "tiny-agent"
STEPS = 2
BUDGET = 4608  # tokens per packed row: a teacher conversation ~1.3k, a warm start's ~4.2k


def conversations(name: str, tmp_path: Path) -> tuple[list[dict], list[TreeSample]]:
    """The records of ``fixtures/teacher/<name>.jsonl.gz`` and their tree samples (group: the
    task; reward: the record's)."""
    text = gzip.decompress((FIXTURES / f"{name}.jsonl.gz").read_bytes())
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(text)
    records = [json.loads(line) for line in text.decode().splitlines() if line.strip()]
    encoded = encode_file(load_tokenizer(MODEL), path)
    samples = []
    for rec, enc in zip(records, encoded, strict=True):
        s = as_sample(enc, f"{name}-{rec['task']}")
        s.group_id, s.reward, s.harness = rec["task"], float(rec["reward"]), rec["harness"]
        samples.append(s)
    return records, samples


def fixtures(tmp_path: Path) -> tuple[list[TreeSample], list[TreeSample], list[dict]]:
    """Train groups (teacher and warm start on each ``*_eval01`` task), the held-out teacher
    samples (``*_eval02``), and every record."""
    teacher_recs, teacher = conversations("mini_swe_agent_teacher", tmp_path)
    policy_recs, policy = conversations("mini_swe_agent_tiny_agent", tmp_path)
    for k, s in enumerate(policy):
        s.k = 1 + k
    train = [s for s in teacher + policy if s.group_id.endswith("_eval01")]
    held = [s for s in teacher if s.group_id.endswith("_eval02")]
    return train, held, teacher_recs + policy_recs


def rows(samples: list[TreeSample], sign: float = 1.0):
    adv, _ = group_advantages([s.group_id for s in samples], [s.reward for s in samples])
    return pack(samples, PackConfig(max_tokens=BUDGET), advantages=adv * sign).rows


def mean_logp(engine: LearnerEngine, held_out) -> float:
    """Mean log-prob of the teacher's tokens (the scored ones) of the held-out conversations."""
    lps = engine.logprobs(held_out)
    scored = np.concatenate([lp[r.loss_mask > 0] for lp, r in zip(lps, held_out, strict=True)])
    return float(scored.mean())


def train(batch, held_out, steps: int = STEPS) -> tuple[float, float]:
    """Held-out mean log-prob before and after ``steps`` on-policy GRPO steps on ``batch``."""
    cfg = DeepSpeedConfig(zero_stage=0, lr=1e-4, micro_batch_rows=4, grad_clip=1.0, seed=0)
    engine = LearnerEngine(MODEL, cfg, LossConfig(algo="grpo"))
    before = mean_logp(engine, held_out)
    for version in range(steps):
        for r, lp in zip(batch, engine.logprobs(batch), strict=True):
            r.rollout_logp = lp.astype(np.float32)  # on-policy: the teacher has no log-probs
        m = engine.train_step(batch, version=version)
        assert np.isfinite(m["loss/total"]) and m["skipped"] == 0.0, m
    return before, mean_logp(engine, held_out)


def test_the_fixtures_are_real_harness_conversations(tmp_path: Path) -> None:
    """What the test below learns from: mini-swe-agent's own tokens, exact, in groups whose
    rewards differ."""
    train, held, records = fixtures(tmp_path)
    for rec in records:
        assert rec["harness"] == "mini-swe-agent" and rec["harness_version"] == "2.4.6"
        assert rec["tito_misses"] == 0 and rec["false_forks"] == 0 and rec["n_calls"] >= 2
        assert rec["unique_tokens"] > 1000  # the harness's own system prompt and tool schema
    assert all(s.reward == 1.0 for s in held) and len(held) == 20
    assert not {s.group_id for s in train} & {s.group_id for s in held}
    adv, flat = group_advantages([s.group_id for s in train], [s.reward for s in train])
    assert not flat and (adv > 0).sum() == (adv < 0).sum() == 20


def test_grpo_on_recorded_groups_raises_the_held_out_log_prob_and_a_flipped_sign_lowers_it(
    tmp_path: Path,
) -> None:
    train_samples, held, _ = fixtures(tmp_path)
    held_out = pack(held, PackConfig(max_tokens=BUDGET)).rows

    before, after = train(rows(train_samples), held_out)
    assert after > before + 0.3, (before, after)

    before_f, after_f = train(rows(train_samples, sign=-1.0), held_out)
    assert before_f == pytest.approx(before, abs=1e-5)  # the same warm start
    assert after_f < before_f - 0.3, (before_f, after_f)
