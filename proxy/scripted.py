"""A scripted engine: a real aiohttp server speaking SGLang's native API with chosen replies.

It stands in for an inference engine wherever the model's output must be known in advance
(proxy, actor and assembler tests): ``/generate`` answers from a *script* — a queue of replies
(token ids, or text encoded with a tokenizer, with optional log-probs), or a callable
``(input_ids, request) -> reply`` — and can answer HTTP 500/503, delay, or be aborted, paused
and "updated" like a real engine. Everything else is the same subset of the API the proxy uses:
``/health``, ``/model_info``, ``/server_info`` (and their older ``/get_*`` names),
``/get_weight_version``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk`` and the weight-update group calls.

In-process::

    async with ScriptedEngine(tokenizer, ["Hello!", {"ids": [5, 6, 2], "logprobs": [...]}]) as eng:
        client = EngineClient(eng.url)

As a subprocess (prints ``scripted engine ready: URL`` once listening)::

    python -m harnessrl.proxy.scripted --port 0 --script replies.json [--tokenizer tiny-1m]

where ``replies.json`` is a list of replies or ``{"tokenizer": ..., "replies": [...],
"default": reply, "weight_version": N}``. A reply is a string (text), a list of ints (ids) or an
object with the fields of :class:`Reply`.

Semantics that tests rely on: text replies get the tokenizer's end-of-turn id appended (unless
``eos`` is false); ``max_new_tokens`` truncates (finish ``length``); a stop id ends the reply
(finish ``stop``, the stop id included, like SGLang with ``no_stop_trim``); an aborted call
returns finish ``abort`` with no tokens; ``cached_tokens`` is the longest prefix shared with an
earlier call's input+output (a prefix cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from harnessrl.proxy.engine.auth import api_key_middleware
from harnessrl.proxy.engine.requests import weight_version_spans

__all__ = ["Reply", "ScriptedEngine", "main"]


@dataclass
class Reply:
    """One scripted answer to ``/generate``."""

    ids: list[int] | None = None
    """Token ids to return (takes precedence over ``text``)."""
    text: str | None = None
    """Text to encode with the engine's tokenizer."""
    logprobs: list[float] | None = None
    """Log-prob per id; default ``-0.1 * (1 + i % 5)``."""
    eos: bool = True
    """Append the end-of-turn id to ``text`` replies."""
    finish: str | None = None
    """Force a finish reason (``stop``/``length``/``abort``); default from the ids."""
    status: int = 200
    """Answer with this HTTP status instead (500, 503, 400...)."""
    error: str = "scripted error"
    """Message of a non-200 answer."""
    delay: float = 0.0
    """Seconds to wait before answering (abortable)."""
    set_version: int | None = None
    """Change the engine's weight version while this call runs (a mid-call swap)."""
    raw: dict[str, Any] | None = None
    """Answer with exactly this JSON body (to imitate other engines' quirks)."""

    @classmethod
    def coerce(cls, item: Any) -> Reply:
        if isinstance(item, Reply):
            return item
        if isinstance(item, str):
            return cls(text=item)
        if isinstance(item, dict):
            return cls(**item)
        if isinstance(item, Sequence):
            return cls(ids=[int(i) for i in item])
        raise TypeError(f"not a scripted reply: {item!r}")


ScriptFn = Callable[[list[int], dict[str, Any]], Any]


