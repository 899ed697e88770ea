"""Tiny model specs and building: shapes, ``tiny-…@seedN`` parsing, the random Qwen3 model.

``build_tiny_model`` builds (once, cached under ``<cache>/models/<size>-s<seed>-<hash>``) a
randomly initialised, float32 ``Qwen3ForCausalLM`` with tied embeddings, seeded so the same
spec always gives the same weights, next to a copy of the tiny tokenizer's files.
``_model_recipe`` (the tokenizer recipe plus shape and architecture) is the cache key's input.
torch and transformers are imported only inside the functions that need them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from .cache import _build_atomically, _recipe_hash, default_cache_dir
from .tokenizer import _TOKENIZER_FILES, _tokenizer_recipe, _write_json, build_tiny_tokenizer
from .tokens import ENDOFTEXT, IM_END, IM_START, MAX_POSITION_EMBEDDINGS, VOCAB_SIZE

# Tiny model shapes. Parameter counts (tied embeddings, vocab 8192) are checked by the tests.
TINY_SIZES: dict[str, dict[str, int]] = {
    "tiny-1m": dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "tiny-8m": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "tiny-30m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
TINY_ALIASES = {"tiny": "tiny-8m"}
ROPE_THETA = 1_000_000.0

_TINY_RE = re.compile(r"^(tiny(?:-(?:1m|8m|30m))?)(?:@seed(\d+))?$")


def _model_recipe(size: str) -> dict[str, Any]:
    return {
        "tokenizer": _tokenizer_recipe(),
        "architecture": "Qwen3ForCausalLM",
        "shape": TINY_SIZES[size],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_theta": ROPE_THETA,
        "dtype": "float32",
    }


def parse_tiny_spec(spec: str) -> tuple[str, int] | None:
    """``"tiny-8m@seed3"`` -> ``("tiny-8m", 3)``; ``"tiny"`` -> ``("tiny-8m", 0)``; else None."""
    m = _TINY_RE.match(spec.strip())
    if not m:
        return None
    size = TINY_ALIASES.get(m.group(1), m.group(1))
    return size, int(m.group(2) or 0)


def _tiny_config(size: str, vocab_size: int = VOCAB_SIZE, ids: dict[str, int] | None = None) -> Any:
    from transformers import Qwen3Config

    ids = ids or {ENDOFTEXT: 0, IM_START: 1, IM_END: 2}
    return Qwen3Config(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        use_cache=True,
        **TINY_SIZES[size],
    )


def _build_model_into(size: str, seed: int, tok_dir: Path, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    for name in _TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out / name)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    vocab_size = len(vocab["model"]["vocab"]) + sum(
        1 for t in vocab["added_tokens"] if t["content"] not in vocab["model"]["vocab"]
    )
    config = _tiny_config(size, vocab_size, ids)
    config.architectures = ["Qwen3ForCausalLM"]
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev_dtype)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _write_json(
        out / "harnessrl_recipe.json",
        {"size": size, "seed": seed, "recipe": _model_recipe(size)},
    )


def build_tiny_model(
    size: str = "tiny-8m", seed: int = 0, cache_dir: Path | str | None = None
) -> Path:
    """Build (once, cached) a tiny randomly initialised Qwen3 model plus tokenizer."""
    size = TINY_ALIASES.get(size, size)
    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose from {sorted(TINY_SIZES)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "models" / f"{size}-s{seed}-{_recipe_hash(_model_recipe(size))}"
    if (final / ".complete").exists():
        return final
    tok_dir = build_tiny_tokenizer(root)
    return _build_atomically(final, lambda tmp: _build_model_into(size, seed, tok_dir, tmp))
