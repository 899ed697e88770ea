"""The lean forward of the embedded engine: a Llama/Qwen-shaped decoder as plain torch ops.

On the small models the embedded engine serves, a step costs Python and op dispatch, not
arithmetic: ``transformers``' module tree spends most of a step in ``Module.__call__``, kwargs
plumbing and per-layer bookkeeping around matmuls of a few rows. ``LeanForward`` runs the same
computation as the Hugging Face forward of ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` (RMSNorm, rotary, GQA, SiLU MLP, q/k norm for Qwen3, biases for Qwen2, tied
or untied embeddings) as one loop of torch ops over the model's own parameters, attending
through ``_PackedBatch.attend`` like the packed HF path. ``LeanForward.build`` returns ``None``
with the reason for any other model, and the engine keeps the HF forward.

Invariants
----------
* Same numbers as the HF forward: every op is the one HF runs, in the same order and dtype (the
  rotary ``rotate_half`` is a flip times a sign-folded sine, which is exact: ``(-a) * b`` is
  ``-(a * b)`` in IEEE arithmetic). The engine checks it against the HF forward at load.
* No second copy of the weights, and nothing to refresh for the big matrices: q/k/v and
  gate/up are fused into one matmul each by making the HF parameters *views* into one
  concatenated tensor, so ``Engine.apply_weights`` (``param.copy_``) writes straight into
  what the lean forward reads. Only the per-head q/k norm weights (``heads x head_dim``
  floats per layer) are derived; ``refresh`` rebuilds them and must run after every weight
  change (``Engine._do_swap`` does), and re-checks that the views are still aliased.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from harnessrl.common.models.head import lm_logits
from harnessrl.proxy.engine.attention import _PackedBatch

log = logging.getLogger("harnessrl.engine")

_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init
_MIN_TABLE = 1024  # positions of the first rotary table (it doubles as needed)


@dataclass
class _Layer:
    """One decoder layer's tensors (views of the model's parameters, except ``qk_norm``)."""

    in_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * dim, hidden]; q/k/v_proj.weight are views of it
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's q_norm / k_norm weights (views), or None
    k_norm: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [heads + kv_heads, dim], derived: rebuilt by ``refresh``
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]; gate/up_proj.weight are views of it
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def unsupported_reason(model: Any) -> str | None:
    """Why ``LeanForward`` cannot run ``model`` (None when it can)."""
    name = type(model).__name__
    if name not in _ARCHS or not type(model).__module__.startswith("transformers.models."):
        return f"architecture {name} is not one of {', '.join(_ARCHS)}"
    tc = model.config.get_text_config()
    if getattr(tc, "hidden_act", None) != "silu":
        return f"activation {getattr(tc, 'hidden_act', None)!r} is not silu"
    if any(t != "full_attention" for t in getattr(tc, "layer_types", None) or []):
        return "sliding-window layers"
    rotary = getattr(model.model, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or rope_type not in _STATIC_ROPE:
        return f"rope type {rope_type!r} is not one of {', '.join(_STATIC_ROPE)}"
    if int(getattr(tc, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp != 1"
    return None


def _fuse(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights of ``linears`` (same input size) into one tensor and make each
    module's weight (and bias) a view of it, so the model and the lean forward share storage."""
    ws = [lin.weight for lin in linears]
    fused = torch.cat([w.detach() for w in ws])
    bias = None
    if any(lin.bias is not None for lin in linears):
        parts = [
            lin.bias.detach() if lin.bias is not None else fused.new_zeros(w.shape[0])
            for lin, w in zip(linears, ws, strict=True)
        ]
        bias = torch.cat(parts)
    row = 0
    for lin, w in zip(linears, ws, strict=True):
        n = w.shape[0]
        w.data = fused[row : row + n]
        if lin.bias is not None:
            lin.bias.data = bias[row : row + n]
        row += n
    return fused, bias


