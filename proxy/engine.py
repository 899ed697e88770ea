"""The embedded engine: a small torch server speaking SGLang's native HTTP API.

The proxy talks to every engine the same way (DESIGN §5), so this module reproduces the subset of
SGLang's native API that harnessrl uses, on CPU (GPU runs use SGLang itself), for any Hugging Face
causal LM with full attention whose attention goes through ``transformers``' attention interface
(Qwen3, Qwen2, Llama, Mistral...; a start-up self-check refuses the others).

HTTP API (SGLang shapes; our additions are marked *ext*)
---------------------------------------------------------
* ``POST /generate`` ``{input_ids | text, sampling_params, return_logprob, rid,
  return_text_in_logprobs}`` -> ``{text, output_ids, meta_info: {id, finish_reason, prompt_tokens,
  completion_tokens, cached_tokens, weight_version, e2e_latency, output_token_logprobs:
  [[logprob, token_id, text|null], ...], logprobs_truncated (ext), weight_version_start (ext,
  only when the weights changed while the request ran)}}``. ``finish_reason`` is
  ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message": ...}``. A list of prompts in ``input_ids`` is a batch: the reply
  is then a list. Sampling params: ``max_new_tokens`` (default 128, capped to fit the context),
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``,
  ``no_stop_trim``, ``skip_special_tokens``, ``sampling_seed``; SGLang's other params are accepted
  only at their neutral values. Without ``no_stop_trim`` the matched stop token is trimmed from
  ``output_ids`` and ``text`` (not from the log-probs), as SGLang does.
* ``GET /health`` (200 serving, 503 loading), ``GET /get_model_info``, ``GET /get_server_info``,
  ``GET /get_weight_version``, ``GET /metrics`` (Prometheus), ``POST /flush_cache``.
* ``POST /update_weights_from_disk {model_path, weight_version, abort_all_requests,
  flush_cache}``; ``POST /init_weights_update_group {master_address, master_port, rank_offset,
  world_size, group_name, backend}``; ``POST /update_weights_from_distributed {names, dtypes,
  shapes, group_name, weight_version, flush_cache, abort_all_requests}``;
  ``POST /destroy_weights_update_group {group_name}``. Failures answer 400 with
  ``{"success": false, "message"}`` and the old weights keep serving.
* ``POST /pause_generation {mode: abort|retract|in_place}``, ``POST /continue_generation``,
  ``POST /abort_request {rid, abort_all}``.
* Bad input (bad JSON, missing or out-of-vocabulary ids, a prompt that does not fit the context,
  bad sampling values, unknown fields) answers 400 ``{"error": {"message", "type", "code"}}``.

Log-probs
---------
float32 log-probabilities of each sampled token under the distribution it was drawn from:
``log_softmax(truncate(logits / temperature))`` where ``truncate`` applies ``top_k``, then
``top_p``, then ``min_p`` (truncated tokens get probability 0 and the rest is renormalised; such
replies say ``logprobs_truncated: true``). ``temperature == 0`` is greedy and reports the
log-prob under the untruncated ``T = 1`` distribution (the policy's own log-prob, which is what an
importance ratio against the learner needs).

Weight versions
---------------
A weight update is applied by the scheduler thread *between* two forward passes: nothing is
dropped. Requests running across the swap finish under the new weights (their earlier tokens keep
the KV computed by the old ones) and their reply carries ``weight_version_start``. Every update
empties the prefix cache, whatever ``flush_cache`` says: reusing KV of old weights would silently
make new log-probs wrong. A disk update without ``weight_version`` increments a numeric version;
a distributed bucket without one keeps the version (send it with the last bucket). A
multi-bucket distributed update applies bucket by bucket, as in SGLang; pause generation
(``in_place``) around it to keep every step on one set of weights.

Scheduler (one thread; the HTTP loop never runs the model)
----------------------------------------------------------
Each step admits waiting requests into free slots (prefix-cache lookup first), then runs ONE
packed forward holding a decode token of every running request plus prefill chunks of newly
admitted ones (at most ``prefill_chunk`` prompt tokens per step), samples every request whose
fed tokens reached its end, and finishes the ones that stopped. KV lives in a slot pool (one
tensor ``[layers, 2, slots, kv_heads, cap, head_dim]``); decode attention for all running requests
is one batched SDPA over their slots with a length mask, prefill chunks attend per request with a
causal mask offset by their cached length. Slots are compacted when requests finish, so the
decode batch is dense. Attention is plugged into ``transformers`` through its attention
interface (``_PackedBatch`` travels in place of the attention mask); a start-up self-check
compares the packed path with the model's own forward and refuses a model where they differ.

Prefix cache
------------
LRU entries ``(token ids, KV)`` bounded by ``prefix_cache_mb``. An entry is written when a
request's prefill completes and when a request ends (input + output minus the last token); an
entry that is a prefix of a new one is dropped (the new one covers it). A request reuses the
longest common prefix of its input with any entry (at least one token is always recomputed, for
its logits) and reports it as ``cached_tokens``. A request whose prompt shares a long prefix
with one being prefilled waits for that prefill to land in the cache (GRPO groups send the same
long prompt n times at once).

Trainer side of the distributed update
--------------------------------------
``GlooWeightSender`` (rank 0) plus ``init_weight_group`` / ``push_weights_distributed`` implement
what a learner does against SGLang's protocol, over gloo: the engine joins with a ``TCPStore``
client and a ``ProcessGroupGloo`` under ``PrefixStore("cpu/", PrefixStore(group_name + "/"))``,
exactly the store layout ``torch.distributed``'s own group creation uses, so a trainer written
against SGLang (``init_custom_process_group``-style) talks to this engine unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import datetime
import json
import logging
import math
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from aiohttp import web

from common import metrics as m
from common.models import eos_token_ids, load_model, load_tokenizer, model_info, resolve_model
from proxy.config import EngineConfig

log = logging.getLogger("harnessrl.engine")

__all__ = [
    "BadRequest",
    "Engine",
    "EngineServer",
    "GlooWeightSender",
    "KVPool",
    "PrefixCache",
    "Request",
    "SamplingParams",
    "init_weight_group",
    "load_state_dict",
    "parse_generate",
    "push_weights_distributed",
    "sample",
    "serve",
    "truncate_logits",
]

ENGINE_NAME = "harnessrl-embedded"
_ATTN_NAME = "harnessrl_packed"
_DEFER_MIN_SHARED = 64  # tokens a waiting prompt must share with a running prefill to wait for it
_MIN_CAP = 256  # smallest KV capacity per slot, tokens
_SHRINK_BYTES = 64 << 20  # a KV pool smaller than this keeps its memory

# ---------------------------------------------------------------------------------------------
# Metrics (process-wide; several engines in one process share them)
# ---------------------------------------------------------------------------------------------

M_REQUESTS = m.counter(
    "harnessrl_engine_requests_total", "Finished /generate requests.", ("finish",)
)
M_PROMPT = m.counter("harnessrl_engine_prompt_tokens_total", "Prompt tokens of finished requests.")
M_GENERATED = m.counter("harnessrl_engine_generated_tokens_total", "Tokens sampled.")
M_PREFILLED = m.counter("harnessrl_engine_prefill_tokens_total", "Prompt tokens computed.")
M_CACHED = m.counter("harnessrl_engine_cached_tokens_total", "Prompt tokens reused from cache.")
M_CACHE_LOOKUPS = m.counter(
    "harnessrl_engine_prefix_cache_lookups_total", "Prefix cache lookups.", ("result",)
)
M_CACHE_BYTES = m.gauge("harnessrl_engine_prefix_cache_bytes", "Bytes held by the prefix cache.")
M_BATCH = m.gauge("harnessrl_engine_batch_size", "Requests decoded in the last step.")
M_RUNNING = m.gauge("harnessrl_engine_running_requests", "Requests holding a slot.")
M_QUEUE = m.gauge("harnessrl_engine_queue_depth", "Requests waiting for a slot.")
M_TPS = m.gauge("harnessrl_engine_tokens_per_second", "Tokens sampled per second (last 10 s).")
M_STEP = m.histogram("harnessrl_engine_step_seconds", "Duration of one scheduler step.")
M_VERSION = m.gauge("harnessrl_engine_weight_version", "Numeric weight version (-1 if not).")
M_UPDATES = m.counter("harnessrl_engine_weight_updates_total", "Weight updates.", ("source",))


class BadRequest(ValueError):
    """The request can never succeed as sent (HTTP 400)."""


class Overloaded(RuntimeError):
    """Too many requests are waiting (HTTP 503, retry later)."""


class EngineStopped(RuntimeError):
    """The engine stopped before answering."""


# ---------------------------------------------------------------------------------------------
# Request parsing
# ---------------------------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """The sampling params of one request, validated."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @property
    def truncated(self) -> bool:
        """Whether sampling (and so the log-probs) uses a truncated distribution."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0 or self.min_p > 0)


# SGLang params we accept only at their neutral value (value -> accepted values).
_NEUTRAL_PARAMS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "min_new_tokens": (0,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "stop": (None, "", ()),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None,),
    "custom_params": (None,),
    "stream_interval": (None,),
    "spaces_between_special_tokens": (True, False),
}
_TOP_LEVEL = {
    "input_ids",
    "text",
    "sampling_params",
    "return_logprob",
    "rid",
    "stream",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
}


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise BadRequest(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise BadRequest(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _float(v: Any, name: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise BadRequest(f"{name} must be a finite number, got {v!r}")
    v = float(v)
    if v < lo or v > hi or (lo_open and v == lo):
        raise BadRequest(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return v


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {v!r}")
    return v


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate SGLang ``sampling_params`` (a dict or null); raise ``BadRequest``."""
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object")
    p = SamplingParams()
    for key, v in raw.items():
        if key in _NEUTRAL_PARAMS:
            ok = _NEUTRAL_PARAMS[key]
            if v not in ok and not (key == "stop" and isinstance(v, list) and not v):
                raise BadRequest(f"sampling_params.{key}={v!r} is not supported by this engine")
        elif v is None:
            continue  # an explicit null keeps the default
        elif key == "max_new_tokens":
            p.max_new_tokens = _int(v, key, 0, 10_000_000)
        elif key == "temperature":
            p.temperature = _float(v, key, 0.0, 100.0)
        elif key == "top_p":
            p.top_p = _float(v, key, 0.0, 1.0, lo_open=True)
        elif key == "top_k":
            p.top_k = _int(v, key, -1, 2**31 - 1)
        elif key == "min_p":
            p.min_p = _float(v, key, 0.0, 1.0)
        elif key == "stop_token_ids":
            if not isinstance(v, list):
                raise BadRequest("sampling_params.stop_token_ids must be a list of ids")
            p.stop_token_ids = tuple(
                _int(t, "sampling_params.stop_token_ids[]", 0, vocab_size - 1) for t in v
            )
        elif key in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
            setattr(p, key, _bool(v, f"sampling_params.{key}"))
        elif key == "sampling_seed":
            p.sampling_seed = _int(v, key, 0, 2**63 - 1)
        else:
            raise BadRequest(f"unknown sampling param {key!r}")
    return p


