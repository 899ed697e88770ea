"""Token strings of the tiny models, and token-id helpers for any tokenizer.

Owns the ChatML / tool / think token strings (``SPECIAL_TOKENS``, ``ADDED_TOKENS``), the tiny
vocabulary size and context length, and ``special_token_ids`` / ``eos_token_ids``, which work on
a ``transformers`` or a ``tokenizers`` tokenizer. These strings and sizes are part of the tiny
tokenizer/model recipe (so of the cache keys): changing one rebuilds every cached tiny model.
No third-party imports.

Special tokens of the tiny tokenizer
------------------------------------
``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2, eos) are special
(dropped by ``skip_special_tokens``). ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
``</tool_response>``, ``<think>``, ``</think>`` (ids 8186..8191) are added tokens that are NOT
special: each is always one id, and they survive ``skip_special_tokens=True``. The tokenizer adds
no BOS/EOS when encoding. The engine should stop on ``eos_token_ids(tok)`` =
``[<|im_end|>, <|endoftext|>]``.
"""

from __future__ import annotations

from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
VOCAB_SIZE = 8192
MAX_POSITION_EMBEDDINGS = 32768


def _token_id(tokenizer: Any, token: str) -> int | None:
    """Id of ``token`` if it is a single token of ``tokenizer`` (transformers or tokenizers)."""
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "convert_tokens_to_ids"):
        vocab = tokenizer.get_vocab()
        return vocab.get(token)
    if hasattr(tokenizer, "token_to_id"):
        return tokenizer.token_to_id(token)
    raise TypeError(f"not a tokenizer: {type(tokenizer).__name__}")


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """``{token: id}`` for each ChatML/tool/think token the tokenizer has as a single id."""
    out: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        i = _token_id(tokenizer, token)
        if i is not None:
            out[token] = int(i)
    return out


def eos_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end a generation: ``<|im_end|>`` and ``<|endoftext|>`` where present, else the
    tokenizer's own ``eos_token_id``."""
    ids = [i for t in (IM_END, ENDOFTEXT) if (i := _token_id(tokenizer, t)) is not None]
    own = getattr(tokenizer, "eos_token_id", None)
    if own is not None and own not in ids:
        ids.append(int(own))
    return [int(i) for i in ids]
