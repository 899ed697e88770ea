"""The LM head runs in float32 for a bf16 model, in the learner's policy (and, through the same
helper, the embedded engine): its logits are those of the bf16 hidden state and weights upcast,
not a bf16 matmul's output rounded to bf16."""

from __future__ import annotations

import pytest
import torch

from harnessrl.common.models.head import lm_logits
from harnessrl.learner.policy import load_policy

pytestmark = pytest.mark.unit


def test_lm_logits_is_the_fp32_product_of_bf16_operands() -> None:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(16, 64, generator=g) * 4).to(torch.bfloat16)
    w = (torch.randn(1000, 64, generator=g) * 0.6).to(torch.bfloat16)
    want = h.float() @ w.float().T
    got = lm_logits(h, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert (h @ w.T).float().sub(want).abs().max() > 0.01  # what a bf16 head would give
    x = torch.randn(3, 8, generator=g)
    y = torch.randn(5, 8, generator=g)
    torch.testing.assert_close(lm_logits(x, y), x @ y.T)  # fp32 unchanged


def test_a_bf16_policy_takes_log_probs_from_fp32_logits() -> None:
    """Logits of 8-32 (a sharp head): the policy's log-probs equal those of the fp32 product of
    its bf16 hidden state and head (to float32 noise); a bf16 head is off by more than 0.01."""
    policy = load_policy("tiny-1m", attn_implementation="sdpa")
    with torch.no_grad():
        policy.lm.get_output_embeddings().weight.mul_(40.0)
    policy = policy.to(torch.bfloat16)
    ids = torch.tensor([[5, 17, 230, 4000, 12, 99, 7, 31]])
    pos = torch.arange(8)[None]
    src, tgt = torch.arange(7), ids[0, 1:]
    with torch.no_grad():
        out = policy(ids, pos, None, src, tgt)
        hidden = policy.lm.base_model(input_ids=ids, position_ids=pos).last_hidden_state[0, src]
        w = policy.lm.get_output_embeddings().weight
        fp32 = torch.log_softmax(hidden.float() @ w.float().T, -1).gather(-1, tgt[:, None])[:, 0]
        bf16 = torch.log_softmax((hidden @ w.T).float(), -1).gather(-1, tgt[:, None])[:, 0]
    logits = hidden.float() @ w.float().T
    assert float(logits.abs().max()) > 8.0  # the regime where bf16 rounding matters
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, fp32, rtol=0, atol=1e-4)
    assert float((bf16 - fp32).abs().max()) > 0.01
    assert pytest.approx(0.0, abs=1e-4) == float((out.logprobs - fp32).abs().max())
