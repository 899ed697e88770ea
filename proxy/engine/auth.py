"""The engines' API key (SGLang's ``--api-key`` convention), for the embedded engine and the
scripted/teacher engine alike.

With a key, every request must carry ``Authorization: Bearer KEY`` or is answered 401
``{"error": "Unauthorized"}`` before any handler runs: generation, weight updates and update
groups, pause/continue/abort, ``/flush_cache``, model and server info. As in SGLang, only
``/health*`` (supervisors and load balancers probe it) and ``/metrics`` (Prometheus) stay open.
The key is compared in constant time. Torch-free.

``harnessrl engine`` is closed by default (`serving_key`): with no key option it serves with
the key in ``$HARNESSRL_CACHE/engine-api-key`` (``~/.cache/harnessrl/engine-api-key``), made
the first time (random, 0600) and reused by every later engine of that user, as ``harnessrl
nats`` makes and reuses its credentials; ``--api-key-file FILE`` names another file (made
there when missing); only ``--insecure`` serves without a key.
"""

from __future__ import annotations

import hmac
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from harnessrl.common.files import ensure_secret, read_secret

OPEN_PREFIXES = ("/health", "/metrics")
"""Paths answered without the key (as SGLang's ``add_api_key_middleware``)."""


def load_api_key(key: str = "", key_file: str = "") -> str:
    """The engine's key from a file (preferred) or given directly; "" for none. Raises
    ``harnessrl.common.files.SecretFileError`` for an unreadable or empty file."""
    if key_file:
        return read_secret(key_file, "engine API key file")
    return key.strip()


DEFAULT_KEY_FILE = "engine-api-key"
"""Name of the default key file in ``$HARNESSRL_CACHE``."""


def default_key_file() -> Path:
    """``$HARNESSRL_CACHE/engine-api-key`` (``~/.cache/harnessrl/engine-api-key``)."""
    from harnessrl.common.models.cache import default_cache_dir

    return default_cache_dir() / DEFAULT_KEY_FILE


def serving_key(key: str = "", key_file: str = "", insecure: bool = False) -> tuple[str, str]:
    """``(key, where it is)`` an engine command serves with: none with ``insecure`` (a warning
    on stderr); ``key`` itself; else the key in ``key_file`` or `default_key_file`, made there
    when the file does not exist. Raises ``SecretFileError`` naming a file it cannot read."""
    if insecure:
        print(
            "harnessrl engine: --insecure: serving without an API key; anyone who reaches the "
            "port may generate, load weights and pause generation",
            file=sys.stderr,
            flush=True,
        )
        return "", ""
    if key.strip():
        return key.strip(), "--api-key"
    path = Path(key_file) if key_file else default_key_file()
    secret, _ = ensure_secret(path, "engine API key file")
    return secret, str(path)


def client_key(key_file: str = "") -> str:
    """The key a client sends to an engine: the one in ``key_file``; without one, the key in
    `default_key_file` when that file exists (the key an engine of this user on this machine
    serves with by default), else none. Raises ``SecretFileError`` naming a file it cannot
    read."""
    if key_file:
        return load_api_key(key_file=key_file)
    path = default_key_file()
    return read_secret(path, "engine API key file") if path.is_file() else ""


def key_note(where: str) -> str:
    """What an engine's ready line says about its key (``where``: `serving_key`'s)."""
    if not where:
        return "no API key: open to anyone who reaches it (--insecure)"
    return f"API key required (in {where})"


def api_key_middleware(key: str) -> Any:
    """An aiohttp middleware refusing requests without ``Authorization: Bearer <key>``."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path.startswith(OPEN_PREFIXES):
            return await handler(request)
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return require_key


def auth_headers(key: str) -> dict[str, str]:
    """Request headers that carry ``key`` ({} for no key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}