@dataclass
class GenerateItem:
    """One prompt of a ``/generate`` call, validated."""

    input_ids: list[int]
    params: SamplingParams
    rid: str
    return_logprob: bool
    logprob_text: bool


def _check_ids(ids: Any, vocab_size: int, name: str = "input_ids") -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"{name} must be a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{name} must hold integers, got {t!r}")
    arr = np.asarray(ids, dtype=np.int64)
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise BadRequest(
            f"{name} holds id {int(arr[bad][0])} outside the vocabulary [0, {vocab_size})"
        )
    return [int(t) for t in ids]


def parse_generate(
    body: Any, vocab_size: int, max_context: int, tokenizer: Any = None
) -> tuple[list[GenerateItem], bool]:
    """Validate a ``/generate`` body; return its items and whether it was a batch."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key, v in body.items():
        if key not in _TOP_LEVEL and v is not None:
            raise BadRequest(f"unknown field {key!r}")
    if body.get("stream"):
        raise BadRequest("stream is not supported by the embedded engine")
    if body.get("logprob_start_len") not in (None, -1):
        raise BadRequest("only logprob_start_len=-1 (output log-probs) is supported")
    if body.get("top_logprobs_num") not in (None, 0):
        raise BadRequest("top_logprobs_num is not supported")
    ids = body.get("input_ids")
    if ids is None and body.get("text") is not None:
        ids = _encode_text(body["text"], tokenizer)
    if ids is None:
        raise BadRequest("input_ids is required")
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    n = len(prompts)
    sps = body.get("sampling_params")
    sps = sps if isinstance(sps, list) else [sps] * n
    rids = body.get("rid")
    shared_rid = batched and not isinstance(rids, list) and rids is not None
    rids = rids if isinstance(rids, list) else [rids] * n
    if len(sps) != n or len(rids) != n:
        raise BadRequest("sampling_params and rid lists must match the batch size")
    ret_lp = _bool(body.get("return_logprob", False), "return_logprob")
    lp_text = _bool(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")
    items = []
    for i, prompt in enumerate(prompts):
        name = f"input_ids[{i}]" if batched else "input_ids"
        toks = _check_ids(prompt, vocab_size, name)
        if len(toks) >= max_context:
            raise BadRequest(
                f"the prompt has {len(toks)} tokens; the context is {max_context} tokens "
                "(at least one must be left to generate)"
            )
        params = parse_sampling_params(sps[i], vocab_size)
        params.max_new_tokens = min(params.max_new_tokens, max_context - len(toks))
        rid = rids[i]
        if rid is None:
            rid = uuid.uuid4().hex
        elif not isinstance(rid, str) or not rid:
            raise BadRequest("rid must be a non-empty string")
        elif shared_rid:
            rid = f"{rid}-{i}"
        items.append(GenerateItem(toks, params, rid, ret_lp, lp_text))
    if len({it.rid for it in items}) != n:
        raise BadRequest("rids must be unique")
    return items, batched


def _encode_text(text: Any, tokenizer: Any) -> Any:
    if tokenizer is None:
        raise BadRequest("text input needs a tokenizer; send input_ids")
    if isinstance(text, str):
        return tokenizer.encode(text, add_special_tokens=False) or None
    if isinstance(text, list) and all(isinstance(t, str) for t in text):
        return [tokenizer.encode(t, add_special_tokens=False) for t in text]
    raise BadRequest("text must be a string or a list of strings")


# ---------------------------------------------------------------------------------------------
# KV slot pool
# ---------------------------------------------------------------------------------------------


class KVPool:
    """KV of the requests holding a slot: one tensor ``[layers, 2, rows, kv_heads, cap, dim]``.

    Slot ``i`` is row ``i``; rows are contiguous, so the decode batch reads the KV of every
    running request as one strided view. ``rows`` (up to ``slots``) and ``cap`` (up to
    ``max_len``) grow by doubling as requests arrive and lengthen, and shrink once the pool is
    big and mostly unused. Unused positions hold finite values (zeros or stale KV), which the
    attention masks ignore (NaN garbage would leak through a mask: 0 * NaN = NaN).
    """

    def __init__(self, layers: int, heads: int, dim: int, slots: int, dtype: Any, max_len: int):
        self.dims = (layers, heads, dim)
        self.slots = slots
        self.dtype = dtype
        self.max_len = max_len
        self.kv = self._alloc(1, min(_MIN_CAP, max_len))
        self.free = list(range(slots))

    def _alloc(self, rows: int, cap: int) -> torch.Tensor:
        layers, heads, dim = self.dims
        return torch.zeros(layers, 2, rows, heads, cap, dim, dtype=self.dtype)

    @property
    def rows(self) -> int:
        return self.kv.shape[2]

    @property
    def cap(self) -> int:
        return self.kv.shape[4]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def fit(self, rows: int, length: int, shrink: bool = False) -> None:
        """Make room for slots ``< rows`` and positions ``< length`` (which must cover all
        the KV in use); with ``shrink``, give memory back when the pool is mostly unused."""
        new_rows, new_cap = self.rows, self.cap
        if rows > new_rows:
            new_rows = min(self.slots, max(rows, 2 * new_rows))
        while new_cap < length:
            new_cap *= 2
        if shrink and self.nbytes > _SHRINK_BYTES:
            if rows * 2 <= new_rows:
                new_rows = max(rows, 1)
            if length * 4 <= new_cap:
                new_cap = max(_MIN_CAP, 1 << max(2 * length - 1, 1).bit_length())
        new_cap = min(new_cap, self.max_len)
        if (new_rows, new_cap) == (self.rows, self.cap):
            return
        kv = self._alloc(new_rows, new_cap)
        r, c = min(self.rows, new_rows), min(self.cap, new_cap)
        kv[:, :, :r, :, :c] = self.kv[:, :, :r, :, :c]
        self.kv = kv

    def alloc(self) -> int:
        self.free.sort()
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def read(self, slot: int, n: int) -> torch.Tensor:
        """A contiguous copy ``[layers, 2, heads, n, dim]`` of a slot's first ``n`` positions."""
        return self.kv[:, :, slot, :, :n].clone()

    def write(self, slot: int, kv: torch.Tensor, n: int) -> None:
        self.kv[:, :, slot, :, :n] = kv[:, :, :, :n]

    def move(self, src: int, dst: int, n: int) -> None:
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]


