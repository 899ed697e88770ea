"""One model call, independent of the API it arrived through.

Every HTTP API (OpenAI chat, Anthropic messages, OpenAI responses) converts its request into a
``CallRequest`` (normalised messages, see ``harnessrl.proxy.tito``), awaits ``ModelCaller.call`` and
converts the ``CallReply`` (or the ``CallError``) back into its own shape. Everything else
happens here, in this order::

    label -> admit (recorder.begin, 503 when the record buffer is full) -> TITO prompt ->
    context check (400) -> engine (router) -> parse -> TITO commit -> record

What must stay true:

* Every admitted call produces exactly one CallRecord, whatever happens (engine error, context
  too long, the harness going away): seqs stay dense and the assembler sees every attempt.
* Errors say what the harness should do: ``BadRequest`` (400, never retry: it cannot succeed),
  ``Unavailable`` (503 + Retry-After: engine down or paused, record buffer full),
  ``UpstreamError`` (502: the engine failed in an unexpected way).
* Only a call that succeeded is committed to TITO (``TitoSession.commit``, which counts its
  kind): a failed call (engine down -> 503, engine or parse error, abort, the harness going
  away) is never a TITO miss and leaves no anchor, so it cannot change a later call's prompt.
* A rollout given a seed (``seed_rollout``, from its TaskRequest's ``seed``) samples every
  call with an engine ``sampling_seed`` derived from that seed and the call's seq: the same
  rollout (task, seed, harness) replays the same draws under any policy, so a before/after
  evaluation compares policies on common random numbers, and a group's members differ because
  their seeds do.
* Sampling is the run's, not the harness's; the harness's values are recorded in
  ``requested``. Only ``max_tokens`` is honoured, as an upper bound (a title request asking for
  50 tokens must not get 4000).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from harnessrl.common.records import CallRecord, SamplingParams
from harnessrl.proxy.labels import DEFAULT_RULES, LabelRules, kept_headers, label_call
from harnessrl.proxy.parsers import ParsedOutput, Parser
from harnessrl.proxy.recorder import Recorder, RecorderFull, Ticket
from harnessrl.proxy.sglang import EngineBadRequest, EngineError, EngineUnavailable, GenerateResult
from harnessrl.proxy.tito import ChatRenderer, PromptTooLong, Tito, TitoPrompt, TitoSession

__all__ = [
    "BadRequest",
    "CallError",
    "CallReply",
    "CallRequest",
    "ContextTooLong",
    "ModelCaller",
    "PendingCall",
    "TooLarge",
    "Unavailable",
    "UpstreamError",
    "call_seed",
]


def call_seed(seed: int, seq: int) -> int:
    """The engine ``sampling_seed`` of call ``seq`` of a rollout seeded with ``seed`` (63 bits,
    well mixed: neighbouring seeds and seqs give unrelated streams)."""
    digest = hashlib.blake2b(f"{seed}:{seq}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


class CallError(Exception):
    """A call that cannot be answered normally; ``status`` is the HTTP status to send."""

    status = 500
    retry_after: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(CallError):
    """The request can never succeed as sent (400)."""

    status = 400

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        """The field at fault, as OpenAI's ``param`` names it (``messages[0].role``)."""
        self.code = code
        """OpenAI's ``code`` (``invalid_type``, ``invalid_value``…)."""


class TooLarge(BadRequest):
    """The request body is over the proxy's limit (413)."""

    status = 413


class ContextTooLong(BadRequest):
    """The prompt leaves no room to generate (400, like the real APIs)."""

    def __init__(self, n_tokens: int, limit: int, *, at_least: bool = False) -> None:
        n = f"at least {n_tokens}" if at_least else str(n_tokens)
        super().__init__(
            f"prompt is too long: {n} tokens > {limit - 1} maximum (context window {limit} tokens)",
            code="context_length_exceeded",
        )
        self.n_tokens, self.limit = n_tokens, limit