@dataclass
class _InFlight:
    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class ScriptedEngine:
    """An aiohttp server that answers SGLang's native API from a script."""

    def __init__(
        self,
        tokenizer: Any = None,
        script: Sequence[Any] | ScriptFn = (),
        *,
        default: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
        weight_version: int = 0,
        model_path: str = "scripted",
        eos_ids: Sequence[int] | None = None,
        api_key: str = "",
        context_length: int = 0,
    ) -> None:
        if isinstance(tokenizer, str | Path):
            from harnessrl.common.models import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.fn: ScriptFn | None = script if callable(script) else None
        self.queue: deque[Any] = deque() if callable(script) else deque(script)
        self.default = default
        self.host, self.port = host, port
        self.weight_version = weight_version
        self.model_path = model_path
        self.context_length = context_length
        """Reported as ``context_length`` by ``/server_info`` (0: not reported)."""
        if eos_ids is None and tokenizer is not None:
            from harnessrl.common.models import eos_token_ids

            eos_ids = eos_token_ids(tokenizer)
        self.eos_ids = list(eos_ids or [])
        self.api_key = api_key
        """With a key, requests without ``Authorization: Bearer KEY`` get 401 (``/health``
        excepted), as with SGLang's ``--api-key``."""
        self.healthy = True
        self.paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.requests: list[dict[str, Any]] = []
        """Every ``/generate`` body received, in order."""
        self.control: list[tuple[str, dict[str, Any]]] = []
        """Every control call received (path, body), in order."""
        self._seen: deque[np.ndarray] = deque(maxlen=64)
        self._inflight: dict[str, _InFlight] = {}
        self._runner: web.AppRunner | None = None
        self._failures: dict[str, deque[int]] = {}

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def fail(self, path: str, status: int = 503, times: int = 1) -> None:
        """Answer the next ``times`` requests to ``path`` with HTTP ``status``."""
        self._failures.setdefault(path, deque()).extend([status] * times)

    @web.middleware
    async def _inject_failures(self, request: web.Request, handler: Any) -> web.StreamResponse:
        pending = self._failures.get(request.path)
        if pending:
            return _error(pending.popleft(), f"scripted failure of {request.path}")
        return await handler(request)

    def app(self) -> web.Application:
        guard = [api_key_middleware(self.api_key)] if self.api_key else []
        app = web.Application(
            client_max_size=256 * 1024 * 1024, middlewares=[*guard, self._inject_failures]
        )
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/get_weight_version", self._version)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/update_weights_from_disk", self._update)
        app.router.add_post("/update_weights_from_distributed", self._update)
        app.router.add_post("/init_weights_update_group", self._ok)
        app.router.add_post("/destroy_weights_update_group", self._ok)
        return app

    async def start(self) -> ScriptedEngine:
        """Listen (on ``port``; 0 picks a free one, kept for a later restart)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        """Stop listening (in-flight calls are aborted); ``start()`` again reuses the port."""
        for f in list(self._inflight.values()):
            f.aborted.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedEngine:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # -- script -----------------------------------------------------------------------------

    def push(self, *items: Any) -> None:
        """Append replies to the queue."""
        self.queue.extend(items)

    def abort_all(self) -> None:
        for f in self._inflight.values():
            f.aborted.set()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("a text reply needs a tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def _next(self, input_ids: list[int], body: dict[str, Any]) -> Reply | None:
        if self.fn is not None:
            item = self.fn(input_ids, body)
            if inspect.isawaitable(item):
                item = await item
        elif self.queue:
            item = self.queue.popleft()
        else:
            item = self.default
        return None if item is None else Reply.coerce(item)

    def _tokens(self, reply: Reply, sp: dict[str, Any]) -> tuple[list[int], list[float], str]:
        if reply.ids is not None:
            ids = list(reply.ids)
        else:
            ids = self.encode(reply.text or "")
            if reply.eos and self.eos_ids and reply.finish is None:
                ids.append(self.eos_ids[0])
        lps = list(reply.logprobs) if reply.logprobs is not None else []
        lps += [-0.1 * (1 + i % 5) for i in range(len(lps), len(ids))]
        stops = set(sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos"):
            stops.update(self.eos_ids)
        finish = "length"
        for i, t in enumerate(ids):
            if t in stops:
                ids, finish = ids[: i + 1], "stop"
                break
        limit = sp.get("max_new_tokens")
        if limit is not None and len(ids) > int(limit):
            ids, finish = ids[: int(limit)], "length"
        return ids, lps[: len(ids)], reply.finish or finish

    def _cached(self, input_ids: list[int]) -> int:
        """Longest prefix shared with one of the last calls' input+output (a prefix cache)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        best = 0
        for seq in self._seen:
            n = min(len(seq), len(ids))
            diff = np.flatnonzero(seq[:n] != ids[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        return best

    # -- handlers ---------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.Response:
        t0 = time.monotonic()
        body = await request.json()
        self.requests.append(body)
        input_ids = [int(i) for i in body.get("input_ids") or []]
        sp = body.get("sampling_params") or {}
        rid = str(body.get("rid") or f"scripted-{len(self.requests)}")
        flight = self._inflight[rid] = _InFlight(rid)
        try:
            await self._wait_resumed(flight)
            v_start = self.weight_version
            reply = None if flight.aborted.is_set() else await self._next(input_ids, body)
            if reply is None and not flight.aborted.is_set():
                return _error(500, "scripted engine: script exhausted")
            if reply is not None and reply.delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(flight.aborted.wait(), reply.delay)
            if flight.aborted.is_set():
                return self._reply(rid, input_ids, [], [], "abort", v_start, t0)
            assert reply is not None
            if reply.status != 200:
                return _error(reply.status, reply.error)
            if reply.raw is not None:
                return web.json_response(reply.raw)
            if reply.set_version is not None:
                self.weight_version = reply.set_version
            ids, lps, finish = self._tokens(reply, sp)
            return self._reply(rid, input_ids, ids, lps, finish, v_start, t0)
        finally:
            self._inflight.pop(rid, None)

    async def _wait_resumed(self, flight: _InFlight) -> None:
        while self.paused and not flight.aborted.is_set():
            waiter = asyncio.ensure_future(self._resumed.wait())
            aborter = asyncio.ensure_future(flight.aborted.wait())
            await asyncio.wait({waiter, aborter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            aborter.cancel()

    def _reply(
        self,
        rid: str,
        input_ids: list[int],
        ids: list[int],
        lps: list[float],
        finish: str,
        v_start: int,
        t0: float,
    ) -> web.Response:
        if finish == "stop":
            fr: dict[str, Any] = {"type": "stop", "matched": ids[-1] if ids else None}
        elif finish == "length":
            fr = {"type": "length", "length": len(ids)}
        else:
            fr = {"type": "abort", "message": "aborted"}
        cached = self._cached(input_ids)
        self._seen.append(np.asarray(input_ids + ids, dtype=np.int64))
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": fr,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": cached,
            "weight_version": str(self.weight_version),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
            "e2e_latency": time.monotonic() - t0,
        }
        events = [(str(v_start), 0)] if v_start != self.weight_version else []
        meta["weight_versions"] = weight_version_spans(events, str(self.weight_version), len(ids))
        text = ""
        if self.tokenizer is not None and ids:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return web.json_response({"text": text, "output_ids": ids, "meta_info": meta})

    async def _health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            return _error(503, "scripted engine: unhealthy")
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": str(self.weight_version),
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"model_path": self.model_path, "version": "scripted"}
        if self.context_length:
            info["context_length"] = self.context_length
        return web.json_response(info)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.weight_version)})

    async def _json(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()  # (cached: a middleware may have read it already)
        body = json.loads(raw) if raw.strip() else {}
        self.control.append((request.path, body or {}))
        return body or {}

    async def _abort(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("abort_all"):
            self.abort_all()
        elif (f := self._inflight.get(str(body.get("rid")))) is not None:
            f.aborted.set()
        return web.json_response({})

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        self.paused = True
        self._resumed.clear()
        if body.get("mode", "abort") == "abort":
            self.abort_all()
        return web.json_response({})

    async def _continue(self, request: web.Request) -> web.Response:
        await self._json(request)
        self.paused = False
        self._resumed.set()
        return web.json_response({})

    async def _update(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if body.get("abort_all_requests"):
            self.abort_all()
        if body.get("weight_version") is not None:
            self.weight_version = int(body["weight_version"])
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def _ok(self, request: web.Request) -> web.Response:
        await self._json(request)
        return web.json_response({"success": True, "message": "ok"})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


# ---------------------------------------------------------------------------------------------
# subprocess entry point
# ---------------------------------------------------------------------------------------------


def load_script(path: str | Path) -> dict[str, Any]:
    """Read a script file: a list of replies, or an object with ``replies`` and options."""
    data = json.loads(Path(path).read_text())
    return {"replies": data} if isinstance(data, list) else dict(data)


async def _serve(args: argparse.Namespace) -> None:
    spec = load_script(args.script) if args.script else {}
    tok = args.tokenizer or spec.get("tokenizer")
    eng = ScriptedEngine(
        tok,
        spec.get("replies", []),
        default=spec.get("default"),
        host=args.host,
        port=args.port,
        weight_version=int(spec.get("weight_version", 0)),
    )
    await eng.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"scripted engine ready: {eng.url}", flush=True)
    await stop.wait()
    await eng.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m harnessrl.proxy.scripted",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=0, help="port (0 = free port)")
    p.add_argument("--script", default="", help="JSON file of replies")
    p.add_argument("--tokenizer", default="", help="tokenizer for text replies (tiny-1m, folder)")
    args = p.parse_args(argv)
    from harnessrl.common.aio import run

    run(_serve(args))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
