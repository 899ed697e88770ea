"""Packed attention of the embedded engine, plugged into ``transformers``' attention interface.

One scheduler step runs ONE packed forward holding a decode token of every running request plus
prefill chunks of newly admitted ones. Decode attention for all running requests is one batched
SDPA over their slots of the KV pool with a length mask; prefill chunks attend per request with a
causal mask offset by their cached length. ``_PackedBatch`` travels in place of the attention
mask; a plain forward of the same model (no ``_PackedBatch``) takes ``transformers``' own SDPA
path, which the engine's start-up self-check compares against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from harnessrl.proxy.engine.cache import KVPool

_ATTN_NAME = "harnessrl_packed"


# ---------------------------------------------------------------------------------------------
# Packed attention (plugged into transformers' attention interface)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Segment:
    """A prefill chunk: ``n`` tokens at packed offset ``start``, positions ``past..past+n``."""

    start: int
    n: int
    slot: int
    past: int


class _PackedBatch:
    """One step's layout, passed to the attention function in place of the attention mask.

    The packed sequence holds first the decode rows (one token each, ordered by slot), then the
    prefill segments. Each layer writes the new K/V into the pool, then attends. The masks are
    additive (0 / -inf), built once per step: SDPA would otherwise turn a boolean mask into
    this very tensor in every layer.
    """

    def __init__(
        self, pool: KVPool, dec_slots: list[int], dec_pos: list[int], segs: list[_Segment]
    ):
        self.pool = pool
        self.nd = len(dec_slots)
        self.segs = segs
        dtype, dev = pool.dtype, pool.device
        if self.nd:
            self.dec_slots = torch.tensor(dec_slots, device=dev)
            self.dec_pos = torch.tensor(dec_pos, device=dev)
            self.n_hi = max(dec_slots) + 1
            self.dense = self.nd == self.n_hi  # slots 0..nd-1, in order
            self.lmax = max(dec_pos) + 1
            ar = torch.arange(self.lmax, device=dev)
            if self.dense:
                mask = ar[None, :] <= self.dec_pos[:, None]
            else:
                mask = ar[None, :].expand(self.n_hi, -1) < 1
                mask = mask.clone()
                mask[self.dec_slots] = ar[None, :] <= self.dec_pos[:, None]
            self.mask = _additive(mask[:, None, None, :], dtype)
        self.seg_masks = [
            None
            if s.past == 0
            else _additive(
                (
                    torch.arange(s.past + s.n, device=dev)[None, :]
                    <= (s.past + torch.arange(s.n, device=dev))[:, None]
                )[None, None],
                dtype,
            )
            for s in segs
        ]

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Any
    ) -> torch.Tensor:
        """``transformers``' layout: ``[1, heads, tokens, dim]`` in, ``[1, tokens, heads, dim]``
        out."""
        rows = self.attend_rows(
            layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scale
        )
        return rows.unsqueeze(0)

    def attend_rows(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Any
    ) -> torch.Tensor:
        """Write this step's K/V of layer ``layer`` into the pool and attend: ``query``
        ``[tokens, heads, dim]``, ``key``/``value`` ``[tokens, kv_heads, dim]`` -> ``[tokens,
        heads, dim]``."""
        total, heads, dim = query.shape
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        kp, vp = self.pool.kv[layer, 0], self.pool.kv[layer, 1]  # [slots, kv_heads, cap, dim]
        nd = self.nd
        out = None
        if nd:
            kp[self.dec_slots, :, self.dec_pos] = key[:nd]
            vp[self.dec_slots, :, self.dec_pos] = value[:nd]
            # [nd, kv_heads, groups, dim]: the query heads sharing a KV head attend together.
            q = query[:nd].reshape(nd, kv_heads, groups, dim)
            if not self.dense:
                full = q.new_zeros(self.n_hi, kv_heads, groups, dim)
                full[self.dec_slots] = q
                q = full
            o = F.scaled_dot_product_attention(
                q,
                kp[: self.n_hi, :, : self.lmax],
                vp[: self.n_hi, :, : self.lmax],
                attn_mask=self.mask,
                scale=scale,
            )
            if not self.dense:
                o = o[self.dec_slots]
            if not self.segs:  # a decode-only step: the batch's output as it comes
                return o.reshape(nd, heads, dim)
            out = query.new_empty(total, heads, dim)
            out[:nd] = o.reshape(nd, heads, dim)
        if out is None:
            out = query.new_empty(total, heads, dim)
        for seg, mask in zip(self.segs, self.seg_masks, strict=True):
            a, b, p = seg.start, seg.start + seg.n, seg.past
            kp[seg.slot, :, p : p + seg.n] = key[a:b].transpose(0, 1)
            vp[seg.slot, :, p : p + seg.n] = value[a:b].transpose(0, 1)
            # 4-D inputs (a batch of one) reach torch's fused CPU kernels; 3-D ones do not.
            o = F.scaled_dot_product_attention(
                query[a:b].transpose(0, 1).unsqueeze(0),
                kp[seg.slot : seg.slot + 1, :, : p + seg.n],
                vp[seg.slot : seg.slot + 1, :, : p + seg.n],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=groups > 1,
            )
            out[a:b] = o[0].transpose(0, 1)
        return out


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as SDPA's additive mask: 0 where True, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def _packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    if not isinstance(attention_mask, _PackedBatch):  # a plain forward of the same model
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return attention_mask.attend(module.layer_idx, query, key, value, scaling), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTN_NAME, _packed_attention)
