"""The engines' API key (SGLang's ``--api-key`` convention), for the embedded engine and the
scripted/teacher engine alike.

With a key, every request must carry ``Authorization: Bearer KEY`` or is answered 401
``{"error": "Unauthorized"}`` before any handler runs: generation, weight updates and update
groups, pause/continue/abort, ``/flush_cache``, model and server info. As in SGLang, only
``/health*`` (supervisors and load balancers probe it) and ``/metrics`` (Prometheus) stay open.
The key is compared in constant time. Torch-free.
"""

from __future__ import annotations

import hmac
from typing import Any

from aiohttp import web

from harnessrl.common.files import read_secret

OPEN_PREFIXES = ("/health", "/metrics")
"""Paths answered without the key (as SGLang's ``add_api_key_middleware``)."""


def load_api_key(key: str = "", key_file: str = "") -> str:
    """The engine's key from a file (preferred) or given directly; "" for none. Raises
    ``harnessrl.common.files.SecretFileError`` for an unreadable or empty file."""
    if key_file:
        return read_secret(key_file, "engine API key file")
    return key.strip()


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
