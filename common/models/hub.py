"""Hugging Face hub ids (``owner/name``) as model specs: the local HF cache first, then a download.

``resolve_hub("HuggingFaceTB/SmolLM2-135M-Instruct")`` returns the snapshot folder of that repo
in the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``: the layout ``huggingface_hub`` writes, ``models--owner--name/
{refs,snapshots,blobs}``). Where it is not cached, it is downloaded with ``huggingface_hub``
``snapshot_download`` (configs, tokenizer files, chat templates and ``*.safetensors`` only: no
``.bin``/``.gguf``/ONNX duplicates), unless ``HF_HUB_OFFLINE`` is set. When neither works the
error names the cache folder it looked in and why it could not download.

``owner/name@revision`` picks a branch, tag or commit (default ``main``). A local folder always
wins: ``resolve_model`` only treats a spec as a hub id when no such path exists, and never one
that starts with ``/``, ``.`` or ``~``. The environment is read on every call (not when
``huggingface_hub`` was imported), so a process can point ``HF_HOME`` elsewhere before loading.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95})"
    r"(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{0,127}))?$"
)
ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.md",
)
"""What a download fetches: enough to serve and train the model from safetensors."""

_TRUE = ("1", "true", "yes", "on")


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``"owner/name[@rev]"`` -> ``("owner/name", rev)``; None when ``spec`` is not one."""
    m = _HUB_ID.match(spec.strip())
    if m is None or ".." in m.group("repo"):
        return None
    return m.group("repo"), m.group("rev")


def hub_cache_dir() -> Path:
    """The hub cache folder ``huggingface_hub`` uses with the current environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids downloads."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "tokenizer_config.json").is_file()


def resolve_hub(spec: str) -> Path:
    """The local snapshot folder of hub id ``spec`` (cached, else downloaded); ValueError naming
    the cache folder when it is neither cached nor downloadable."""
    parsed = parse_hub_id(spec)
    if parsed is None:
        raise ValueError(f"{spec!r} is not a Hugging Face hub id (owner/name[@revision])")
    repo, rev = parsed
    cache = hub_cache_dir()
    where = cache / f"models--{repo.replace('/', '--')}"
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise ValueError(f"model {spec!r}: huggingface_hub is not installed ({e})") from None
    try:
        folder = Path(
            snapshot_download(repo, revision=rev, cache_dir=str(cache), local_files_only=True)
        )
    except (LocalEntryNotFoundError, OSError, ValueError):
        folder = None
    if folder is not None and _is_model_folder(folder):
        return folder.resolve()
    if folder is not None:
        reason = f"the cached snapshot {folder} has no config.json or tokenizer_config.json"
        if hub_offline():
            raise ValueError(f"model {spec!r}: {reason} (and HF_HUB_OFFLINE is set)")
    if hub_offline():
        raise ValueError(
            f"model {spec!r} is not in the Hugging Face cache (looked in {where}) and "
            "HF_HUB_OFFLINE is set, so it cannot be downloaded: download it where the hub is "
            "reachable (huggingface-cli download) into that cache, or pass a local folder"
        )
    try:
        folder = Path(
            snapshot_download(
                repo, revision=rev, cache_dir=str(cache), allow_patterns=list(ALLOW_PATTERNS)
            )
        )
    except Exception as e:  # network, auth, missing repo: all say the same to the user
        raise ValueError(
            f"model {spec!r} is not in the Hugging Face cache (looked in {where}) and "
            f"downloading it failed: {type(e).__name__}: {str(e)[:300]}"
        ) from None
    if not _is_model_folder(folder):
        raise ValueError(f"model {spec!r}: the downloaded snapshot {folder} has no config.json")
    return folder.resolve()
