"""Client and router for any engine speaking SGLang's native HTTP API (docs/design.md).

``EngineClient(url)`` talks to one engine; ``EngineRouter([urls])`` spreads calls over several
with the same ``generate`` signature. The proxy's code path is identical for a production SGLang
server, the embedded CPU engine and the scripted test engine.

What must stay true:

* Every ``/generate`` asks for ``return_logprob``, ``no_stop_trim`` and
  ``skip_special_tokens: false``: the proxy needs every sampled id (the stop token included)
  with its log-prob, and text that decodes exactly those ids.
* ``GenerateResult.output_ids`` and ``.logprobs`` have the same length, or the call fails: a
  misaligned log-prob would silently corrupt importance weights downstream.
* Errors say whether a retry can help: ``EngineUnavailable`` (refused connection, timeout, 503,
  paused: retry later or elsewhere), ``EngineBadRequest`` (400, e.g. context too long: never
  retry, answer 400 to the harness with the engine's message), ``EngineError`` (anything else).
* Only idempotent reads (health, model info, weight version) are retried inside the client;
  ``generate`` is retried by the router on *another* engine only when the engine refused it,
  and on the same engine only when a weight swap aborted it before any token was sampled.
* A cancelled ``generate`` (the harness went away) sends ``/abort_request`` for its rid, so the
  engine stops spending compute on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import numpy as np
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from harnessrl.common import metrics

log = logging.getLogger("harnessrl.proxy.sglang")

__all__ = [
    "EngineBadRequest",
    "EngineClient",
    "EngineError",
    "EngineRouter",
    "EngineUnavailable",
    "GenerateResult",
    "parse_version",
]

# msgspec's JSON is several times faster than the stdlib's on long id lists
_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_JSON_HEADERS = {"Content-Type": "application/json"}

# Forced on every /generate: see the module docstring.
FORCED_SAMPLING = {"skip_special_tokens": False, "no_stop_trim": True}


class IdsJson:
    """The JSON list of the ``input_ids`` last sent for each key (a rollout), so that a call
    whose ids extend the previous call's (an agent loop: each prompt is the last prompt, its
    output and the new turn) converts and encodes only the new ids, not the whole context again
    (``tolist`` + encode of 14k ids took 0.29 ms of a call's CPU, growing with the context).

    The previous ids are compared (a memcmp) before their text is reused, so a prompt that does
    not extend them (a fork, an edit, a compaction) is encoded whole: the bytes sent are always
    those of ``ids``. Arrays are kept by reference (the proxy never changes an id array it
    built); keys are dropped by ``forget`` and least recently used first past ``max_bytes``."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._last: OrderedDict[str, tuple[np.ndarray, bytes]] = OrderedDict()
        self._bytes = 0
        self.reused = 0
        """Encodes that reused the previous text of their key (for tests and profiling)."""

    def encode(self, input_ids: Sequence[int], key: str | None = None) -> msgspec.Raw:
        """``input_ids`` as a JSON list (``[1,2,3]``), spliced by msgspec into the payload."""
        ids = input_ids if isinstance(input_ids, np.ndarray) else np.asarray(input_ids, np.int64)
        prev = self._last.pop(key, None) if key else None
        if prev is not None:
            self._bytes -= _entry_bytes(prev)
        n = len(prev[0]) if prev is not None else 0
        if prev is not None and 0 < n <= len(ids) and np.array_equal(ids[:n], prev[0]):
            body = prev[1]
            if len(ids) > n:
                body += b"," + _json_encode(ids[n:].tolist())[1:-1]
            self.reused += 1
        else:
            body = _json_encode(ids.tolist())[1:-1]
        if key and len(ids):
            self._last[key] = entry = (ids, body)
            self._bytes += _entry_bytes(entry)
            while self._bytes > self.max_bytes and len(self._last) > 1:
                self._bytes -= _entry_bytes(self._last.popitem(last=False)[1])
        return msgspec.Raw(b"[" + body + b"]")

    def forget(self, key: str) -> None:
        prev = self._last.pop(key, None)
        if prev is not None:
            self._bytes -= _entry_bytes(prev)


def _entry_bytes(entry: tuple[np.ndarray, bytes]) -> int:
    return entry[0].nbytes + len(entry[1])


M_REQUESTS = metrics.counter(
    "hrl_proxy_engine_requests_total", "Generate calls by engine and outcome", ("engine", "outcome")
)
M_HEALTHY = metrics.gauge("hrl_proxy_engine_healthy", "1 if the engine is in rotation", ("engine",))
M_OUTSTANDING = metrics.gauge(
    "hrl_proxy_engine_outstanding", "Generate calls in flight per engine", ("engine",)
)
M_EJECTIONS = metrics.counter(
    "hrl_proxy_engine_ejections_total", "Times an engine was taken out of rotation", ("engine",)
)
M_SWAP_RETRIES = metrics.counter(
    "hrl_proxy_engine_swap_retries_total",
    "Generate calls retried because a weight swap aborted them before the first token",
)


# ---------------------------------------------------------------------------------------------
# errors and results
# ---------------------------------------------------------------------------------------------


class EngineError(RuntimeError):
    """An engine call failed in a way a retry is not known to fix."""

    def __init__(self, message: str, *, url: str = "", status: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.status = status


class EngineUnavailable(EngineError):
    """The engine cannot serve now (down, refused, timed out, 503, paused): retry later/elsewhere."""

    def __init__(self, message: str, *, url: str = "", status: int = 0, retry_after: float = 1.0):
        super().__init__(message, url=url, status=status)
        self.retry_after = retry_after


class EngineBadRequest(EngineError):
    """The engine rejected the request (400: context too long, bad parameter). Never retry."""


def parse_version(value: Any) -> int:
    """SGLang reports ``weight_version`` as a string; ours are ints. Non-numeric -> -1."""
    if isinstance(value, bool) or value is None:
        return -1
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return -1


@dataclass
class GenerateResult:
    """One ``/generate`` reply, normalised."""

    output_ids: list[int]
    """Sampled ids, including the stop token when generation stopped on one."""
    logprobs: list[float]
    """Log-prob of each output id (float32 values), same length as ``output_ids``."""
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache."""
    weight_version_start: int = -1
    """Version of the weights the call started under: the first of SGLang's
    ``meta_info.weight_versions`` spans (versions over output-token ranges), which differs from
    the end version when the weights changed while the call ran."""
    weight_version_end: int = -1
    """``meta_info.weight_version``: the version at the end of the call."""
    text: str = ""
    """Engine's decoding of ``output_ids`` (special tokens kept, stop not trimmed)."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    """The engine's JSON reply as received."""
    engine: str = ""
    """URL of the engine that served the call."""
    abort_message: str = ""
    """The engine's message for an ``abort`` finish (empty otherwise)."""

    @classmethod
    def from_json(cls, body: dict[str, Any], url: str = "") -> GenerateResult:
        meta = body.get("meta_info") or {}
        fr = meta.get("finish_reason")
        ftype = fr.get("type") if isinstance(fr, dict) else fr
        ftype = ftype if ftype in ("stop", "length", "abort") else "abort"
        lps = meta.get("output_token_logprobs") or []
        ids = body.get("output_ids")
        if ids is None:
            ids = [int(x[1]) for x in lps]
        if len(lps) != len(ids):
            raise EngineError(
                f"engine {url} returned {len(ids)} output ids but {len(lps)} log-probs "
                "(was return_logprob honoured?)",
                url=url,
            )
        # a token the engine gave no log-prob is NaN, never 0.0 (log mu = 0 would train it as if
        # the engine had been certain of it): the learner leaves such tokens out and counts them
        logprobs = np.asarray(
            [np.nan if x[0] is None else x[0] for x in lps], dtype=np.float32
        ).tolist()
        end = parse_version(meta.get("weight_version"))
        start = end
        spans = meta.get("weight_versions")
        if isinstance(spans, list) and spans and isinstance(spans[0], dict):
            start = parse_version(spans[0].get("version"))
        elif "weight_version_start" in meta:  # harnessrl engines before weight_versions
            start = parse_version(meta["weight_version_start"])
        return cls(
            output_ids=[int(i) for i in ids],
            logprobs=logprobs,
            finish_reason=ftype,
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            completion_tokens=int(meta.get("completion_tokens") or len(ids)),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version_start=start,
            weight_version_end=end,
            text=body.get("text") or "",
            raw=body,
            engine=url,
            abort_message=str(fr.get("message") or "") if isinstance(fr, dict) else "",
        )


def _error_message(body: Any, fallback: str) -> str:
    """The engine's own words: SGLang answers ``{"error": {"message": ...}}`` or ``{"message"}``."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    if isinstance(body, str) and body.strip():
        return body.strip()[:2000]
    return fallback


# ---------------------------------------------------------------------------------------------
# one engine
# ---------------------------------------------------------------------------------------------


class EngineClient:
    """Async client of one engine speaking SGLang's native API.

    ``timeout`` bounds one ``generate`` (long: an agent turn may sample thousands of tokens);
    ``control_timeout`` bounds every other call. ``api_key`` (SGLang's ``--api-key``) goes
    out as ``Authorization: Bearer KEY`` on every call. Use as
    ``async with EngineClient(url) as c`` or call ``close()``.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 3600.0,
        connect_timeout: float = 5.0,
        control_timeout: float = 30.0,
        retries: int = 3,
        retry_backoff: float = 0.2,
        max_connections: int = 1024,
        api_key: str = "",
    ) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.control_timeout = control_timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._aborts: set[asyncio.Task] = set()
        self.ids_json = IdsJson()
        """The last ``input_ids`` text sent per key (``generate``'s ``key``)."""
        self._old_info = False
        """The engine answers only ``/get_model_info`` and ``/get_server_info`` (older SGLang)."""

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=None),
                headers=self.headers,
            )
        return self._session

    def forget(self, key: str) -> None:
        """Drop what is kept for ``key`` (a finished rollout): its last ids' text."""
        self.ids_json.forget(key)

    async def close(self) -> None:
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- transport ------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, payload: Any = None, *, timeout: float | None = None
    ) -> Any:
        """One HTTP call; maps every failure to an ``EngineError`` subclass."""
        total = self.control_timeout if timeout is None else timeout
        to = aiohttp.ClientTimeout(total=total, sock_connect=min(self.connect_timeout, total))
        where = f"{method} {self.url}{path}"
        try:
            async with self._sess().request(
                method,
                self.url + path,
                data=None if payload is None else _json_encode(payload),
                headers=_JSON_HEADERS if payload is not None else None,
                timeout=to,
            ) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
        except TimeoutError:
            raise EngineUnavailable(f"{where} timed out after {total:g}s", url=self.url) from None
        except aiohttp.ClientError as e:  # refused, reset, DNS, server disconnected
            raise EngineUnavailable(f"{where} failed: {e!r}", url=self.url) from None
        body: Any = raw.decode("utf-8", "replace")
        with contextlib.suppress(msgspec.DecodeError):
            body = _json_decode(raw) if raw else None
        if status == 200:
            return body
        msg = _error_message(body, f"HTTP {status}")
        if status == 400:
            raise EngineBadRequest(msg, url=self.url, status=status)
        if status in (429, 502, 503, 504):
            try:
                ra = float(retry_after) if retry_after else 1.0
            except ValueError:
                ra = 1.0
            raise EngineUnavailable(
                f"{where}: HTTP {status}: {msg}", url=self.url, status=status, retry_after=ra
            )
        if status == 404:
            msg = f"{msg} (is {self.url} an SGLang-compatible engine?)"
        if status == 401:
            sent = "refused the API key sent" if self.headers else "requires an API key"
            msg = f"{msg}: the engine {sent} (engine_api_key_file)"
        raise EngineError(f"{where}: HTTP {status}: {msg}", url=self.url, status=status)

    async def _idempotent(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        retries: int | None = None,
        timeout: float | None = None,
    ) -> Any:
        """``_request`` retried on ``EngineUnavailable`` (only for calls safe to repeat)."""
        async for attempt in self._retrying(retries, EngineUnavailable):
            with attempt:
                return await self._request(method, path, payload, timeout=timeout)
        raise AssertionError("unreachable")

    def _retrying(self, retries: int | None, on: type[EngineError]) -> AsyncRetrying:
        """``retries`` (default ``self.retries``) more attempts after an ``on`` error, waits
        doubling from ``retry_backoff`` s; the last error is raised."""
        return AsyncRetrying(
            stop=stop_after_attempt((self.retries if retries is None else retries) + 1),
            wait=wait_exponential(multiplier=self.retry_backoff),
            retry=retry_if_exception_type(on),
            reraise=True,
        )

    # -- generation -----------------------------------------------------------------------

    def generate_payload(
        self, input_ids: Sequence[int], sampling: dict[str, Any], rid: str, key: str | None = None
    ) -> dict[str, Any]:
        """The ``/generate`` body. With a ``key`` the ids are pre-encoded JSON (``IdsJson``:
        only the ids new since the key's last call are encoded), else a list."""
        ids: Any
        if key:
            ids = self.ids_json.encode(input_ids, key)
        else:
            ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(map(int, input_ids))
        return {
            "input_ids": ids,
            "sampling_params": {**sampling, **FORCED_SAMPLING},
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
            "rid": rid,
        }

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: dict[str, Any],
        rid: str | None = None,
        *,
        key: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Sample a completion of ``input_ids``. Raises an ``EngineError`` subclass on failure.

        ``key`` (the rollout id) lets the ids of the key's last call be reused as text
        (``IdsJson``); ``forget(key)`` drops them.

        An abort with ``status_code`` 400 in its finish reason (SGLang's way of refusing a
        too-long input inside a 200 reply) is raised as ``EngineBadRequest``.
        """
        rid = rid or uuid.uuid4().hex
        payload = self.generate_payload(input_ids, sampling, rid, key)
        to = self.timeout if timeout is None else timeout
        try:
            body = await self._request("POST", "/generate", payload, timeout=to)
        except asyncio.CancelledError:
            self._abort_in_background(rid)
            raise
        except EngineUnavailable as e:
            if "timed out" in str(e):
                self._abort_in_background(rid)
            M_REQUESTS.labels(engine=self.url, outcome="unavailable").inc()
            raise
        except EngineBadRequest:
            M_REQUESTS.labels(engine=self.url, outcome="bad_request").inc()
            raise
        except EngineError:
            M_REQUESTS.labels(engine=self.url, outcome="error").inc()
            raise
        if isinstance(body, list):  # batch form: we only ever send one
            body = body[0] if body else {}
        if not isinstance(body, dict):
            raise EngineError(f"engine {self.url} sent a non-JSON /generate reply", url=self.url)
        fr = (body.get("meta_info") or {}).get("finish_reason")
        if isinstance(fr, dict) and fr.get("type") == "abort" and fr.get("status_code") == 400:
            M_REQUESTS.labels(engine=self.url, outcome="bad_request").inc()
            raise EngineBadRequest(
                str(fr.get("message") or "bad request"), url=self.url, status=400
            )
        res = GenerateResult.from_json(body, self.url)
        M_REQUESTS.labels(engine=self.url, outcome=res.finish_reason).inc()
        return res

    def _abort_in_background(self, rid: str) -> None:
        async def go() -> None:
            with contextlib.suppress(Exception):
                await self._request("POST", "/abort_request", {"rid": rid}, timeout=5.0)

        task = asyncio.get_running_loop().create_task(go())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    # -- control --------------------------------------------------------------------------

    async def health(self, *, retries: int | None = None, timeout: float | None = None) -> bool:
        """Whether ``GET /health`` answers 200 (never raises)."""
        try:
            async for attempt in self._retrying(retries, EngineError):
                with attempt:
                    await self._request("GET", "/health", timeout=timeout or self.control_timeout)
        except EngineError:
            return False
        return True

    async def _info(
        self, kind: str, *, retries: int | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """``GET /<kind>_info``, or ``/get_<kind>_info`` on an engine without it (SGLang
        releases before the rename answer only the old path; the current ones answer both but
        log a deprecation warning for every call to the old one)."""
        paths = [f"/{kind}_info", f"/get_{kind}_info"]
        if self._old_info:
            paths.reverse()
        for i, path in enumerate(paths):
            try:
                body = await self._idempotent("GET", path, retries=retries, timeout=timeout)
            except EngineError as e:
                if e.status == 404 and i == 0:
                    self._old_info = not self._old_info
                    continue
                raise
            return body if isinstance(body, dict) else {}
        raise AssertionError("unreachable")

    async def weight_version(
        self, *, retries: int | None = None, timeout: float | None = None
    ) -> int:
        """The engine's current weight version (``weight_version`` of ``GET /model_info``;
        SGLang has no other endpoint for it; -1 if not numeric)."""
        info = await self._info("model", retries=retries, timeout=timeout)
        return parse_version(info.get("weight_version"))

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (model path, tokenizer path, weight version, ...)."""
        return await self._info("model")

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info`` (the server's resolved arguments, ``context_length`` and
        ``max_req_input_len`` among them, and live scheduler state)."""
        return await self._info("server")

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | None = None,
        *,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Load weights from a folder the engine can read; the version travels with the call."""
        payload: dict[str, Any] = {
            "model_path": model_path,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        body = await self._request("POST", "/update_weights_from_disk", payload, timeout=timeout)
        return self._check_success(body, "update_weights_from_disk")

    async def init_weights_update_group(self, **params: Any) -> dict[str, Any]:
        """``POST /init_weights_update_group`` (master_address, master_port, rank_offset, ...)."""
        body = await self._request("POST", "/init_weights_update_group", params, timeout=600.0)
        return self._check_success(body, "init_weights_update_group")

    async def update_weights_from_distributed(self, **params: Any) -> dict[str, Any]:
        """``POST /update_weights_from_distributed`` (names, dtypes, shapes, weight_version...)."""
        if "weight_version" in params and params["weight_version"] is not None:
            params["weight_version"] = str(params["weight_version"])
        body = await self._request(
            "POST", "/update_weights_from_distributed", params, timeout=600.0
        )
        return self._check_success(body, "update_weights_from_distributed")

    def _check_success(self, body: Any, what: str) -> dict[str, Any]:
        body = body if isinstance(body, dict) else {}
        if body.get("success") is False:
            raise EngineError(
                f"{what} on {self.url} failed: {body.get('message', '')}", url=self.url
            )
        return body

    async def pause(self, mode: str = "abort") -> None:
        """``POST /pause_generation``: ``abort`` | ``retract`` | ``in_place``."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """``POST /continue_generation``."""
        await self._request("POST", "/continue_generation", {})

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid (``None``: every request)."""
        payload = {"rid": rid} if rid is not None else {"rid": "", "abort_all": True}
        await self._request("POST", "/abort_request", payload)


# ---------------------------------------------------------------------------------------------
# several engines
# ---------------------------------------------------------------------------------------------


@dataclass
class EngineSlot:
    """Router-side state of one engine."""

    url: str
    client: EngineClient
    healthy: bool = True
    outstanding: int = 0
    served: int = 0
    fails: int = 0
    oks: int = 0
    version: int = -1
    why: str = ""
    """Why it was last taken out of rotation."""

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "served": self.served,
            "version": self.version,
        }