# ---------------------------------------------------------------------------------------------
# Prefix cache
# ---------------------------------------------------------------------------------------------


@dataclass
class _CacheEntry:
    tokens: np.ndarray
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.tokens.nbytes


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """LRU map from token prefixes to their KV, bounded in bytes.

    Invariant: no entry's tokens are a prefix of another entry's tokens (the longer one serves
    every lookup the shorter one would), so memory goes to distinct branches.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.entries: collections.OrderedDict[int, _CacheEntry] = collections.OrderedDict()
        self.nbytes = 0
        self._next = 0

    def lookup(self, tokens: np.ndarray, limit: int) -> tuple[_CacheEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that length (<= limit)."""
        best, best_n = None, 0
        for key, e in self.entries.items():
            if len(e.tokens) and len(tokens) and e.tokens[0] == tokens[0]:
                n = min(_lcp(e.tokens, tokens), limit)
                if n > best_n:
                    best, best_n = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        return self.entries[best], best_n

    def insert(self, tokens: np.ndarray, read_kv: Any) -> bool:
        """Add ``tokens`` (KV from ``read_kv()``, called only if it will be stored)."""
        if self.capacity <= 0 or len(tokens) < 2:
            return False
        covered = []
        for key, e in self.entries.items():
            n = _lcp(e.tokens, tokens)
            if n == len(tokens):  # an entry already covers it
                self.entries.move_to_end(key)
                return False
            if n == len(e.tokens):
                covered.append(key)
        for key in covered:
            self._drop(key)
        entry = _CacheEntry(tokens.copy(), read_kv())
        if entry.nbytes > self.capacity:
            return False
        while self.nbytes + entry.nbytes > self.capacity and self.entries:
            self._drop(next(iter(self.entries)))
        self.entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        M_CACHE_BYTES.set(self.nbytes)
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
        M_CACHE_BYTES.set(self.nbytes)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
        M_CACHE_BYTES.set(0)


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
    prefill segments. Each layer writes the new K/V into the pool, then attends.
    """

    def __init__(
        self, pool: KVPool, dec_slots: list[int], dec_pos: list[int], segs: list[_Segment]
    ):
        self.pool = pool
        self.nd = len(dec_slots)
        self.segs = segs
        if self.nd:
            self.dec_slots = torch.tensor(dec_slots)
            self.dec_pos = torch.tensor(dec_pos)
            self.n_hi = max(dec_slots) + 1
            self.dense = self.nd == self.n_hi  # slots 0..nd-1, in order
            self.lmax = max(dec_pos) + 1
            ar = torch.arange(self.lmax)
            if self.dense:
                mask = ar[None, :] <= self.dec_pos[:, None]
            else:
                mask = ar[None, :].expand(self.n_hi, -1) < 1
                mask = mask.clone()
                mask[self.dec_slots] = ar[None, :] <= self.dec_pos[:, None]
            self.mask = mask[:, None, None, :]
        self.seg_masks = [
            None
            if s.past == 0
            else (torch.arange(s.past + s.n)[None, :] <= (s.past + torch.arange(s.n))[:, None])[
                None, None
            ]
            for s in segs
        ]

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Any
    ) -> torch.Tensor:
        _, heads, total, dim = query.shape
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        kp, vp = self.pool.kv[layer, 0], self.pool.kv[layer, 1]  # [slots, kv_heads, cap, dim]
        out = query.new_empty(total, heads, dim)
        nd = self.nd
        if nd:
            kp[self.dec_slots, :, self.dec_pos] = key[0, :, :nd].transpose(0, 1)
            vp[self.dec_slots, :, self.dec_pos] = value[0, :, :nd].transpose(0, 1)
            # [nd, kv_heads, groups, dim]: the query heads sharing a KV head attend together.
            q = query[0, :, :nd].transpose(0, 1).reshape(nd, kv_heads, groups, dim)
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
            out[:nd] = o.reshape(nd, heads, dim)
        for seg, mask in zip(self.segs, self.seg_masks, strict=True):
            a, b, p = seg.start, seg.start + seg.n, seg.past
            kp[seg.slot, :, p : p + seg.n] = key[0, :, a:b]
            vp[seg.slot, :, p : p + seg.n] = value[0, :, a:b]
            # 4-D inputs (a batch of one) reach torch's fused CPU kernels; 3-D ones do not.
            o = F.scaled_dot_product_attention(
                query[:, :, a:b],
                kp[seg.slot : seg.slot + 1, :, : p + seg.n],
                vp[seg.slot : seg.slot + 1, :, : p + seg.n],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=groups > 1,
            )
            out[a:b] = o[0].transpose(0, 1)
        return out.unsqueeze(0)


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


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    """One generation, owned by the scheduler thread once submitted."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_text: bool = False
    tokens: list[int] = field(default_factory=list)
    """Input + output so far; KV exists for ``tokens[:computed]`` in ``slot``."""
    computed: int = 0
    slot: int | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    version_start: str | None = None
    version_end: str | None = None
    finish: dict[str, Any] | None = None
    created: float = field(default_factory=time.perf_counter)
    finished_at: float = 0.0
    generator: torch.Generator | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.input_ids)


