"""Helpers of the real-model tests (``smollm2-135m``): a Hugging Face cache layout built from a
local folder, and the environment that makes a process resolve a hub id from it offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HUB_ID = "harnessrl-test/smollm2-135m-dequantized"
"""The repo id the tests cache the converted model under: clearly not the official
``HuggingFaceTB/SmolLM2-135M-Instruct`` (these are dequantized 4-bit weights)."""


def hf_cache_layout(hub: Path, repo_id: str, folder: Path, branch: str = "main") -> Path:
    """Lay ``folder``'s files out in ``hub`` exactly as ``huggingface_hub`` caches a download:
    ``models--owner--name/blobs/<digest>`` (hard links to the files, or copies across
    filesystems), ``snapshots/<commit>/<file>`` relative symlinks to them, ``refs/<branch>``
    holding the commit. Returns the snapshot folder."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    commit = hashlib.sha1("\n".join(f"{p.name}:{p.stat().st_size}" for p in files).encode())
    snapshot = repo / "snapshots" / commit.hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        digest = hashlib.sha256(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode())
        blob = repo / "blobs" / digest.hexdigest()
        if not blob.exists():
            try:
                os.link(p, blob)
            except OSError:
                blob.write_bytes(p.read_bytes())
        link = snapshot / p.name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit.hexdigest())
    return snapshot


def offline_env(hf_home: Path) -> dict[str, str]:
    """Environment variables of a process that must resolve hub ids from ``hf_home`` only."""
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_home / "hub")}