class LeanForward:
    """The decoder forward of a supported HF causal LM as torch ops; see the module docstring.

    ``forward(ids, pos, batch, keep)`` takes the packed step (token ids and positions, 1-D), the
    ``_PackedBatch`` that places each row's KV, and the rows whose logits to return.
    """

    def __init__(self, model: Any):
        tc = model.config.get_text_config()
        inner = model.model
        self.model = model
        self.heads = int(tc.num_attention_heads)
        self.kv_heads = int(tc.num_key_value_heads or tc.num_attention_heads)
        self.dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        self.device = inner.embed_tokens.weight.device
        self._eps = torch.tensor(float(tc.rms_norm_eps), dtype=torch.float32, device=self.device)
        self._n = {
            n: torch.tensor(float(n), dtype=torch.float32, device=self.device)
            for n in (int(tc.hidden_size), self.dim)
        }
        self.dtype = model.dtype
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.lm_bias = model.lm_head.bias
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().clone().to(self.device)
        self.rope_scale = float(rotary.attention_scaling)
        self.scale = inner.layers[0].self_attn.scaling
        self.layers = [self._layer(block) for block in inner.layers]
        self._views = [
            (lin.weight, lay.qkv if i < 3 else lay.gate_up)
            for block, lay in zip(inner.layers, self.layers, strict=True)
            for i, lin in enumerate(
                (
                    block.self_attn.q_proj,
                    block.self_attn.k_proj,
                    block.self_attn.v_proj,
                    block.mlp.gate_proj,
                    block.mlp.up_proj,
                )
            )
        ]
        self.cos = self.sin = torch.empty(0, device=self.device)
        self._table(_MIN_TABLE)
        self.refresh()

    @classmethod
    def build(cls, model: Any) -> LeanForward | None:
        """A lean forward of ``model``, or None (logged) when it is not a supported shape."""
        reason = unsupported_reason(model)
        if reason is not None:
            log.info("lean forward off (%s): the engine runs the transformers forward", reason)
            return None
        return cls(model)

    def _layer(self, block: Any) -> _Layer:
        att, mlp = block.self_attn, block.mlp
        qkv, qkv_bias = _fuse([att.q_proj, att.k_proj, att.v_proj])
        gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
        qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
        return _Layer(
            in_norm=block.input_layernorm.weight,
            qkv=qkv,
            qkv_bias=qkv_bias,
            q_norm=None if qn is None else qn.weight,
            k_norm=None if kn is None else kn.weight,
            qk_norm=None,
            o=att.o_proj.weight,
            o_bias=att.o_proj.bias,
            post_norm=block.post_attention_layernorm.weight,
            gate_up=gate_up,
            gate_up_bias=gate_up_bias,
            down=mlp.down_proj.weight,
            down_bias=mlp.down_proj.bias,
        )

    def refresh(self) -> None:
        """Rebuild what is derived from the weights (call after every weight change) and check
        that the fused matrices still alias the model's parameters."""
        for w, fused in self._views:
            if w.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr():
                raise RuntimeError("a fused weight no longer aliases the model's parameter")
        for lay in self.layers:
            if lay.q_norm is not None and lay.k_norm is not None:
                lay.qk_norm = torch.cat(
                    [lay.q_norm.expand(self.heads, -1), lay.k_norm.expand(self.kv_heads, -1)]
                )

    def _table(self, n: int) -> None:
        """Rotary cos/sin for positions ``< n``, computed as HF computes them (fp32, then the
        model dtype); the sine's first half is negated so ``rotate_half`` becomes a flip."""
        pos = torch.arange(n, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(self.dtype)
        sin = (emb.sin() * self.rope_scale).to(self.dtype)
        half = self.dim // 2
        sin[:, :half] = -sin[:, :half]
        self.cos, self.sin = cos, sin

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm: ``w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``, with ``mean`` as
        the ``sum(...).div_(n)`` it is on CPU, and the scalars as tensors (a Python number
        costs an extra cast per op); HF's casts are skipped when they are no-ops."""
        h = x if x.dtype == torch.float32 else x.to(torch.float32)
        var = h.pow(2).sum(-1, keepdim=True).div_(self._n[x.shape[-1]]).add_(self._eps)
        h = h * torch.rsqrt(var)
        return w * (h if x.dtype == torch.float32 else h.to(x.dtype))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` on ``[tokens, heads, dim]``."""
        t, h, d = x.shape
        flipped = x.reshape(t, h, 2, d // 2).flip(2).reshape(t, h, d)
        return x * cos + flipped * sin

    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, batch: _PackedBatch, keep: torch.Tensor, hi: int
    ) -> torch.Tensor:
        """Logits ``[len(keep), vocab]`` of one packed step; ``hi`` bounds the positions."""
        if hi > self.cos.shape[0]:
            self._table(max(hi, 2 * self.cos.shape[0]))
        t = ids.shape[0]
        nh, nkv, d = self.heads, self.kv_heads, self.dim
        cos = self.cos[pos].unsqueeze(1)
        sin = self.sin[pos].unsqueeze(1)
        x = F.embedding(ids, self.embed)
        for i, lay in enumerate(self.layers):
            h = self._rms(x, lay.in_norm)
            qkv = F.linear(h, lay.qkv, lay.qkv_bias).view(t, nh + 2 * nkv, d)
            qk, v = qkv[:, : nh + nkv], qkv[:, nh + nkv :]
            if lay.qk_norm is not None:
                qk = self._rms(qk, lay.qk_norm)
            qk = self._rotate(qk, cos, sin)
            o = batch.attend_rows(i, qk[:, :nh], qk[:, nh:], v, self.scale)
            x += F.linear(o.reshape(t, nh * d), lay.o, lay.o_bias)
            h = self._rms(x, lay.post_norm)
            gu = F.linear(h, lay.gate_up, lay.gate_up_bias)
            n = gu.shape[1] // 2
            x += F.linear(F.silu(gu[:, :n]) * gu[:, n:], lay.down, lay.down_bias)
        h = self._rms(x[keep], self.norm)
        return lm_logits(h, self.lm_head, self.lm_bias)  # fp32, as the learner's

    __call__ = forward