# ---------------------------------------------------------------------------------------------
# The engine (scheduler thread)
# ---------------------------------------------------------------------------------------------


def _parse_dtype(name: str) -> torch.dtype:
    n = name.removeprefix("torch.")
    dt = getattr(torch, n, None)
    if not isinstance(dt, torch.dtype):
        raise BadRequest(f"unknown dtype {name!r}")
    return dt


class Engine:
    """Model, KV pool, prefix cache and the scheduler thread; no HTTP.

    Thread-safe entry points (``submit``, ``abort``, ``pause``, ``resume``, ``apply_weights``,
    ``flush_cache``) return ``concurrent.futures.Future``s resolved by the scheduler thread, which
    alone touches the model and the KV state, between two forward passes.
    """

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model: Any = None
        self.tokenizer: Any = None
        self.version = cfg.weight_version
        self.paused = False
        self.waiting: list[Request] = []
        self.active: list[Request] = []
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._commands: list[tuple[Any, tuple[Any, ...], concurrent.futures.Future]] = []
        self._live: dict[str, Request] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._counter = 0
        self._tps: collections.deque[tuple[float, int]] = collections.deque()
        self.steps = 0
        self.peak_batch = 0

    # -- loading ---------------------------------------------------------------------------

    def load(self) -> None:
        """Load model and tokenizer, set up the pool and cache, and self-check (blocking)."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        with contextlib.suppress(Exception):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        self.folder = resolve_model(cfg.model)
        self.info = model_info(self.folder)
        self.model = load_model(self.folder, dtype=cfg.dtype)
        self.model.requires_grad_(False)
        try:
            self.tokenizer = load_tokenizer(cfg.tokenizer or self.folder)
        except Exception as e:  # the engine serves ids without a tokenizer
            log.warning("no tokenizer for %s (%s); replies carry empty text", self.folder, e)
            self.tokenizer = None
        tc = self.model.config.get_text_config()
        self.vocab_size = int(tc.vocab_size)
        self.eos_ids = tuple(
            eos_token_ids(self.tokenizer) if self.tokenizer else self.info["eos_token_ids"]
        )
        model_max = int(getattr(tc, "max_position_embeddings", 0) or 0) or 1 << 20
        self.max_context = min(cfg.max_context or model_max, model_max)
        layer_types = list(getattr(tc, "layer_types", None) or [])
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported attention layer types {sorted(set(layer_types))}")
        self._mask_keys = sorted(set(layer_types) | {"full_attention"})
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._unique = {id(p): n for n, p in self.model.named_parameters()}
        heads = int(tc.num_key_value_heads or tc.num_attention_heads)
        dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        self._kv_shape = (int(tc.num_hidden_layers), heads, dim)
        self._switch_attention()
        self.pool = self._new_pool(cfg.max_batch_size)
        self.cache = PrefixCache(cfg.prefix_cache_mb << 20)
        M_VERSION.set(_numeric(self.version))

    def _new_pool(self, slots: int) -> KVPool:
        layers, heads, dim = self._kv_shape
        return KVPool(layers, heads, dim, slots, self.model.dtype, self.max_context)

    def _switch_attention(self) -> None:
        """Plug the packed attention in, and check it against the model's own forward on the
        three paths a step takes: a first chunk, a chunk after cached KV, a decode row."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(9)]
        with torch.no_grad():
            ref = self.model(input_ids=torch.tensor([ids])).logits[0, [4, 7, 8]].float()
        _register_attention()
        self.model.set_attn_implementation(_ATTN_NAME)
        if self.model.config._attn_implementation != _ATTN_NAME:
            raise ValueError(f"{type(self.model).__name__} cannot use a custom attention")
        self.pool = self._new_pool(1)
        with torch.no_grad():
            got = [
                self._run_packed(ids[0:5], [], [], [_Segment(0, 5, 0, 0)], [4]),
                self._run_packed(ids[5:8], [], [], [_Segment(0, 3, 0, 5)], [2]),
                self._run_packed(ids[8:9], [0], [8], [], [0]),
            ]
        tol = 1e-3 if self.model.dtype == torch.float32 else 0.5
        err = float((torch.cat(got).float() - ref).abs().max())
        if not err <= tol:
            raise ValueError(f"packed attention differs from the model's forward by {err:.3g}")

    def _run_packed(
        self,
        ids: list[int],
        dec_slots: list[int],
        dec_pos: list[int],
        segs: list[_Segment],
        keep: list[int],
    ) -> torch.Tensor:
        """One packed forward (decode rows first, then segments); logits of rows ``keep``."""
        pos = list(dec_pos) + [s.past + j for s in segs for j in range(s.n)]
        batch = _PackedBatch(self.pool, dec_slots, dec_pos, segs)
        out = self.model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([pos]),
            attention_mask=dict.fromkeys(self._mask_keys, batch),
            use_cache=False,
            logits_to_keep=torch.tensor(keep),
        )
        return out.logits[0]

    # -- thread-safe API -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cv:
            for _, _, fut in self._commands:
                if not fut.done():
                    fut.set_exception(EngineStopped("engine stopped"))
            self._commands.clear()

    def new_request(self, item: GenerateItem) -> Request:
        return Request(
            item.rid, item.input_ids, item.params, item.return_logprob, item.logprob_text
        )

    def submit(self, req: Request) -> concurrent.futures.Future:
        """Queue a request; its future resolves to the finished ``Request``."""
        with self._cv:
            if self._stopping or not self.alive:
                raise EngineStopped("engine is not running")
            if req.rid in self._live:
                raise BadRequest(f"rid {req.rid!r} is already running")
            if len(self._live) - len(self.active) >= self.cfg.max_queue:
                raise Overloaded(f"{self.cfg.max_queue} requests are already waiting")
            self._live[req.rid] = req
            self._incoming.append(req)
            self._cv.notify()
        return req.future

    def _call(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping or not self.alive:
                fut.set_exception(EngineStopped("engine is not running"))
                return fut
            self._commands.append((fn, args, fut))
            self._cv.notify()
        return fut

    def abort(self, rid: str | None = None, abort_all: bool = False) -> concurrent.futures.Future:
        """Finish a queued or running request (or all) with ``finish_reason`` abort."""
        return self._call(self._do_abort, rid, abort_all, "aborted by request")

    def pause(self, mode: str) -> concurrent.futures.Future:
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        return self._call(self._do_pause, mode)

    def resume(self) -> concurrent.futures.Future:
        return self._call(self._do_resume)

    def flush_cache(self) -> concurrent.futures.Future:
        return self._call(self.cache.clear)

    def apply_weights(
        self,
        named: list[tuple[str, torch.Tensor]],
        version: str | None,
        abort_all: bool = False,
        source: str = "disk",
    ) -> concurrent.futures.Future:
        """Swap weights in between two steps; resolves to the new version."""
        return self._call(self._do_swap, named, version, abort_all, source)

    # -- weights (called from any thread; read-only on the model) --------------------------

    def check_weights(self, named: Sequence[tuple[str, torch.Tensor]], full: bool) -> None:
        """Raise ``ValueError`` unless every tensor names a parameter of the right shape (and,
        with ``full``, every parameter is present)."""
        seen = set()
        for name, t in named:
            p = self._params.get(name)
            if p is None:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            if not t.is_floating_point():
                raise ValueError(f"{name}: dtype {t.dtype} is not floating point")
            seen.add(id(p))
        if full:
            missing = [n for i, n in self._unique.items() if i not in seen]
            if missing:
                raise ValueError(f"{len(missing)} parameters missing, e.g. {missing[0]!r}")

    def read_weights(self, model_path: str) -> list[tuple[str, torch.Tensor]]:
        """Read and check a model folder's safetensors (blocking; raises ``ValueError``)."""
        from safetensors.torch import load_file

        folder = resolve_model(model_path)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(
                {folder / f for f in json.loads(index.read_text())["weight_map"].values()}
            )
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors in {folder}")
        named: list[tuple[str, torch.Tensor]] = []
        for f in files:
            try:
                named.extend(load_file(str(f)).items())
            except Exception as e:  # a corrupt file is a bad request
                raise ValueError(f"cannot read {f}: {e}") from None
        self.check_weights(named, full=True)
        return named

    # -- scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        with torch.no_grad():
            while True:
                with self._cv:
                    while not (
                        self._commands
                        or self._incoming
                        or self._stopping
                        or (not self.paused and (self.waiting or self.active))
                    ):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    self.waiting.extend(self._incoming)
                    self._incoming = []
                    stopping = self._stopping
                for fn, args, fut in commands:
                    try:
                        fut.set_result(fn(*args))
                    except Exception as e:  # reported to the caller
                        fut.set_exception(e)
                if stopping:
                    self._do_abort(None, True, "engine stopped")
                    return
                if not self.paused and (self.waiting or self.active):
                    try:
                        self._step()
                    except Exception as e:  # a bad step must not kill the engine
                        log.exception("scheduler step failed; aborting the running requests")
                        self._fail_active(f"engine error: {type(e).__name__}: {e}")
                M_QUEUE.set(len(self.waiting))
                M_RUNNING.set(len(self.active))

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._admit()
        plan = self._plan()
        if not plan:
            return
        sampled = self._forward(plan)
        n_tokens = self._advance(sampled)
        self._compact()
        self.steps += 1
        now = time.perf_counter()
        M_STEP.observe(now - t0)
        self._tps.append((now, n_tokens))
        while self._tps[0][0] < now - 10:
            self._tps.popleft()
        window = max(now - self._tps[0][0], now - t0, 1e-3)
        M_TPS.set(sum(n for _, n in self._tps) / window)

    def _admit(self) -> None:
        i = 0
        while self.pool.free and i < len(self.waiting):
            req = self.waiting[i]
            if req.params.max_new_tokens - len(req.output) <= 0:
                del self.waiting[i]
                self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
                continue
            toks = np.asarray(req.tokens, dtype=np.int64)
            entry, hit = (None, 0)
            if self.cache.capacity > 0:
                entry, hit = self.cache.lookup(toks, len(toks) - 1)
                if self._should_wait(toks, hit):
                    i += 1
                    continue
                M_CACHE_LOOKUPS.labels("hit" if hit else "miss").inc()
            del self.waiting[i]
            req.slot = self.pool.alloc()
            self.pool.fit(self._rows(req.slot), max(hit, self._keep()))
            if hit:
                self.pool.write(req.slot, entry.kv, hit)
            req.computed = hit
            if req.version_start is None:
                req.version_start = self.version
                req.cached_tokens = hit
                M_CACHED.inc(hit)
            if req.generator is None and req.params.temperature > 0:
                self._counter += 1
                seed = req.params.sampling_seed
                if seed is None:
                    seed = hash((self.cfg.seed, self._counter)) & (2**63 - 1)
                req.generator = torch.Generator().manual_seed(seed)
            self.active.append(req)

    def _should_wait(self, toks: np.ndarray, hit: int) -> bool:
        """Whether a prompt should wait for a running prefill that will put more of it in the
        cache than it finds there now."""
        for r in self.active:
            if len(r.tokens) - r.computed > 1:
                shared = _lcp(np.asarray(r.tokens, dtype=np.int64), toks)
                if min(shared, len(toks) - 1) > hit + _DEFER_MIN_SHARED:
                    return True
        return False

    def _keep(self) -> int:
        """Positions of the pool in use."""
        return max((r.computed for r in self.active), default=0)

    def _rows(self, extra: int = 0) -> int:
        """Pool rows in use: one past the highest slot of an active request (or ``extra``)."""
        return max([r.slot for r in self.active] + [extra]) + 1

    def _plan(self) -> list[tuple[Request, int]]:
        """Decode rows (by slot) then prefill chunks (by admission) for this step."""
        decode, prefill = [], []
        budget = self.cfg.prefill_chunk
        for req in self.active:
            left = len(req.tokens) - req.computed
            if left == 1:
                decode.append((req, 1))
            elif budget > 0:
                n = min(left, budget)
                budget -= n
                (decode if n == 1 else prefill).append((req, n))
        decode.sort(key=lambda rn: rn[0].slot)
        return decode + prefill

    def _forward(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, torch.Tensor]]:
        """Run one packed forward; return (request, logits row) for requests that sample."""
        ids: list[int] = []
        dec_slots: list[int] = []
        dec_pos: list[int] = []
        segs: list[_Segment] = []
        keep: list[int] = []
        samplers: list[Request] = []
        for req, n in plan:
            c = req.computed
            if n == 1:
                dec_slots.append(req.slot)
                dec_pos.append(c)
            else:
                segs.append(_Segment(len(ids), n, req.slot, c))
            ids.extend(req.tokens[c : c + n])
            if c + n == len(req.tokens):
                keep.append(len(ids) - 1)
                samplers.append(req)
        self.pool.fit(self._rows(), max(max(r.computed + n for r, n in plan), self._keep()))
        logits = self._run_packed(ids, dec_slots, dec_pos, segs, keep or [len(ids) - 1])
        M_BATCH.set(len(dec_slots))
        self.peak_batch = max(self.peak_batch, len(dec_slots))
        M_PREFILLED.inc(sum(s.n for s in segs))
        for req, n in plan:
            req.computed += n
        return [(req, logits[i]) for i, req in enumerate(samplers)]

    def _advance(self, sampled: list[tuple[Request, torch.Tensor]]) -> int:
        if not sampled:
            return 0
        reqs = [r for r, _ in sampled]
        uniforms = [
            float(torch.rand((), generator=r.generator, dtype=torch.float64)) if r.generator else 0
            for r in reqs
        ]
        logits = torch.stack([lg for _, lg in sampled])
        tokens, logps = sample(logits, [r.params for r in reqs], uniforms)
        M_GENERATED.inc(len(tokens))
        for req, tok, lp in zip(reqs, tokens, logps, strict=True):
            if not req.output and req.computed > 1:  # prefill landed: share it
                self._cache_slot(req)
            req.tokens.append(tok)
            req.output.append(tok)
            req.logprobs.append(lp)
            p = req.params
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                self._finish(req, {"type": "stop", "matched": tok})
            elif len(req.output) >= p.max_new_tokens:
                self._finish(req, {"type": "length", "length": p.max_new_tokens})
        return len(tokens)

    def _cache_slot(self, req: Request) -> None:
        if self.cache.capacity > 0 and req.slot is not None and req.computed > 1:
            n, slot = req.computed, req.slot
            self.cache.insert(
                np.asarray(req.tokens[:n], dtype=np.int64), lambda: self.pool.read(slot, n)
            )

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self._cache_slot(req)
            self.pool.release(req.slot)
            req.slot = None
            req.computed = 0
        if req in self.active:
            self.active.remove(req)

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish = reason
        req.version_end = self.version
        if req.version_start is None:
            req.version_start = self.version
        req.finished_at = time.perf_counter()
        with self._cv:
            self._live.pop(req.rid, None)
        M_REQUESTS.labels(reason["type"]).inc()
        M_PROMPT.inc(len(req.input_ids))
        if not req.future.done():
            req.future.set_result(req)

    def _fail_active(self, message: str) -> None:
        """Abort every running request without trusting (or caching) its KV."""
        for req in list(self.active):
            if req.slot is not None:
                self.pool.release(req.slot)
                req.slot = None
            self._finish(req, {"type": "abort", "message": message})
        self.pool = self._new_pool(self.cfg.max_batch_size)

    def _compact(self) -> None:
        """Move the highest slots into holes so running requests hold slots 0..n-1."""
        used = sorted((r.slot, r) for r in self.active)
        holes = sorted(self.pool.free)
        while used and holes and holes[0] < used[-1][0]:
            src, req = used.pop()
            dst = holes.pop(0)
            self.pool.move(src, dst, req.computed)
            self.pool.free.remove(dst)
            self.pool.free.append(src)
            req.slot = dst
            holes = sorted(self.pool.free)
        self.pool.fit(self._rows(), self._keep() + 1, shrink=True)

    # -- commands (scheduler thread) -------------------------------------------------------

    def _do_abort(self, rid: str | None, abort_all: bool, message: str) -> int:
        hits = [
            r for r in self.waiting + self.active if abort_all or (rid is not None and r.rid == rid)
        ]
        for req in hits:
            self._finish(req, {"type": "abort", "message": message})
        self._compact()
        return len(hits)

    def _do_pause(self, mode: str) -> int:
        n = 0
        if mode == "abort":
            n = self._do_abort(None, True, "generation paused (abort)")
        elif mode == "retract":
            running = list(self.active)
            for req in running:
                self._release(req)
            self.waiting[:0] = running
            n = len(running)
            self._compact()
        self.paused = True
        return n

    def _do_resume(self) -> None:
        self.paused = False

    def _do_swap(
        self, named: list[tuple[str, torch.Tensor]], version: str | None, abort_all: bool, src: str
    ) -> str:
        if abort_all:
            self._do_abort(None, True, "aborted for a weight update")
        for name, t in named:
            self._params[name].copy_(t)
        self.cache.clear()
        if version is None and src == "disk" and self.version.isdigit():
            version = str(int(self.version) + 1)
        version = version or self.version
        self.version = version
        M_VERSION.set(_numeric(version))
        M_UPDATES.labels(src).inc()
        log.info("weights updated from %s: version %s", src, version)
        return version


