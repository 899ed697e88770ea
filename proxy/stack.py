"""The proxy stack, wired once: engine router, chat renderer, tool-call parser, recorder and
``ModelCaller``. ``harnessrl proxy`` and every process that runs rollouts (``harnessrl.actors.rollout``)
open it the same way and only differ in what serves it::

    async with open_proxy_stack(settings, bus, record_buffer=1024) as stack:
        server = ProxyServer(stack.caller, {token: rollout_id}, model_name=settings.model_name)

What must stay true:

* **One wiring.** The sampling comes from the settings; the label rules are `LABEL_RULES` (the
  proxy's defaults plus harnessrl's own ``x-hrl-call-label`` header, which the reference agent
  sends); the context window is ``settings.max_context``, else what the engine's
  ``/model_info`` or ``/server_info`` says (`engine_context`), and an engine that does not say
  (or is down at start) leaves it unchecked rather than failing the start; the tokenizer is
  loaded once per process, off the event loop.
* **The engine's side of each rollout is known.** `TrackingRouter` counts, per rollout (the
  router's sticky key, which ``ModelCaller`` sets to the rollout id), the engine calls that
  succeeded and those that failed for infrastructure reasons (engine unreachable, 5xx,
  unexpected replies), so a rollout can tell a dead engine from the model's failure
  (`EngineOutcome`). A 400 (the request can never succeed), a call the harness abandoned and
  an aborted generation are neither. ``forget(rollout_id)`` drops a finished rollout's entry;
  at most ``max_tracked`` rollouts are kept.
* **Closing**: the recorder first (it publishes what is queued, up to its timeout), then the
  router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.common import lifecycle
from harnessrl.common.bus import Bus
from harnessrl.common.records import SamplingParams
from harnessrl.proxy.calls import ModelCaller
from harnessrl.proxy.engine.auth import client_key
from harnessrl.proxy.labels import DEFAULT_RULES, LabelRules
from harnessrl.proxy.parsers import get_parser
from harnessrl.proxy.proxy_config import ProxyConfig, ProxySettings
from harnessrl.proxy.recorder import Recorder
from harnessrl.proxy.sglang import (
    EngineBadRequest,
    EngineError,
    EngineRouter,
    EngineUnavailable,
    GenerateResult,
)
from harnessrl.proxy.tito import ChatRenderer

__all__ = [
    "HRL_LABEL_HEADER",
    "LABEL_RULES",
    "EngineOutcome",
    "ProxyStack",
    "TrackingRouter",
    "engine_context",
    "failure_reason",
    "open_proxy_stack",
]

log = logging.getLogger("harnessrl.proxy.stack")

HRL_LABEL_HEADER = "x-hrl-call-label"
"""Header by which harnessrl's own agents label their calls (value ``subagent`` or
``compaction``); ``harnessrl.actors.harnesses.reference_agent.LABEL_HEADER`` is this header."""


def with_label_header(rules: LabelRules, header: str) -> LabelRules:
    """``rules`` plus a header marking sub-agent calls, whose value ``compaction`` marks a
    compaction instead; the header is also kept in the CallRecord."""
    header = header.lower()
    if header in rules.subagent_headers:
        return rules
    return dataclasses.replace(
        rules,
        subagent_headers=(*rules.subagent_headers, header),
        compaction_header_values={**rules.compaction_header_values, header: ("compaction",)},
        kept_headers=(*rules.kept_headers, header),
    )


LABEL_RULES = with_label_header(DEFAULT_RULES, HRL_LABEL_HEADER)
"""The label rules of every proxy of the project."""


# ---------------------------------------------------------------------------------------------
# per-rollout engine outcomes
# ---------------------------------------------------------------------------------------------


def failure_reason(e: BaseException) -> str:
    """The infrastructure reason of an engine failure, or "" when ``e`` is none: a 400 (the
    request itself can never succeed) or anything that is not an engine error (cancelled:
    the harness went away)."""
    if isinstance(e, EngineBadRequest) or not isinstance(e, EngineError):
        return ""
    if isinstance(e, EngineUnavailable):
        # no HTTP status: refused, reset, timed out, or no engine left in rotation
        return "engine_unavailable" if e.status else "engine_unreachable"
    return "engine_failed"


@dataclass
class EngineOutcome:
    """What the engines did with one rollout's calls."""

    ok: int = 0
    """Calls that generated (finish ``stop`` or ``length``)."""
    failures: int = 0
    """Calls that failed for infrastructure reasons (see `failure_reason`)."""
    since_ok: int = 0
    """Of those, how many ended after the last call that generated."""
    reason: str = ""
    """Reason of the last failure (``engine_unreachable``, ``engine_unavailable``,
    ``engine_failed``)."""
    error: str = ""
    """Message of the last failure."""
    engine: str = ""
    """Engine URL of the last failure (empty when none was in rotation)."""

    @property
    def failed(self) -> bool:
        """Some call failed for infrastructure reasons and none generated after it."""
        return self.since_ok > 0


