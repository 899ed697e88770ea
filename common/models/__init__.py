"""Model and tokenizer factory.

Loads any Hugging Face causal LM and tokenizer from a local folder, and builds, offline and
deterministically, the project's tiny default models (``tiny-1m``, ``tiny-8m``, ``tiny-30m``):
a byte-level BPE tokenizer (8192 ids) trained on a corpus generated here, plus a randomly
initialised Qwen3 model. Nothing is downloaded; importing this module does not import torch.

Public API
----------
* ``resolve_model(spec, cache_dir=None) -> Path``: a local folder, or ``tiny`` (= ``tiny-8m``),
  ``tiny-1m``, ``tiny-8m``, ``tiny-30m``, each optionally ``@seedN``. Tiny models are built on
  first use into ``<cache>/models/tiny-8m-s0-<hash>`` (cache = ``cache_dir``, else
  ``$HARNESSRL_CACHE``, else ``~/.cache/harnessrl``), atomically (temp dir + rename).
* ``load_tokenizer(path)``, ``load_model(path, dtype="float32", device="cpu")``.
* ``model_info(path) -> dict`` (reads config/safetensors headers only, no weights).
* ``eos_token_ids(tokenizer)``, ``special_token_ids(tokenizer)``.
* ``render_chat(messages, tools=None, add_generation_prompt=False, ...)``: renders a chat
  template exactly as ``transformers`` ``apply_chat_template(tokenize=False)`` does, without
  importing torch or transformers.
* ``CHAT_TEMPLATE``: the tiny models' template (also usable with any ChatML-style vocabulary).

Layout (one module per concern; this package only re-exports)
-------------------------------------------------------------
* :mod:`.tokens`: the ChatML / tool / think token strings, vocabulary size, and the token-id
  helpers ``eos_token_ids`` / ``special_token_ids``.
* :mod:`.chat_template`: ``CHAT_TEMPLATE`` and ``render_chat`` (Jinja, no transformers).
* :mod:`.words`: the fixed word lists the synthetic corpus is drawn from.
* :mod:`.corpus`: the deterministic synthetic corpus the tiny tokenizer is trained on.
* :mod:`.cache`: cache folder, recipe hashing (cache keys), locking, atomic builds.
* :mod:`.tokenizer`: the tiny byte-level BPE tokenizer (recipe, training, files).
* :mod:`.build`: tiny model shapes, spec parsing, building the random Qwen3 model.
* :mod:`.resolve`: ``resolve_model``, ``load_tokenizer``, ``load_model``, ``model_info``.

Importing this package (or any of its modules) must not import torch, transformers, tokenizers
or jinja2 (actor machines import ``common`` without them); those are imported inside functions.
Cache keys are hashes of the build recipe (data, not source text): moving code between these
modules does not change them, editing the recipe inputs does.
"""

from __future__ import annotations

from .build import ROPE_THETA as ROPE_THETA
from .build import TINY_ALIASES as TINY_ALIASES
from .build import TINY_SIZES, build_tiny_model, parse_tiny_spec
from .build import _tiny_config as _tiny_config
from .cache import RECIPE_VERSION as RECIPE_VERSION
from .cache import _build_atomically as _build_atomically
from .cache import default_cache_dir
from .chat_template import CHAT_TEMPLATE, render_chat
from .resolve import (
    load_model,
    load_tokenizer,
    model_info,
    model_max_new_tokens,
    resolve_model,
    shipped_harnesses,
    tokenizer_fingerprint,
)
from .tokenizer import build_tiny_tokenizer
from .tokens import ADDED_TOKENS, SPECIAL_TOKENS, eos_token_ids, special_token_ids
from .tokens import ENDOFTEXT as ENDOFTEXT
from .tokens import IM_END as IM_END
from .tokens import IM_START as IM_START
from .tokens import MAX_POSITION_EMBEDDINGS as MAX_POSITION_EMBEDDINGS
from .tokens import VOCAB_SIZE as VOCAB_SIZE

# Names imported ``as`` themselves above are not public API (not in ``__all__``) but stay
# reachable as ``harnessrl.common.models.X``, as before the split (the tests use some).
__all__ = [
    "ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_SIZES",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "default_cache_dir",
    "eos_token_ids",
    "load_model",
    "load_tokenizer",
    "model_info",
    "model_max_new_tokens",
    "parse_tiny_spec",
    "render_chat",
    "resolve_model",
    "shipped_harnesses",
    "special_token_ids",
    "tokenizer_fingerprint",
]
