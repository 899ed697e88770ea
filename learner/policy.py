"""The policy on packed rows: a Hugging Face causal LM (+ optional value head) -> per-target
log-probs, entropies and values.

``Policy.forward`` runs the LM's decoder once over ``[B,T]`` packed rows (depth position ids,
tree mask, ``use_cache=False``), gathers the last hidden state at each target's *source*
position (a position with several children is gathered once per child), and only then applies
the LM head. Log-probs and entropies are of the temperature-scaled distribution
``softmax(logits / temperature)``: per target, the temperature its sample was drawn at (the
batch's ``target_temp``, from the temperature the proxy recorded in every CallRecord), so they
are comparable with the rollout log-probs; without it, the policy's own ``temperature``. The
head runs in float32 whatever the model's dtype (``common.models.head``: a bf16 head rounds
logits of 8-32 by up to 0.06, which every log-prob inherits).

Value head (PPO): a zero-initialised ``Linear(hidden, 1)`` on the same last hidden state, at the
same source position as the token's log-prob, so ``V(t)`` is the value of the state *before*
token ``t`` is sampled; with ``baseline_src`` also at the state each target's turn started
from (the baseline of ``value_baseline = "turn"``). It shares the trunk with the policy (one
forward for both; the value loss's gradient reaches the trunk, weighted by ``value_coef``). A separate critic is the same
class built around a second LM whose log-probs are ignored. Zero init makes the first advantages
``R - 0 = R``. The head is not part of the weights broadcast to engines.

Attention kernels for the tree mask (``load_policy(attn_implementation=...)``):

* ``tree_sdpa`` (CPU default, registered here with transformers' ``AttentionInterface``):
  block-sparse sdpa over the dense float mask. A dense mask makes every kernel pay for all
  ``T^2`` pairs; a tree row hides the upper triangle and every sibling branch, and this skips
  key blocks that are hidden entirely (exact).
* ``sdpa`` / ``eager``: transformers' own kernels on the dense float mask (all pairs computed).
* ``flex_attention`` (CUDA): a FlexAttention ``BlockMask`` from ``packing.flex_tree_mask``.

Memory: the LM head output is ``[N_targets, vocab]`` fp32 (with its softmax kept for backward);
only scored targets are projected, not every position.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from harnessrl.common.models import load_model
from harnessrl.common.models.head import lm_logits

TREE_SDPA = "tree_sdpa"
"""``attn_implementation`` name of the block-sparse tree attention below (CPU default)."""
TREE_BLOCK = 128
"""Query/key block size of ``tree_sdpa``."""


class PolicyOutput(NamedTuple):
    logprobs: torch.Tensor
    """[N] log pi(target | path) under ``softmax(logits / temperature)``."""
    entropy: torch.Tensor
    """[N] entropy of that distribution at the target's source position."""
    values: torch.Tensor | None
    """[N] value head output at the source position (None without a value head)."""
    baselines: torch.Tensor | None = None
    """[N] value head output at ``baseline_src`` (the state the target's turn started from);
    None without a value head or ``baseline_src``."""


class Policy(nn.Module):
    """A causal LM evaluated on packed rows, with an optional value head."""

    def __init__(self, lm: nn.Module, *, temperature: float = 1.0, value_head: bool = False):
        super().__init__()
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy sampling has no log-probs to match)")
        self.lm = lm
        self.temperature = float(temperature)
        # Backpropagate through the entropy only for an entropy bonus: it costs another
        # [N, vocab] pass in backward, so by default entropy is a detached metric.
        self.entropy_grad = False
        self.value_head: nn.Linear | None = None
        if value_head:
            hidden = lm.config.get_text_config().hidden_size
            head = nn.Linear(hidden, 1, dtype=next(lm.parameters()).dtype)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
            self.value_head = head

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Any,
        target_src: torch.Tensor,
        target_ids: torch.Tensor,
        baseline_src: torch.Tensor | None = None,
        target_temp: torch.Tensor | None = None,
    ) -> PolicyOutput:
        out = self.lm.base_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
        )
        flat = out.last_hidden_state.flatten(0, 1)
        hidden = flat[target_src]
        head = self.lm.get_output_embeddings()
        logits = lm_logits(hidden, head.weight, head.bias)  # fp32 even for a bf16 model
        if target_temp is not None and bool((target_temp != 1.0).any()):
            # each target at its sample's sampling temperature
            logits = logits / target_temp.to(logits.dtype)[:, None]
        elif target_temp is None and self.temperature != 1.0:
            logits = logits / self.temperature  # x / 1.0 == x: skip a [N, vocab] pass
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, target_ids[:, None])[:, 0]
        with torch.set_grad_enabled(self.entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        values = baselines = None
        if self.value_head is not None:
            values = self.value_head(hidden)[:, 0].float()
            if baseline_src is not None:
                baselines = self.value_head(flat[baseline_src])[:, 0].float()
        return PolicyOutput(logp, entropy, values, baselines)


# ---------------------------------------------------------------------------------------------
# block-sparse tree attention (CPU): skip key blocks the tree mask hides entirely
# ---------------------------------------------------------------------------------------------


def tree_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa with a dense tree mask, computed only where the mask allows something.

    A dense ``[T, T]`` mask makes plain sdpa pay for every pair, although a tree row hides the
    upper triangle and every sibling branch. Per query block of ``TREE_BLOCK`` positions, only
    the key blocks holding an allowed entry are gathered; blocks with similar key counts are
    batched into one sdpa call (padded keys masked). One gather per tensor and row keeps the
    backward to a single scatter. FlexAttention's block sparsity, on CPU; exact, since skipped
    blocks would contribute ``exp(-inf) = 0``. Other masks fall back to transformers' sdpa.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype == torch.bool:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    h, d = query.shape[1], query.shape[3]
    rows = []
    for i, plan in enumerate(_block_plan(attention_mask)):
        q_all = query[i].index_select(1, plan.q_index)
        k_all = key[i].index_select(1, plan.k_index)
        v_all = value[i].index_select(1, plan.k_index)
        outs = []
        for (g, nq, nk), q, k, v, m in zip(
            plan.shapes,
            q_all.split(plan.q_sizes, dim=1),
            k_all.split(plan.k_sizes, dim=1),
            v_all.split(plan.k_sizes, dim=1),
            plan.masks,
            strict=True,
        ):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.view(h, g, nq, d).transpose(0, 1),
                k.view(h, g, nk, d).transpose(0, 1),
                v.view(h, g, nk, d).transpose(0, 1),
                attn_mask=m,
                dropout_p=dropout,
                scale=scaling,
            )
            outs.append(o.transpose(0, 1).reshape(h, g * nq, d))
        rows.append(torch.cat(outs, dim=1).index_select(1, plan.inverse))
    return torch.stack(rows).transpose(1, 2).contiguous(), None


