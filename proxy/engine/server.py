"""The HTTP face of the embedded engine: ``EngineServer`` (aiohttp, SGLang's native API) and
``serve`` (the ``harnessrl engine`` loop). The endpoints are listed in ``harnessrl.proxy.engine``'s
docstring; handlers validate, then hand work to the scheduler thread (``Engine``) or the I/O pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import sys
from typing import Any

from aiohttp import web

from harnessrl.common import metrics as m
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine.auth import api_key_middleware, key_note, load_api_key, serving_key
from harnessrl.proxy.engine.requests import (
    BadRequest,
    EngineStopped,
    Overloaded,
    parse_generate,
    weight_version_spans,
)
from harnessrl.proxy.engine.scheduler import Engine, Request
from harnessrl.proxy.engine.weights import _parse_dtype, _WeightGroup

log = logging.getLogger("harnessrl.engine")

ENGINE_NAME = "harnessrl-embedded"


# ---------------------------------------------------------------------------------------------
# HTTP server
# ---------------------------------------------------------------------------------------------


def _error(status: int, message: str) -> web.Response:
    """SGLang's error shape, plus ``success``/``message`` as its update endpoints answer."""
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "InternalError")
    error = {"message": message, "type": kind, "code": status}
    return web.json_response({"error": error, "success": False, "message": message}, status=status)


def _update_error(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))
    except Overloaded as e:
        return _error(503, str(e))
    except EngineStopped as e:
        return _error(503, str(e))
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # never crash the server
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}")


async def _json(request: web.Request, required: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest("a JSON body is required")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"invalid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


_REQUIRED: Any = object()


def _field(body: dict[str, Any], key: str, kind: Any, default: Any = _REQUIRED) -> Any:
    """``body[key]`` checked against ``kind``; null or absent gives ``default`` (or a 400)."""
    v = body.get(key)
    if v is None:
        if default is _REQUIRED:
            raise BadRequest(f"{key} is required")
        return default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BadRequest(f"{key} has the wrong type ({type(v).__name__})")
    return v


def _version_field(body: dict[str, Any]) -> str | None:
    v = body.get("weight_version")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, str | int) or str(v) == "":
        raise BadRequest("weight_version must be a non-empty string")
    return str(v)