class Unavailable(CallError):
    """Try again later (503 with Retry-After)."""

    status = 503

    def __init__(self, message: str, retry_after: float = 2.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UpstreamError(CallError):
    """The engine failed unexpectedly (502)."""

    status = 502


class Generator(Protocol):
    async def generate(
        self, input_ids: np.ndarray, sampling: dict[str, Any], rid: str | None = None, **kw: Any
    ) -> GenerateResult:
        """Sample a completion of ``input_ids`` (int32; ``EngineClient`` sends them as a JSON
        list)."""
        ...


_NO_IDS = np.zeros(0, dtype=np.int32)
_NO_IDS.flags.writeable = False


@dataclass
class CallRequest:
    """A model call in API-neutral form."""

    rollout_id: str
    messages: list[dict[str, Any]]
    """Normalised messages (see ``harnessrl.proxy.tito``)."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools."""
    api: str = "chat"
    """``chat``, ``messages`` or ``responses``."""
    headers: dict[str, str] = field(default_factory=dict)
    max_tokens: int | None = None
    """The harness's output limit (an upper bound on the run's ``max_new_tokens``)."""
    requested: dict[str, Any] = field(default_factory=dict)
    """Sampling values the harness asked for (recorded, not used)."""
    id_prefix: str = "call_"
    """Prefix of generated tool-call ids (``toolu_`` for Anthropic, ``call_`` for OpenAI)."""


@dataclass
class CallReply:
    """What the model answered, parsed, plus the bookkeeping the API layers report."""

    parsed: ParsedOutput
    message: dict[str, Any]
    """The assistant message in the normalised format, tool calls with fresh ids."""
    finish: str
    """``tool_calls``, ``stop`` or ``length``."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    record: CallRecord
    prompt: TitoPrompt
    result: GenerateResult

    @property
    def tool_call_ids(self) -> list[str]:
        return [tc["id"] for tc in self.message.get("tool_calls", [])]


@dataclass
class PendingCall:
    """An admitted call between ``ModelCaller.admit`` and ``ModelCaller.run``."""

    req: CallRequest
    ticket: Ticket
    prompt: TitoPrompt | None = None
    base: dict[str, Any] = field(default_factory=dict)
    """Fields of the eventual CallRecord known so far."""

    @property
    def ids(self) -> np.ndarray:
        """The prompt's input ids (int32; empty before the prompt is built)."""
        return self.prompt.ids if self.prompt is not None else _NO_IDS


class ModelCaller:
    """Runs calls: TITO prompt, engine, parse, record (see the module docstring)."""

    def __init__(
        self,
        engine: Generator,
        renderer: ChatRenderer,
        parser: Parser,
        recorder: Recorder,
        *,
        sampling: SamplingParams | None = None,
        max_context: int = 0,
        label_rules: LabelRules = DEFAULT_RULES,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.parser = parser
        self.recorder = recorder
        self.tito = Tito(renderer)
        self.sampling = sampling or SamplingParams()
        self.max_context = max_context
        """Context window in tokens (prompt + completion); 0: not checked here."""
        self.label_rules = label_rules
        self.seeds: dict[str, int] = {}
        """Sampling seed by rollout id (``seed_rollout``); calls of other rollouts are unseeded."""

    def seed_rollout(self, rollout_id: str, seed: int) -> None:
        """Sample ``rollout_id``'s calls with seeds derived from ``seed`` (see ``call_seed``)."""
        self.seeds[rollout_id] = int(seed)

    def drop(self, rollout_id: str) -> None:
        """Forget a finished rollout: its TITO session and its seed."""
        self.tito.drop(rollout_id)
        self.seeds.pop(rollout_id, None)

    def engine_sampling(self, n_prompt: int, max_tokens: int | None) -> SamplingParams:
        """The run's sampling, with ``max_new_tokens`` bounded by the harness and the context."""
        limit = self.sampling.max_new_tokens
        if max_tokens is not None and max_tokens > 0:
            limit = min(limit, max_tokens)
        if self.max_context:
            limit = min(limit, self.max_context - n_prompt)
        return SamplingParams(
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            max_new_tokens=max(1, limit),
        )

    async def call(self, req: CallRequest) -> CallReply:
        """Answer one call; raises a ``CallError`` subclass instead of returning on failure."""
        return await self.run(self.admit(req))

    def admit(self, req: CallRequest) -> PendingCall:
        """First half of ``call``, without awaiting: label, admission, TITO prompt, context
        check. Raises ``Unavailable``/``BadRequest`` before any engine work, so an API layer can
        still answer with a real HTTP status before it starts a stream. The returned call must
        be passed to ``run`` (or ``abandon``)."""
        pending = self._begin(req, self._label(req))
        with self._failing(pending):
            self._admitted(pending, self._prompt(pending, self.tito.session(req.rollout_id)))
        return pending

    async def admit_offloaded(self, req: CallRequest) -> PendingCall:
        """``admit``, with the prompt built in a worker thread: tokenising a long text releases
        the GIL, so the event loop serves the other rollouts meanwhile (for large requests,
        where that saves more than the thread's hop costs)."""
        pending = self._begin(req, await asyncio.to_thread(self._label, req))
        with self._failing(pending):
            session = self.tito.session(req.rollout_id)
            prompt = await asyncio.to_thread(self._prompt, pending, session)
            self._admitted(pending, prompt)
        return pending

    def _label(self, req: CallRequest) -> str:
        return label_call(req.messages, req.tools, req.headers, self.label_rules)[0]

    def _begin(self, req: CallRequest, label: str) -> PendingCall:
        try:
            ticket = self.recorder.begin(req.rollout_id)
        except RecorderFull as e:
            raise Unavailable(str(e), e.retry_after) from None
        pending = PendingCall(req, ticket)
        pending.base = {
            "api": req.api,
            "label": label,
            "requested": req.requested,
            "headers": kept_headers(req.headers, self.label_rules),
        }
        return pending

    def _prompt(self, pending: PendingCall, session: TitoSession) -> TitoPrompt:
        """The call's TITO prompt (touches no shared state: may run in a worker thread)."""
        req = pending.req
        try:
            return session.prepare(
                req.messages, req.tools, track=pending.base["label"], max_ids=self.max_context
            )
        except PromptTooLong as e:
            raise ContextTooLong(e.at_least, e.max_ids, at_least=True) from None

    def _admitted(self, pending: PendingCall, prompt: TitoPrompt) -> None:
        pending.prompt = prompt
        pending.base["tito_hit"] = prompt.hit
        pending.base["parent_hint"] = prompt.anchor_seq
        n = len(prompt.ids)
        if self.max_context and n >= self.max_context:
            raise ContextTooLong(n, self.max_context)
        pending.base["sampling"] = self.engine_sampling(n, pending.req.max_tokens)

    @contextlib.contextmanager
    def _failing(self, pending: PendingCall) -> Iterator[None]:
        """Record the call as failed when admitting it fails (every admitted call has exactly
        one record)."""
        try:
            yield
        except BaseException as e:
            self._record_failure(pending, e)
            raise

    async def run(self, pending: PendingCall) -> CallReply:
        """Second half of ``call``: engine, parse, TITO commit, record."""
        try:
            result, engine_s = await self._generate(pending)
        except _Aborted as e:  # answered as retryable: nothing usable was generated
            self._record_failure(pending, e)
            raise Unavailable(f"generation aborted by the engine: {e}", 1.0) from None
        except BaseException as e:
            self._record_failure(pending, e)
            raise
        reply = self._reply(pending, result)
        session = self.tito.session(pending.req.rollout_id)
        session.commit(pending.ticket.seq, pending.prompt, result.output_ids, reply.message)
        reply.record = self.recorder.record(
            pending.ticket, pending.ids, result, engine_s=engine_s, **pending.base
        )
        return reply

    def abandon(self, pending: PendingCall, reason: str = "client went away") -> None:
        """Record an admitted call that will never be run (status aborted)."""
        if not pending.ticket.done:
            self.recorder.record(
                pending.ticket, pending.ids, status="aborted", error=reason, **pending.base
            )

    async def _generate(self, pending: PendingCall) -> tuple[GenerateResult, float]:
        sampling: SamplingParams = pending.base["sampling"]
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "stop_token_ids": self.renderer.stop_ids,
        }
        t = pending.ticket
        seed = self.seeds.get(t.rollout_id)
        if seed is not None:
            params["sampling_seed"] = call_seed(seed, t.seq)
        rid = f"{t.rollout_id}-{t.seq}-{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        try:
            result = await self.engine.generate(pending.ids, params, rid, key=t.rollout_id)
        except EngineBadRequest as e:
            raise BadRequest(e.message) from None
        except EngineUnavailable as e:
            raise Unavailable(str(e), e.retry_after) from None
        except EngineError as e:
            raise UpstreamError(str(e)) from None
        if result.finish_reason == "abort":
            raise _Aborted(result, time.monotonic() - t0)
        return result, time.monotonic() - t0

    def _reply(self, pending: PendingCall, result: GenerateResult) -> CallReply:
        parsed = self.parser.parse(self.renderer.decode(result.output_ids))
        ids = [f"{pending.req.id_prefix}{uuid.uuid4().hex[:24]}" for _ in parsed.tool_calls]
        if parsed.tool_calls:
            finish = "tool_calls"
        elif result.finish_reason == "length":
            finish = "length"
        else:
            finish = "stop"
        return CallReply(
            parsed=parsed,
            message=parsed.message(ids),
            finish=finish,
            prompt_tokens=len(pending.ids),
            completion_tokens=len(result.output_ids),
            cached_tokens=result.cached_tokens,
            record=None,  # type: ignore[arg-type]  # set once recorded
            prompt=pending.prompt,
            result=result,
        )

    def _record_failure(self, pending: PendingCall, e: BaseException) -> None:
        if pending.ticket.done:
            return
        result = None
        status = "error"
        if isinstance(e, _Aborted):
            result, status = e.result, "aborted"
            pending.base["engine_s"] = e.engine_s
        elif isinstance(e, asyncio.CancelledError):
            status = "aborted"
        message = "client went away" if isinstance(e, asyncio.CancelledError) else str(e)
        self.recorder.record(
            pending.ticket, pending.ids, result, status=status, error=message, **pending.base
        )


class _Aborted(Exception):
    def __init__(self, result: GenerateResult, engine_s: float) -> None:
        super().__init__(result.abort_message or "aborted")
        self.result, self.engine_s = result, engine_s