def _numeric(version: str) -> float:
    try:
        return float(version)
    except ValueError:
        return -1.0


# ---------------------------------------------------------------------------------------------
# Distributed weight update over gloo (engine side and trainer side)
# ---------------------------------------------------------------------------------------------


def _group_store(store: Any, group_name: str) -> Any:
    """The store a gloo backend of group ``group_name`` uses inside torch.distributed."""
    from torch.distributed import PrefixStore

    return PrefixStore("cpu/", PrefixStore(f"{group_name}/", store))


def _broadcast(pg: Any, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


class _WeightGroup:
    """The engine's membership (rank ``rank_offset``) in a trainer's weight-update group."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int, name: str, timeout: float):
        import torch.distributed as dist

        td = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=td)
        self.pg = dist.ProcessGroupGloo(_group_store(self.store, name), rank, world_size, td)

    def receive(self, dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        out = []
        for dt, shape in zip(dtypes, shapes, strict=True):
            t = torch.empty(tuple(shape), dtype=_parse_dtype(dt))
            _broadcast(self.pg, t)
            out.append(t)
        return out

    def close(self) -> None:
        self.pg = None
        self.store = None


class GlooWeightSender:
    """Trainer side (rank 0) of SGLang's distributed weight update, over gloo.

    Usage: ``sender = GlooWeightSender(world_size=1 + n_engines)`` binds the rendezvous store on a
    free port (``sender.port``); ``await init_weight_group(session, urls, sender)`` makes every
    engine join; ``await push_weights_distributed(session, urls, sender, named, version)`` sends
    a set of tensors (call it per bucket); ``sender.close()`` at the end. The same sender works
    with SGLang servers started with gloo.
    """

    def __init__(
        self,
        world_size: int = 2,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
    ):
        import torch.distributed as dist

        self.world_size = world_size
        self.master_address = master_address
        self.group_name = group_name
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=True,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        self.port = int(self.store.port)
        self.pg: Any = None

    def connect(self) -> None:
        """Join the group as rank 0 (blocks until every engine has joined)."""
        import torch.distributed as dist

        store = _group_store(self.store, self.group_name)
        self.pg = dist.ProcessGroupGloo(store, 0, self.world_size, self.timeout)

    def init_request(self, rank_offset: int = 1) -> dict[str, Any]:
        """The ``/init_weights_update_group`` body for the engine at ``rank_offset``."""
        return {
            "master_address": self.master_address,
            "master_port": self.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": "gloo",
        }

    def update_request(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """The ``/update_weights_from_distributed`` body announcing ``named``."""
        return {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": self.group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }

    def send(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Broadcast the tensors in order (the engines receive them in the announced order)."""
        for _, t in named:
            _broadcast(self.pg, t.detach().contiguous().cpu())

    def close(self) -> None:
        self.pg = None
        self.store = None


async def init_weight_group(session: Any, urls: Sequence[str], sender: GlooWeightSender) -> None:
    """POST ``/init_weights_update_group`` to every engine while joining as rank 0."""

    async def post(i: int, url: str) -> None:
        async with session.post(
            f"{url}/init_weights_update_group", json=sender.init_request(1 + i)
        ) as r:
            body = await r.json()
            if r.status != 200 or not body.get("success"):
                raise RuntimeError(f"{url}: init_weights_update_group failed: {body}")

    await asyncio.gather(
        asyncio.to_thread(sender.connect), *(post(i, u) for i, u in enumerate(urls))
    )


async def push_weights_distributed(
    session: Any,
    urls: Sequence[str],
    sender: GlooWeightSender,
    named: Sequence[tuple[str, torch.Tensor]],
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> list[dict[str, Any]]:
    """Announce ``named`` to every engine and broadcast it; return the engines' replies."""
    body = sender.update_request(named, weight_version, flush_cache)

    async def post(url: str) -> dict[str, Any]:
        async with session.post(f"{url}/update_weights_from_distributed", json=body) as r:
            reply = await r.json()
            reply["status"] = r.status
            return reply

    posts = [asyncio.ensure_future(post(u)) for u in urls]
    await asyncio.to_thread(sender.send, named)
    return list(await asyncio.gather(*posts))


# ---------------------------------------------------------------------------------------------
# HTTP server
# ---------------------------------------------------------------------------------------------


def _error(status: int, message: str) -> web.Response:
    """SGLang's error shape, plus ``success``/``message`` as its update endpoints answer."""
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "InternalError")
    error = {"message": message, "type": kind, "code": status}
    return web.json_response({"error": error, "success": False, "message": message}, status=status)


def _update_error(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))
    except Overloaded as e:
        return _error(503, str(e))
    except EngineStopped as e:
        return _error(503, str(e))
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # never crash the server
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}")