class TrackingRouter(EngineRouter):
    """An ``EngineRouter`` that keeps an `EngineOutcome` per key (the rollout id)."""

    def __init__(self, urls: Sequence[str] | str, *, max_tracked: int = 65536, **kw: Any):
        super().__init__(urls, **kw)
        self.max_tracked = max_tracked
        self._outcomes: OrderedDict[str, EngineOutcome] = OrderedDict()

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: dict[str, Any],
        rid: str | None = None,
        *,
        key: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        try:
            res = await super().generate(input_ids, sampling, rid, key=key, timeout=timeout)
        except BaseException as e:
            reason = failure_reason(e)
            if key is not None and reason:
                o = self._entry(key)
                o.failures += 1
                o.since_ok += 1
                o.reason, o.error = reason, str(e)
                o.engine = getattr(e, "url", "") or ""
            raise
        if key is not None and res.finish_reason != "abort":
            o = self._entry(key)
            o.ok += 1
            o.since_ok = 0
        return res

    def _entry(self, key: str) -> EngineOutcome:
        o = self._outcomes.get(key)
        if o is None:
            o = self._outcomes[key] = EngineOutcome()
            while len(self._outcomes) > self.max_tracked:
                self._outcomes.popitem(last=False)
        else:
            self._outcomes.move_to_end(key)
        return o

    def outcome(self, key: str) -> EngineOutcome:
        """A copy of ``key``'s outcome so far (all zero when it made no engine call)."""
        o = self._outcomes.get(key)
        return dataclasses.replace(o) if o is not None else EngineOutcome()

    def forget(self, key: str) -> None:
        super().forget(key)
        self._outcomes.pop(key, None)


# ---------------------------------------------------------------------------------------------
# the stack
# ---------------------------------------------------------------------------------------------


@dataclass
class ProxyStack:
    """The shared parts of a proxy process (see the module docstring)."""

    router: TrackingRouter
    renderer: ChatRenderer
    recorder: Recorder
    caller: ModelCaller
    max_context: int
    """The context window calls are checked against (0: unchecked)."""


@functools.lru_cache(maxsize=4)
def _tokenizer(spec: str) -> Any:
    """The tokenizer of ``spec``, loaded once per process (read-only once loaded)."""
    from harnessrl.common.models import load_tokenizer

    return load_tokenizer(spec)


async def engine_context(router: EngineRouter) -> int:
    """The engines' context window (prompt + completion, tokens); 0 when no engine says.

    SGLang reports it in ``/server_info``: ``context_length`` (the resolved server argument)
    or, failing that, ``max_req_input_len`` (the longest prompt its scheduler admits, a few
    tokens under the window and under the KV pool's size). Its ``/model_info`` has no context
    length; the embedded engine's also carries ``context_length``. SGLang refuses (400) a
    request whose prompt plus ``max_new_tokens`` exceeds the window instead of shortening it,
    so the proxy must know it to bound ``max_new_tokens``."""
    for kind in ("model", "server"):
        try:
            info = await router.info(kind)
        except Exception as e:  # an engine that does not say: try the next source
            log.info("engine %s info unavailable (%r)", kind, e)
            continue
        for key in ("context_length", "max_context_length", "max_req_input_len"):
            value = info.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    log.info("no engine reports its context length: context length unchecked")
    return 0


@contextlib.asynccontextmanager
async def open_proxy_stack(
    settings: ProxySettings,
    bus: Bus,
    *,
    record_buffer: int = 256,
    health_interval_s: float = 2.0,
    close_timeout_s: float = 10.0,
    label_rules: LabelRules = LABEL_RULES,
) -> AsyncIterator[ProxyStack]:
    """Start the router (one health sweep), load the tokenizer, start the recorder; close
    them on exit (recorder first, publishing what is queued for up to ``close_timeout_s``).
    ``record_buffer`` and ``health_interval_s`` are the recorder's capacity and the router's
    health-check period."""
    async with contextlib.AsyncExitStack() as stack:
        key = client_key(settings.engine_api_key_file)
        router = TrackingRouter(
            settings.engines, health_interval=health_interval_s, client_kw={"api_key": key}
        )
        await router.start()
        stack.push_async_callback(router.close)
        max_context = settings.max_context or await engine_context(router)
        tokenizer = await asyncio.to_thread(_tokenizer, settings.model)
        renderer = ChatRenderer(tokenizer)
        await asyncio.to_thread(renderer.windowed)  # probe the template now, not on a call
        recorder = await Recorder(bus, capacity=record_buffer).start()
        stack.push_async_callback(recorder.close, close_timeout_s)
        sampling = SamplingParams(
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_new_tokens=settings.output_limit(),
        )
        caller = ModelCaller(
            router,
            renderer,
            get_parser(settings.parser),
            recorder,
            sampling=sampling,
            max_context=max_context,
            label_rules=label_rules,
        )
        yield ProxyStack(router, renderer, recorder, caller, max_context)


async def serve(cfg: ProxyConfig) -> int:
    """The standalone proxy (``harnessrl proxy``) until SIGTERM or Ctrl-C: then it stops
    accepting calls and waits up to ``flush_timeout_s`` for the bus to store every CallRecord
    (exit status 1 if some were not)."""
    from harnessrl.proxy.server import ProxyServer

    async def body(proc: lifecycle.Process) -> int:
        async with open_proxy_stack(
            cfg,
            proc.bus,
            record_buffer=cfg.record_buffer,
            health_interval_s=cfg.health_interval_s,
            close_timeout_s=1.0,
        ) as stack:
            for rollout_id in set(cfg.token_map().values()):
                stack.recorder.register(rollout_id, cfg.harness, cfg.harness_version)
            server = ProxyServer(
                stack.caller,
                cfg.token_map(),
                model_name=cfg.model_name,
                host=cfg.host,
                port=cfg.port,
                ping_s=cfg.ping_s,
                stream_grace_s=cfg.stream_grace_s,
                max_body_bytes=cfg.request_limit(stack.max_context),
            )
            await server.start()
            print(f"proxy ready: {server.url} (engines {', '.join(cfg.engines)})", flush=True)
            await proc.stop.wait()
            await server.stop()
            try:
                n = await stack.recorder.flush(timeout=cfg.flush_timeout_s)
                log.info("flushed %d call records", n)
            except Exception as e:
                log.error("call records not all stored: %r", e)
                return 1
        return 0

    return await lifecycle.serve(cfg, "proxy", body)