class EngineRouter:
    """Spreads ``generate`` over engines: sticky per key, else least outstanding requests.

    * Sticky: calls with the same ``key`` (the rollout id) go to the same engine, so its prefix
      cache holds the conversation; a key moves only when its engine leaves rotation or has
      ``max_imbalance`` more requests in flight than the least busy one.
    * Health: a background task probes ``/health`` every ``health_interval`` s; ``eject_after``
      consecutive failures take an engine out of rotation, ``readmit_after`` successes put it
      back. A refused ``generate`` ejects at once and the call moves to another engine.
    * When no engine is in rotation, a call waits up to ``wait_healthy_s`` for one;
      ``down_since`` says since when none has been (what a rollout ends on, see
      ``harnessrl.actors.rollout``).
    * An ``abort`` with no tokens that this router did not ask for, while the engine's weight
      version changed (a swap aborted it before prefill), is retried, ``swap_retries`` times.
    """

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        health_interval: float = 2.0,
        health_timeout: float = 5.0,
        eject_after: int = 2,
        readmit_after: int = 1,
        max_imbalance: int = 16,
        sticky_keys: int = 65536,
        wait_healthy_s: float = 10.0,
        swap_retries: int = 3,
        swap_wait_s: float = 10.0,
        client_kw: dict[str, Any] | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EngineRouter needs at least one engine URL")
        kw = client_kw or {}
        self.slots = [EngineSlot(u.rstrip("/"), EngineClient(u, **kw)) for u in urls]
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.eject_after = eject_after
        self.readmit_after = readmit_after
        self.max_imbalance = max_imbalance
        self.sticky_keys = sticky_keys
        self.wait_healthy_s = wait_healthy_s
        self.swap_retries = swap_retries
        self.swap_wait_s = swap_wait_s
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._inflight: dict[str, tuple[EngineSlot, str]] = {}
        self._aborted: set[str] = set()
        self._readmitted = asyncio.Event()
        self._checker: asyncio.Task | None = None
        self.down_since: float | None = None
        """``time.monotonic()`` when the last engine in rotation left it; None while one is."""
        for s in self.slots:
            M_HEALTHY.labels(engine=s.url).set(1)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.slots]

    async def __aenter__(self) -> EngineRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        """One health sweep (learns versions, ejects dead engines), then the background checker."""
        await self.check_once(initial=True)
        if self._checker is None and self.health_interval > 0:
            self._checker = asyncio.get_running_loop().create_task(self._check_loop())

    def forget(self, key: str) -> None:
        """Drop what the engines' clients keep for ``key`` (a finished rollout)."""
        for slot in self.slots:
            slot.client.forget(key)

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
        await asyncio.gather(*(s.client.close() for s in self.slots))

    def status(self) -> list[dict[str, Any]]:
        return [s.snapshot() for s in self.slots]

    # -- choosing ---------------------------------------------------------------------------

    def pick(self, key: str | None = None, exclude: set[str] | None = None) -> EngineSlot | None:
        """The engine for a call: the key's sticky engine if usable, else the least busy."""
        usable = [s for s in self.slots if s.healthy and (not exclude or s.url not in exclude)]
        if not usable:
            return None
        least = min(usable, key=lambda s: (s.outstanding, s.served))
        if key is not None:
            url = self._sticky.get(key)
            for s in usable:
                if s.url == url and s.outstanding <= least.outstanding + self.max_imbalance:
                    self._sticky.move_to_end(key)
                    return s
            self._sticky[key] = least.url
            self._sticky.move_to_end(key)
            while len(self._sticky) > self.sticky_keys:
                self._sticky.popitem(last=False)
        return least

    async def _acquire(self, key: str | None, exclude: set[str]) -> EngineSlot:
        deadline = time.monotonic() + self.wait_healthy_s
        while True:
            slot = self.pick(key, exclude)
            if slot is not None:
                return slot
            if exclude and any(s.healthy for s in self.slots):
                exclude.clear()  # every usable engine was tried once: start over
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(
                    f"no healthy engine among {self.urls} (waited {self.wait_healthy_s:g}s)",
                    retry_after=max(1.0, self.health_interval),
                )
            self._readmitted.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._readmitted.wait(), min(left, self.health_interval))

    # -- generation -------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: dict[str, Any],
        rid: str | None = None,
        *,
        key: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Like ``EngineClient.generate``, on the engine chosen for ``key``."""
        rid = rid or uuid.uuid4().hex
        tried: set[str] = set()
        swaps = refusals = 0
        try:
            while True:
                slot = await self._acquire(key, tried)
                attempt_rid = rid if swaps == refusals == 0 else f"{rid}-{swaps + refusals}"
                self._inflight[rid] = (slot, attempt_rid)
                before = slot.version
                slot.outstanding += 1
                M_OUTSTANDING.labels(engine=slot.url).set(slot.outstanding)
                try:
                    res = await slot.client.generate(
                        input_ids, sampling, attempt_rid, key=key, timeout=timeout
                    )
                except EngineUnavailable as e:
                    refusals += 1
                    tried.add(slot.url)
                    self._eject(slot, f"generate: {e}")
                    if refusals > 2 * len(self.slots):
                        raise
                    continue
                finally:
                    slot.outstanding -= 1
                    M_OUTSTANDING.labels(engine=slot.url).set(slot.outstanding)
                slot.served += 1
                if res.weight_version_end >= 0:
                    slot.version = res.weight_version_end
                if (
                    res.finish_reason == "abort"
                    and not res.output_ids
                    and rid not in self._aborted
                    and swaps < self.swap_retries
                    and await self._swap_happened(slot, res, before)
                ):
                    swaps += 1
                    M_SWAP_RETRIES.inc()
                    log.info("call %s aborted by a weight swap on %s; retrying", rid, slot.url)
                    continue
                res.engine = slot.url
                return res
        finally:
            self._inflight.pop(rid, None)
            self._aborted.discard(rid)

    async def _swap_happened(self, slot: EngineSlot, res: GenerateResult, before: int) -> bool:
        """Whether the engine's weights changed around an abort (waiting up to swap_wait_s)."""
        if res.weight_version_start != res.weight_version_end:
            return True
        base = before if before >= 0 else res.weight_version_end
        if base >= 0 and res.weight_version_end >= 0 and res.weight_version_end != base:
            return True
        deadline = time.monotonic() + self.swap_wait_s
        while time.monotonic() < deadline:
            try:
                v = await slot.client.weight_version()
            except EngineError:
                v = -1
            if v >= 0 and base >= 0 and v != base:
                slot.version = v
                return True
            await asyncio.sleep(0.05)
        return False

    async def abort(self, rid: str) -> None:
        """Abort a call this router is running (no retry follows it)."""
        entry = self._inflight.get(rid)
        if entry is None:
            return
        self._aborted.add(rid)
        slot, attempt_rid = entry
        with contextlib.suppress(EngineError):
            await slot.client.abort(attempt_rid)

    async def model_info(self) -> dict[str, Any]:
        """Model info from the first engine that answers."""
        return await self.info("model")

    async def server_info(self) -> dict[str, Any]:
        """Server info from the first engine that answers."""
        return await self.info("server")

    async def info(self, kind: str) -> dict[str, Any]:
        """``/<kind>_info`` (``model`` or ``server``) of the first engine that answers."""
        last: Exception | None = None
        for s in sorted(self.slots, key=lambda s: not s.healthy):
            try:
                return await s.client._info(kind)
            except EngineError as e:
                last = e
        raise EngineUnavailable(f"no engine answered {kind}_info: {last}")

    # -- health -----------------------------------------------------------------------------

    def down(self) -> str:
        """Why each engine is out of rotation (one line)."""
        return "; ".join(f"{s.url}: {s.why or 'out of rotation'}" for s in self.slots)

    def _eject(self, slot: EngineSlot, why: str) -> None:
        slot.oks = 0
        slot.fails = max(slot.fails, self.eject_after)
        if slot.healthy:
            slot.healthy = False
            slot.why = why
            M_HEALTHY.labels(engine=slot.url).set(0)
            M_EJECTIONS.labels(engine=slot.url).inc()
            log.warning("engine %s out of rotation: %s", slot.url, why)
            if not any(s.healthy for s in self.slots):
                self.down_since = time.monotonic()

    def _readmit(self, slot: EngineSlot) -> None:
        slot.fails = 0
        if not slot.healthy:
            slot.healthy = True
            slot.why = ""
            self.down_since = None
            M_HEALTHY.labels(engine=slot.url).set(1)
            log.info("engine %s back in rotation", slot.url)
            self._readmitted.set()

    async def _check(self, slot: EngineSlot, initial: bool = False) -> None:
        ok = await slot.client.health(retries=0, timeout=self.health_timeout)
        if ok:
            slot.oks += 1
            slot.fails = 0
            with contextlib.suppress(EngineError):
                slot.version = await slot.client.weight_version(
                    retries=0, timeout=self.health_timeout
                )
            if not slot.healthy and slot.oks >= self.readmit_after:
                self._readmit(slot)
        else:
            slot.oks = 0
            slot.fails += 1
            if slot.healthy and (initial or slot.fails >= self.eject_after):
                self._eject(slot, f"{slot.fails} failed health checks")

    async def check_once(self, initial: bool = False) -> None:
        """Probe every engine once (the background checker calls this); ``initial`` ejects an
        engine on its first failure."""
        await asyncio.gather(*(self._check(s, initial) for s in self.slots))

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_once()
            except Exception as e:  # a checker that dies would freeze rotation forever
                log.warning("health sweep failed: %r", e)
