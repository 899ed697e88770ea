"""The embedded engine: a small torch server speaking SGLang's native HTTP API.

The proxy talks to every engine the same way (docs/design.md, "Engines"), so this package reproduces the subset of
SGLang's native API that harnessrl uses, on CPU (GPU runs use SGLang itself), for any Hugging Face
causal LM with full attention whose attention goes through ``transformers``' attention interface
(Qwen3, Qwen2...; a start-up self-check refuses the others), and for Llama/Qwen2/Qwen3-shaped
models through the lean forward (plain torch ops; Llama models need it under ``transformers``
5). It also holds the scripted toy teacher (``harnessrl engine --kind teacher``), which speaks
the same API.

Modules
-------
* ``requests``: ``/generate`` bodies and sampling params validated (``SamplingParams``,
  ``parse_generate``, ``GenerateItem``) and the errors (``BadRequest``, ``Overloaded``,
  ``EngineStopped``);
* ``cache``: the KV slot pool (``KVPool``) and the LRU prefix cache (``PrefixCache``);
* ``attention``: the packed attention plugged into ``transformers``;
* ``lean``: the lean forward (``LeanForward``), the model's step as torch ops over its own
  parameters, for Llama/Qwen2/Qwen3-shaped decoders;
* ``sampling``: ``truncate_logits`` and ``sample`` (and what the log-probs mean);
* ``scheduler``: ``Request`` and ``Engine`` (model, KV, the scheduler thread; weight versions);
* ``weights``: engine side of weight updates (reading a folder, joining a weight-update group,
  ``load_state_dict``); the trainer side and the group protocol are ``harnessrl.common.weights``;
* ``server``: ``EngineServer`` (aiohttp) and ``serve`` (the ``harnessrl engine`` loop);
* ``teacher``: the scripted toy teacher as an engine (``make_teacher_engine``, ``serve_teacher``).

Names are re-exported here lazily (``from proxy.engine import EngineServer``): importing the
package, or its torch-free modules (``requests``, ``teacher``), does not import torch.

HTTP API (SGLang shapes; our additions are marked *ext*)
---------------------------------------------------------
* ``POST /generate`` ``{input_ids | text, sampling_params, return_logprob, rid,
  return_text_in_logprobs}`` -> ``{text, output_ids, meta_info: {id, finish_reason, prompt_tokens,
  completion_tokens, cached_tokens, weight_version, weight_versions: [{version, start, end}, ...]
  (the versions over output-token ranges: more than one span when the weights changed while
  the request ran), e2e_latency, output_token_logprobs: [[logprob, token_id, text|null], ...],
  logprobs_truncated (ext)}}``. ``finish_reason`` is
  ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message": ...}``. A list of prompts in ``input_ids`` is a batch: the reply
  is then a list. Sampling params: ``max_new_tokens`` (default 128, capped to fit the context),
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``,
  ``no_stop_trim``, ``skip_special_tokens``, ``sampling_seed``; SGLang's other params are accepted
  only at their neutral values. Without ``no_stop_trim`` the matched stop token is trimmed from
  ``output_ids`` and ``text`` (not from the log-probs), as SGLang does. Unless ``ignore_eos``,
  generation also stops on the model's end ids, SGLang's set: ``eos_token_id`` of
  ``generation_config.json`` and ``config.json``, and the tokenizer's (``/model_info`` reports
  them as ``eos_token_ids``).
* ``GET /health`` (200 serving, 503 loading), ``GET /model_info`` (with ``weight_version``),
  ``GET /server_info`` (with ``context_length``), both also under SGLang's older names
  ``/get_model_info`` and ``/get_server_info``; ``GET /get_weight_version`` (ext: SGLang
  removed it, clients read ``/model_info``), ``GET /metrics`` (Prometheus), ``GET|POST
  /flush_cache``.
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
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BadRequest": "requests",
    "EngineStopped": "requests",
    "GenerateItem": "requests",
    "Overloaded": "requests",
    "SamplingParams": "requests",
    "parse_generate": "requests",
    "parse_sampling_params": "requests",
    "KVPool": "cache",
    "PrefixCache": "cache",
    "sample": "sampling",
    "truncate_logits": "sampling",
    "Engine": "scheduler",
    "Request": "scheduler",
    "load_state_dict": "weights",
    "EngineServer": "server",
    "serve": "server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