async def _json(request: web.Request, required: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest("a JSON body is required")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


_REQUIRED: Any = object()


def _field(body: dict[str, Any], key: str, kind: Any, default: Any = _REQUIRED) -> Any:
    """``body[key]`` checked against ``kind``; null or absent gives ``default`` (or a 400)."""
    v = body.get(key)
    if v is None:
        if default is _REQUIRED:
            raise BadRequest(f"{key} is required")
        return default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BadRequest(f"{key} has the wrong type ({type(v).__name__})")
    return v


def _version_field(body: dict[str, Any]) -> str | None:
    v = body.get("weight_version")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, str | int) or str(v) == "":
        raise BadRequest("weight_version must be a non-empty string")
    return str(v)


class EngineServer:
    """The engine behind an aiohttp server. ``async with EngineServer(cfg) as srv: srv.url``.

    The HTTP server listens before the model is loaded (``/health`` answers 503 until then), so
    supervisors can watch a slow start.
    """

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.engine = Engine(cfg)
        self.ready = False
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._groups: dict[str, _WeightGroup] = {}
        self._update_lock = asyncio.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="engine-io")

    async def __aenter__(self) -> EngineServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> EngineServer:
        app = web.Application(middlewares=[_errors], client_max_size=256 << 20)
        get, post = app.router.add_get, app.router.add_post
        get("/health", self._health)
        get("/health_generate", self._health)
        get("/get_model_info", self._model_info)
        get("/get_server_info", self._server_info)
        get("/get_weight_version", self._weight_version)
        get("/metrics", m.metrics_handler)
        post("/generate", self._generate)
        post("/update_weights_from_disk", self._update_from_disk)
        post("/init_weights_update_group", self._init_group)
        post("/update_weights_from_distributed", self._update_from_distributed)
        post("/destroy_weights_update_group", self._destroy_group)
        post("/pause_generation", self._pause)
        post("/continue_generation", self._continue)
        post("/abort_request", self._abort)
        post("/flush_cache", self._flush_cache)
        get("/flush_cache", self._flush_cache)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{host}:{self.port}"
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.load)
        except BaseException:
            await self.stop()
            raise
        self.engine.start()
        self.ready = True
        return self

    async def stop(self) -> None:
        self.ready = False
        await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.stop)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for g in self._groups.values():
            g.close()
        self._groups.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _require_ready(self) -> None:
        if not self.ready or not self.engine.alive:
            raise EngineStopped("the engine is not ready")

    # -- generation -------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        eng = self.engine
        items, batched = parse_generate(body, eng.vocab_size, eng.max_context, eng.tokenizer)
        reqs = [eng.new_request(it) for it in items]
        futures = []
        try:
            for r in reqs:
                futures.append(asyncio.wrap_future(eng.submit(r)))
            done = await asyncio.gather(*futures)
        except BaseException:  # the client went away (or a later submit failed)
            for r in reqs[: len(futures)]:
                if r.finish is None:  # (cancelling wrap_future also cancels r.future)
                    eng.abort(r.rid)
            raise
        replies = [self._reply(r) for r in done]
        return web.json_response(replies if batched else replies[0])

    def _reply(self, req: Request) -> dict[str, Any]:
        ids = list(req.output)
        finish = req.finish or {"type": "abort", "message": "unknown"}
        if finish["type"] == "stop" and not req.params.no_stop_trim and ids:
            ids = ids[:-1]
        tok = self.engine.tokenizer
        text = tok.decode(ids, skip_special_tokens=req.params.skip_special_tokens) if tok else ""
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output),
            "cached_tokens": req.cached_tokens,
            "weight_version": req.version_end,
            "e2e_latency": round(req.finished_at - req.created, 6),
        }
        if req.version_start != req.version_end:
            meta["weight_version_start"] = req.version_start
        if req.return_logprob:
            texts: list[str | None] = [None] * len(req.output)
            if req.logprob_text and tok:
                texts = [tok.decode([t], skip_special_tokens=False) for t in req.output]
            meta["output_token_logprobs"] = [
                [lp, t, s] for lp, t, s in zip(req.logprobs, req.output, texts, strict=True)
            ]
            meta["logprobs_truncated"] = req.params.truncated
        return {"text": text, "output_ids": ids, "meta_info": meta}

    # -- info -------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self.ready and self.engine.alive:
            return web.Response(status=200)
        return web.Response(status=503, text="not ready")

    async def _model_info(self, request: web.Request) -> web.Response:
        self._require_ready()
        eng = self.engine
        return web.json_response(
            {
                "model_path": str(eng.folder),
                "tokenizer_path": str(self.cfg.tokenizer or eng.folder) if eng.tokenizer else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": eng.version,
                "model_type": eng.info.get("model_type"),
                "vocab_size": eng.vocab_size,
                "max_context_length": eng.max_context,
                "context_length": eng.max_context,
                "eos_token_ids": list(eng.eos_ids),
                "n_params": eng.info.get("n_params"),
                "dtype": self.cfg.dtype,
                "engine": ENGINE_NAME,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        self._require_ready()
        eng = self.engine
        return web.json_response(
            {
                **json.loads(self.cfg.model_dump_json()),
                "engine": ENGINE_NAME,
                "model_path": str(eng.folder),
                "context_length": eng.max_context,
                "max_running_requests": self.cfg.max_batch_size,
                "weight_version": eng.version,
                "paused": eng.paused,
                "prefix_cache_bytes": eng.cache.nbytes,
                "kv_pool_bytes": eng.pool.nbytes,
            }
        )

    async def _weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.version})

    # -- control ----------------------------------------------------------------------------

    async def _pause(self, request: web.Request) -> web.Response:
        body = await _json(request, required=False)
        self._require_ready()
        mode = _field(body, "mode", str, "abort")
        n = await asyncio.wrap_future(self.engine.pause(mode))
        return web.json_response({"success": True, "message": f"paused ({mode})", "requests": n})

    async def _continue(self, request: web.Request) -> web.Response:
        await _json(request, required=False)
        self._require_ready()
        await asyncio.wrap_future(self.engine.resume())
        return web.json_response({"success": True, "message": "generation continued"})

    async def _abort(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        rid = _field(body, "rid", str, None)
        abort_all = _field(body, "abort_all", bool, False)
        if rid is None and not abort_all:
            raise BadRequest("rid (or abort_all: true) is required")
        n = await asyncio.wrap_future(self.engine.abort(rid, abort_all))
        return web.json_response({"success": True, "aborted": n})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        self._require_ready()
        await asyncio.wrap_future(self.engine.flush_cache())
        return web.json_response({"success": True, "message": "cache flushed"})

    # -- weights ----------------------------------------------------------------------------

    async def _in_pool(self, fn: Any, *args: Any) -> Any:
        """Run blocking work in the I/O pool; it completes even if the client goes away."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        return await asyncio.shield(fut)

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        path = _field(body, "model_path", str)
        version = _version_field(body)
        abort_all = _field(body, "abort_all_requests", bool, False)
        _field(body, "flush_cache", bool, True)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest("load_format must be auto or safetensors")
        async with self._update_lock:
            try:
                named = await self._in_pool(self.engine.read_weights, path)
            except (ValueError, OSError) as e:
                return _update_error(f"cannot load weights from {path!r}: {e}")
            fut = self.engine.apply_weights(named, version, abort_all, "disk")
            version = await asyncio.shield(asyncio.wrap_future(fut))
        return web.json_response(
            {
                "success": True,
                "message": f"weights loaded from {path}, version {version}",
                "num_paused_requests": 0,
            }
        )

    async def _init_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        addr = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        rank = _field(body, "rank_offset", int)
        world = _field(body, "world_size", int)
        name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if backend != "gloo":
            return _update_error(f"backend {backend!r} is not available here; use gloo")
        if not (0 < rank < world and 0 < port < 65536):
            return _update_error("need 0 < rank_offset < world_size and a valid master_port")
        if name in self._groups:
            return _update_error(f"group {name!r} already exists")
        timeout = self.cfg.dist_timeout_s
        try:
            group = await self._in_pool(_WeightGroup, addr, port, rank, world, name, timeout)
        except Exception as e:  # a failed rendezvous is the caller's problem
            return _update_error(f"cannot join group {name!r}: {e}")
        self._groups[name] = group
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank}"})

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        names = _field(body, "names", list)
        dtypes = _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        name = _field(body, "group_name", str, "weight_update_group")
        version = _version_field(body)
        abort_all = _field(body, "abort_all_requests", bool, False)
        _field(body, "flush_cache", bool, True)
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise BadRequest("names, dtypes and shapes must be non-empty lists of equal length")
        if not all(isinstance(s, list) and all(isinstance(d, int) for d in s) for s in shapes):
            raise BadRequest("shapes must be lists of integers")
        for dt in dtypes:
            _parse_dtype(str(dt))
        group = self._groups.get(name)
        if group is None:
            return _update_error(f"no weight update group {name!r}; call init_weights_update_group")
        async with self._update_lock:
            try:
                # Always receive everything first: the trainer is already broadcasting.
                tensors = await self._in_pool(group.receive, dtypes, shapes)
            except Exception as e:  # a broken group fails this update only
                return _update_error(f"broadcast failed: {e}")
            named = list(zip(names, tensors, strict=True))
            try:
                self.engine.check_weights(named, full=False)
            except ValueError as e:
                return _update_error(str(e))
            fut = self.engine.apply_weights(named, version, abort_all, "distributed")
            version = await asyncio.shield(asyncio.wrap_future(fut))
        return web.json_response(
            {"success": True, "message": f"{len(named)} tensors updated, version {version}"}
        )

    async def _destroy_group(self, request: web.Request) -> web.Response:
        body = await _json(request, required=False)
        name = _field(body, "group_name", str, "weight_update_group")
        group = self._groups.pop(name, None)
        if group is None:
            return _update_error(f"no weight update group {name!r}")
        group.close()
        return web.json_response({"success": True, "message": f"left {name}"})


async def serve(cfg: EngineConfig, stop: asyncio.Event | None = None) -> int:
    """Run the engine until SIGTERM/SIGINT (or ``stop``); print the ready line on stdout."""
    import signal

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    srv = EngineServer(cfg)
    try:
        await srv.start()
    except (ValueError, OSError) as e:
        print(f"harnessrl engine: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        print(
            f"engine ready: {srv.url} (model {srv.engine.folder}, "
            f"weight_version {srv.engine.version})",
            flush=True,
        )
        await stop.wait()
    finally:
        await srv.stop()
    print("engine stopped", flush=True)
    return 0


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A model folder's safetensors as one state dict (helper for tests and trainers)."""
    from safetensors.torch import load_file

    folder = resolve_model(path)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