class EngineServer:
    """The engine behind an aiohttp server. ``async with EngineServer(cfg) as srv: srv.url``.

    The HTTP server listens before the model is loaded (``/health`` answers 503 until then), so
    supervisors can watch a slow start.
    """

    def __init__(self, cfg: EngineConfig, api_key: str | None = None):
        self.cfg = cfg
        self.api_key = load_api_key(cfg.api_key, cfg.api_key_file) if api_key is None else api_key
        """Every request but ``/health*`` and ``/metrics`` must carry it ("": none). In
        process it is the config's key, if any; ``harnessrl engine`` (`serve`) passes the key
        it is closed with by default (``harnessrl.proxy.engine.auth.serving_key``)."""
        self.engine = Engine(cfg)
        self.ready = False
        self.url = ""
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._groups: dict[str, _WeightGroup] = {}
        self._update_lock = asyncio.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="engine-io")

    async def __aenter__(self) -> EngineServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> EngineServer:
        guard = [api_key_middleware(self.api_key)] if self.api_key else []
        app = web.Application(middlewares=[*guard, _errors], client_max_size=256 << 20)
        get, post = app.router.add_get, app.router.add_post
        get("/health", self._health)
        get("/health_generate", self._health)
        get("/model_info", self._model_info)
        get("/get_model_info", self._model_info)  # SGLang's old name, still served
        get("/server_info", self._server_info)
        get("/get_server_info", self._server_info)  # SGLang's old name, still served
        get("/get_weight_version", self._weight_version)  # ext: gone from SGLang
        get("/metrics", m.metrics_handler)
        post("/generate", self._generate)
        post("/update_weights_from_disk", self._update_from_disk)
        post("/init_weights_update_group", self._init_group)
        post("/update_weights_from_distributed", self._update_from_distributed)
        post("/destroy_weights_update_group", self._destroy_group)
        post("/pause_generation", self._pause)
        post("/continue_generation", self._continue)
        post("/abort_request", self._abort)
        post("/flush_cache", self._flush_cache)
        get("/flush_cache", self._flush_cache)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{host}:{self.port}"
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.load)
        except BaseException:
            await self.stop()
            raise
        self.engine.start()
        self.ready = True
        return self

    async def stop(self) -> None:
        self.ready = False
        await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.stop)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for g in self._groups.values():
            g.close()
        self._groups.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _require_ready(self) -> None:
        if not self.ready or not self.engine.alive:
            raise EngineStopped("the engine is not ready")

    # -- generation -------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        eng = self.engine
        items, batched = parse_generate(body, eng.vocab_size, eng.max_context, eng.tokenizer)
        if len(items) > self.cfg.max_queue:  # could never wait at once: a 503 would be retried
            raise BadRequest(
                f"a batch of {len(items)} prompts can never fit the queue (max_queue "
                f"{self.cfg.max_queue}): send at most {self.cfg.max_queue} per request"
            )
        reqs = [eng.new_request(it) for it in items]
        futures = []
        try:
            for r in reqs:
                futures.append(asyncio.wrap_future(eng.submit(r)))
            done = await asyncio.gather(*futures)
        except BaseException:  # the client went away (or a later submit failed)
            for r in reqs[: len(futures)]:
                if r.finish is None:  # (cancelling wrap_future also cancels r.future)
                    eng.abort(r.rid)
            raise
        replies = [self._reply(r) for r in done]
        return web.json_response(replies if batched else replies[0])

    def _reply(self, req: Request) -> dict[str, Any]:
        ids = list(req.output)
        finish = req.finish or {"type": "abort", "message": "unknown"}
        if finish["type"] == "stop" and not req.params.no_stop_trim and ids:
            ids = ids[:-1]
        tok = self.engine.tokenizer
        text = tok.decode(ids, skip_special_tokens=req.params.skip_special_tokens) if tok else ""
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output),
            "cached_tokens": req.cached_tokens,
            "weight_version": req.version_end,
            "e2e_latency": round(req.finished_at - req.created, 6),
        }
        meta["weight_versions"] = weight_version_spans(
            req.version_events, req.version_end or self.engine.version, len(req.output)
        )
        if req.return_logprob:
            texts: list[str | None] = [None] * len(req.output)
            if req.logprob_text and tok:
                texts = [tok.decode([t], skip_special_tokens=False) for t in req.output]
            meta["output_token_logprobs"] = [
                [lp, t, s] for lp, t, s in zip(req.logprobs, req.output, texts, strict=True)
            ]
            meta["logprobs_truncated"] = req.params.truncated
        return {"text": text, "output_ids": ids, "meta_info": meta}

    # -- info -------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self.ready and self.engine.alive:
            return web.Response(status=200)
        return web.Response(status=503, text="not ready")

    async def _model_info(self, request: web.Request) -> web.Response:
        self._require_ready()
        eng = self.engine
        return web.json_response(
            {
                "model_path": str(eng.folder),
                "tokenizer_path": str(self.cfg.tokenizer or eng.folder) if eng.tokenizer else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": eng.version,
                "model_type": eng.info.get("model_type"),
                "vocab_size": eng.vocab_size,
                "max_context_length": eng.max_context,
                "context_length": eng.max_context,
                "eos_token_ids": list(eng.eos_ids),
                "n_params": eng.info.get("n_params"),
                "dtype": self.cfg.dtype,
                "engine": ENGINE_NAME,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        self._require_ready()
        eng = self.engine
        return web.json_response(
            {
                **json.loads(self.cfg.model_dump_json()),
                "engine": ENGINE_NAME,
                "model_path": str(eng.folder),
                "context_length": eng.max_context,
                "max_running_requests": self.cfg.max_batch_size,
                "weight_version": eng.version,
                "paused": eng.paused,
                "prefix_cache_bytes": eng.cache.nbytes,
                "kv_pool_bytes": eng.pool.nbytes,
            }
        )

    async def _weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.version})

    # -- control ----------------------------------------------------------------------------

    async def _pause(self, request: web.Request) -> web.Response:
        body = await _json(request, required=False)
        self._require_ready()
        mode = _field(body, "mode", str, "abort")
        n = await asyncio.wrap_future(self.engine.pause(mode))
        return web.json_response({"success": True, "message": f"paused ({mode})", "requests": n})

    async def _continue(self, request: web.Request) -> web.Response:
        await _json(request, required=False)
        self._require_ready()
        await asyncio.wrap_future(self.engine.resume())
        return web.json_response({"success": True, "message": "generation continued"})

    async def _abort(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        rid = _field(body, "rid", str, None)
        abort_all = _field(body, "abort_all", bool, False)
        if rid is None and not abort_all:
            raise BadRequest("rid (or abort_all: true) is required")
        n = await asyncio.wrap_future(self.engine.abort(rid, abort_all))
        return web.json_response({"success": True, "aborted": n})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        self._require_ready()
        await asyncio.wrap_future(self.engine.flush_cache())
        return web.json_response({"success": True, "message": "cache flushed"})

    # -- weights ----------------------------------------------------------------------------

    async def _in_pool(self, fn: Any, *args: Any) -> Any:
        """Run blocking work in the I/O pool; it completes even if the client goes away."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        return await asyncio.shield(fut)

    async def _update_from_disk(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        path = _field(body, "model_path", str)
        version = _version_field(body)
        abort_all = _field(body, "abort_all_requests", bool, False)
        _field(body, "flush_cache", bool, True)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest("load_format must be auto or safetensors")
        async with self._update_lock:
            try:
                named = await self._in_pool(self.engine.read_weights, path)
            except (ValueError, OSError) as e:
                return _update_error(f"cannot load weights from {path!r}: {e}")
            fut = self.engine.apply_weights(named, version, abort_all, "disk")
            version = await asyncio.shield(asyncio.wrap_future(fut))
        return web.json_response(
            {
                "success": True,
                "message": f"weights loaded from {path}, version {version}",
                "num_paused_requests": 0,
            }
        )

    async def _init_group(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        addr = _field(body, "master_address", str)
        port = _field(body, "master_port", int)
        rank = _field(body, "rank_offset", int)
        world = _field(body, "world_size", int)
        name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if backend != "gloo":
            return _update_error(f"backend {backend!r} is not available here; use gloo")
        if not (0 < rank < world and 0 < port < 65536):
            return _update_error("need 0 < rank_offset < world_size and a valid master_port")
        if name in self._groups:
            return _update_error(f"group {name!r} already exists")
        timeout = self.cfg.dist_timeout_s
        try:
            group = await self._in_pool(_WeightGroup, addr, port, rank, world, name, timeout)
        except Exception as e:  # a failed rendezvous is the caller's problem
            return _update_error(f"cannot join group {name!r}: {e}")
        self._groups[name] = group
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank}"})

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json(request)
        self._require_ready()
        names = _field(body, "names", list)
        dtypes = _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        name = _field(body, "group_name", str, "weight_update_group")
        version = _version_field(body)
        abort_all = _field(body, "abort_all_requests", bool, False)
        _field(body, "flush_cache", bool, True)
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise BadRequest("names, dtypes and shapes must be non-empty lists of equal length")
        if not all(isinstance(s, list) and all(isinstance(d, int) for d in s) for s in shapes):
            raise BadRequest("shapes must be lists of integers")
        for dt in dtypes:
            _parse_dtype(str(dt))
        group = self._groups.get(name)
        if group is None:
            return _update_error(f"no weight update group {name!r}; call init_weights_update_group")
        async with self._update_lock:
            try:
                # Always receive everything first: the trainer is already broadcasting.
                tensors = await self._in_pool(group.receive, dtypes, shapes)
            except Exception as e:  # a broken group fails this update only
                return _update_error(f"broadcast failed: {e}")
            named = list(zip(names, tensors, strict=True))
            try:
                self.engine.check_weights(named, full=False)
            except ValueError as e:
                return _update_error(str(e))
            fut = self.engine.apply_weights(named, version, abort_all, "distributed")
            version = await asyncio.shield(asyncio.wrap_future(fut))
        return web.json_response(
            {"success": True, "message": f"{len(named)} tensors updated, version {version}"}
        )

    async def _destroy_group(self, request: web.Request) -> web.Response:
        body = await _json(request, required=False)
        name = _field(body, "group_name", str, "weight_update_group")
        group = self._groups.pop(name, None)
        if group is None:
            return _update_error(f"no weight update group {name!r}")
        group.close()
        return web.json_response({"success": True, "message": f"left {name}"})


async def serve(cfg: EngineConfig, stop: asyncio.Event | None = None) -> int:
    """Run the engine until SIGTERM/SIGINT (or ``stop``); print the ready line on stdout."""
    import signal

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        key, where = serving_key(cfg.api_key, cfg.api_key_file, cfg.insecure)
        srv = EngineServer(cfg, api_key=key)
        await srv.start()
    except (ValueError, OSError) as e:
        print(f"harnessrl engine: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        print(
            f"engine ready: {srv.url} (model {srv.engine.folder}, "
            f"weight_version {srv.engine.version}, {key_note(where)})",
            flush=True,
        )
        await stop.wait()
    finally:
        await srv.stop()
    print("engine stopped", flush=True)
    return 0
