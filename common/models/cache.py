"""The tiny-model cache: its folder, recipe hashing (cache keys), locking and atomic builds.

Every cached artifact lives in ``<cache>/<kind>/<name>-<hash>`` where ``<hash>`` is
``_recipe_hash(recipe)``: the first 10 hex digits of the SHA-256 of the recipe dict as compact,
key-sorted JSON. Recipes are data (shapes, vocabulary, corpus parameters, word-list hash, chat
template, ``RECIPE_VERSION``), never source text or file paths, so moving code does not change
a key. A folder is complete iff it holds ``.complete``; it is built in a temporary sibling and
renamed into place, so readers never see a partial folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Bump when the corpus generator, the tokenizer pipeline or the model builder changes in a way
# the hashed recipe below does not capture; it invalidates every cached tiny model.
RECIPE_VERSION = 1


def _recipe_hash(recipe: dict[str, Any]) -> str:
    blob = json.dumps(recipe, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def default_cache_dir() -> Path:
    """``$HARNESSRL_CACHE`` or ``~/.cache/harnessrl``."""
    env = os.environ.get("HARNESSRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "harnessrl"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Best-effort inter-process lock (only avoids duplicate work; correctness comes from the
    atomic rename)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_atomically(final: Path, build: Any) -> Path:
    """Run ``build(tmp_dir)`` in a temporary sibling folder and rename it to ``final``. If another
    process got there first, keep theirs."""
    if (final / ".complete").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / ".complete").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            # mkdtemp makes a private folder; the cache is meant to be shared (and read-only).
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / ".complete").exists():
                    # A stale, incomplete folder (should not happen: we only ever rename
                    # complete ones). Replace it.
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final
