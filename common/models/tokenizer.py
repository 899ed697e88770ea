"""The tiny byte-level BPE tokenizer: its recipe, training, and the files written for it.

``build_tiny_tokenizer`` trains (once, cached under ``<cache>/tokenizers/tiny-bpe-<hash>``) an
8192-id tokenizer on the :mod:`.corpus`, with the Qwen2/Qwen3 pre-tokenizer split, the special
tokens of :mod:`.tokens` and the :mod:`.chat_template`. ``_tokenizer_recipe`` is the cache key's
input: everything that shapes the tokenizer and is data belongs in it; code changes that alter
the result bump ``RECIPE_VERSION``. ``tokenizers`` is imported only when training.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .cache import RECIPE_VERSION, _build_atomically, _recipe_hash, default_cache_dir
from .chat_template import CHAT_TEMPLATE
from .corpus import _corpus_documents
from .tokens import (
    ADDED_TOKENS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    MAX_POSITION_EMBEDDINGS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
)
from .words import (
    _ADJECTIVES,
    _ADVERBS,
    _DIRS,
    _EXTS,
    _FUNCTION_WORDS,
    _KEYS,
    _NAMES,
    _NOUNS,
    _SHELL_CMDS,
    _VERBS,
)

# Qwen2/Qwen3 pre-tokenizer split: single digits, words with one leading non-letter, runs of
# punctuation, newlines with the indentation before them kept apart from the code after them.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS_CHARS = 3_000_000
_CORPUS_SEED = 20240601


def _tokenizer_recipe() -> dict[str, Any]:
    return {
        "recipe_version": RECIPE_VERSION,
        "kind": "byte-level-bpe",
        "vocab_size": VOCAB_SIZE,
        "special_tokens": list(SPECIAL_TOKENS),
        "added_tokens": list(ADDED_TOKENS),
        "split_pattern": _SPLIT_PATTERN,
        "corpus": {"chars": _CORPUS_CHARS, "seed": _CORPUS_SEED},
        "word_lists": hashlib.sha256(
            json.dumps(
                [
                    _FUNCTION_WORDS,
                    _NOUNS,
                    _VERBS,
                    _ADJECTIVES,
                    _ADVERBS,
                    _NAMES,
                    _EXTS,
                    _DIRS,
                    _SHELL_CMDS,
                    _KEYS,
                ]
            ).encode()
        ).hexdigest(),
        "chat_template": CHAT_TEMPLATE,
    }


def _train_tokenizer() -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    docs = list(_corpus_documents(_CORPUS_CHARS, _CORPUS_SEED))
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, "
            f"expected {VOCAB_SIZE} (corpus too small for the vocabulary?)"
        )
    return tok


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "errors": "replace",
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


def _write_tokenizer_files(tok: Any, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out / "special_tokens_map.json",
        {
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def build_tiny_tokenizer(cache_dir: Path | str | None = None) -> Path:
    """Train (once, cached) the tiny byte-level BPE tokenizer; returns its folder."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / "tokenizers" / f"tiny-bpe-{_recipe_hash(_tokenizer_recipe())}"
    return _build_atomically(final, lambda tmp: _write_tokenizer_files(_train_tokenizer(), tmp))