class _RowPlan(NamedTuple):
    """One row's block-sparse schedule: query/key gather indices and per-group shapes/masks."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    inverse: torch.Tensor
    """Permutation putting the grouped outputs back in row order."""
    shapes: list[tuple[int, int, int]]
    """Per group: (query blocks, queries per block, keys per block)."""
    q_sizes: list[int]
    k_sizes: list[int]
    masks: list[torch.Tensor]
    """Per group: ``[g, 1, nq, nk]`` additive mask (padding keys at -inf)."""


def _block_plan(mask: torch.Tensor) -> list[_RowPlan]:
    """Schedule of ``tree_sdpa`` for a ``[B,1,T,T]`` mask, computed once and kept on the tensor
    (every layer of a forward sees the same mask object)."""
    bs = TREE_BLOCK
    cached = getattr(mask, "_hrl_tree_plan", None)
    if cached is not None and cached[0] == bs:
        return cached[1]
    b, t = mask.shape[0], mask.shape[-1]
    nb = -(-t // bs)
    allowed = torch.zeros(b, nb * bs, nb * bs, dtype=torch.bool, device=mask.device)
    allowed[:, :t, :t] = mask[:, 0] == 0
    occupied = allowed.view(b, nb, bs, nb, bs).any(dim=4).any(dim=2).cpu()
    plans = [_row_plan(mask[i, 0], occupied[i], bs) for i in range(b)]
    mask._hrl_tree_plan = (bs, plans)  # type: ignore[attr-defined]
    return plans


def _row_plan(mask: torch.Tensor, occupied: torch.Tensor, bs: int) -> _RowPlan:
    t, dev = mask.shape[-1], mask.device
    blocks: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for qb in range(occupied.shape[0]):
        q = torch.arange(qb * bs, min(t, (qb + 1) * bs))
        kb = occupied[qb].nonzero().flatten()
        k = (kb[:, None] * bs + torch.arange(bs)).flatten()
        k = k[k < t]
        width = -(-len(k) // (2 * bs)) * 2 * bs  # bucket: pad keys to a multiple of 2 blocks
        blocks.setdefault((len(q), min(width, t)), []).append((q, k))
    q_parts, k_parts, shapes, q_sizes, k_sizes, masks = [], [], [], [], [], []
    for (nq, nk), members in blocks.items():
        ks = torch.zeros(len(members), nk, dtype=torch.long)
        valid = torch.zeros(len(members), nk, dtype=torch.bool)
        for j, (_, k) in enumerate(members):
            ks[j, : len(k)] = k
            valid[j, : len(k)] = True
        qs = torch.stack([q for q, _ in members])  # [g, nq]
        m = mask[qs[:, :, None].to(dev), ks[:, None, :].to(dev)]  # [g, nq, nk]
        m = m.masked_fill(~valid[:, None, :].to(dev), float("-inf"))
        # gathers are head-major ([h, g*n, d] viewed as [h, g, n, d])
        q_parts.append(qs.flatten())
        k_parts.append(ks.flatten())
        shapes.append((len(members), nq, nk))
        q_sizes.append(qs.numel())
        k_sizes.append(ks.numel())
        masks.append(m[:, None])
    q_index = torch.cat(q_parts)
    return _RowPlan(
        q_index=q_index.to(dev),
        k_index=torch.cat(k_parts).to(dev),
        inverse=torch.argsort(q_index).to(dev),
        shapes=shapes,
        q_sizes=q_sizes,
        k_sizes=k_sizes,
        masks=masks,
    )


def _register_tree_sdpa() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)


def load_policy(
    spec: str,
    *,
    dtype: Any = "float32",
    device: Any = "cpu",
    attn_implementation: str | None = TREE_SDPA,
    temperature: float = 1.0,
    value_head: bool = False,
) -> Policy:
    """``Policy`` around ``harnessrl.common.models.load_model(spec)`` in train mode.

    ``attn_implementation``: ``tree_sdpa`` (block-sparse sdpa over the dense float tree mask,
    the default), ``eager`` or ``sdpa`` (dense float tree mask, every pair computed), or
    ``flex_attention`` (CUDA, ``BlockMask`` from ``harnessrl.learner.packing.flex_tree_mask``); None keeps
    the model's own.
    """
    lm = load_model(spec, dtype=dtype, device=device)
    if attn_implementation == TREE_SDPA:
        _register_tree_sdpa()
    if attn_implementation:
        lm.set_attn_implementation(attn_implementation)
    lm.config.use_cache = False
    policy = Policy(lm, temperature=temperature, value_head=value_head).to(device)
    policy.train()
    return policy
