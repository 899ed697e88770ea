"""Sampling of the embedded engine: truncation (top-k, top-p, min-p) and one token per row.

Log-probs
---------
float32 log-probabilities of each sampled token under the distribution it was drawn from:
``log_softmax(truncate(logits / temperature))`` where ``truncate`` applies ``top_k``, then
``top_p``, then ``min_p`` (truncated tokens get probability 0 and the rest is renormalised; such
replies say ``logprobs_truncated: true``). ``temperature == 0`` is greedy and reports the
log-prob under the untruncated ``T = 1`` distribution (the policy's own log-prob, which is what an
importance ratio against the learner needs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from harnessrl.proxy.engine.requests import SamplingParams

# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def truncate_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p per row of temperature-scaled logits (-inf = cut)."""
    vocab = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        vals = x.topk(max(ks), dim=-1).values
        kth = torch.tensor([vals[i, k - 1] if k else -math.inf for i, k in enumerate(ks)])
        x = x.masked_fill(x < kth[:, None], -math.inf)
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in params])
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        cut = (probs.cumsum(-1) - probs) > top_p[:, None]
        x = x.masked_fill(cut.scatter(1, order, cut), -math.inf)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params])
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, -math.inf)
    return x


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]
) -> tuple[list[int], list[float]]:
    """Draw one token per row; return the tokens and their float32 log-probs (see module doc).

    ``uniforms[i]`` in [0, 1) drives row i (inverse-CDF sampling, so a seeded request is
    reproducible whatever else is in the batch).
    """
    logits = logits.float()
    rows = logits.shape[0]
    tokens = [0] * rows
    logps = [0.0] * rows
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy:
        lg = logits[greedy]
        lp = torch.log_softmax(lg, -1)
        tok = lg.argmax(-1)
        got = lp.gather(1, tok[:, None])[:, 0]
        for j, i in enumerate(greedy):
            tokens[i], logps[i] = int(tok[j]), float(got[j])
    rest = [i for i, p in enumerate(params) if p.temperature > 0]
    if rest:
        temps = torch.tensor([params[i].temperature for i in rest], dtype=torch.float32)
        x = truncate_logits(logits[rest] / temps[:, None], [params[i] for i in rest])
        lp = torch.log_softmax(x, -1)
        cdf = lp.double().exp().cumsum(-1)
        u = torch.tensor([uniforms[i] for i in rest], dtype=torch.float64)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        tok = tok.clamp(max=x.shape[-1] - 1)
        got = lp.gather(1, tok[:, None])[:, 0]
        for j, i in enumerate(rest):
            tokens[i], logps[i] = int(tok[j]), float(got[j])
    return tokens, logps
