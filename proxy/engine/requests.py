"""Request parsing of the embedded engine: ``/generate`` bodies and SGLang sampling params,
validated into ``GenerateItem``s, the errors every layer raises, and the weight-version spans
of a reply (``weight_version_spans``, shared with the scripted engine: no torch here).

Bad input (bad JSON, missing or out-of-vocabulary ids — any integer, however large —, text that
is not Unicode, a prompt that does not fit the context, bad sampling values, unknown fields)
raises ``BadRequest`` (HTTP 400). SGLang's sampling params that the engine does not implement
are accepted only at their neutral values.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


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
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # beyond int64: certainly outside the vocabulary
        arr = None
    if arr is None or ((arr < 0) | (arr >= vocab_size)).any():
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise BadRequest(f"{name} holds id {bad} outside the vocabulary [0, {vocab_size})")
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


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encode_text(text: Any, tokenizer: Any) -> Any:
    if tokenizer is None:
        raise BadRequest("text input needs a tokenizer; send input_ids")
    if isinstance(text, str):
        return tokenizer.encode(_unicode(text, "text"), add_special_tokens=False) or None
    if isinstance(text, list) and all(isinstance(t, str) for t in text):
        return [
            tokenizer.encode(_unicode(t, f"text[{i}]"), add_special_tokens=False)
            for i, t in enumerate(text)
        ]
    raise BadRequest("text must be a string or a list of strings")


def weight_version_spans(
    events: Sequence[tuple[str, int]], current: str, n_output: int
) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: the weight versions over output-token ranges
    ``[start, end)``, from the ``(old version, output tokens so far)`` recorded at each update
    (SGLang's ``compute_weight_version_spans`` and ``add_weight_versions_to_meta_info``). SGLang
    records an update only for requests that already have output; this engine records it for
    every admitted request, so a first span of length 0 names weights that computed only
    prompt KV, and the last span is always ``current`` (length 0 when no token followed)."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, n_output)]:
        end = min(end, n_output)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    if spans[-1]["version"] != current:
        spans.append({"version": current, "start": n_output, "end": n_output})
    return spans


def _unicode(text: str, name: str) -> str:
    """``text``, if it is Unicode text (JSON can carry a lone UTF-16 surrogate; no tokenizer
    can encode one)."""
    if m := _SURROGATE.search(text):
        raise BadRequest(f"{name} holds a lone surrogate {m[0]!r} at {m.start()}: not Unicode")
    return text
