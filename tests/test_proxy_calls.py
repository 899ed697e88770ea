"""ModelCaller: TITO prompt -> engine -> parse -> record, against scripted and embedded engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess

import pytest

from harnessrl.common import metrics
from harnessrl.common.bus import MemoryBus, connect
from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import CallRecord, SamplingParams, ids_hash, unpack_ids
from harnessrl.proxy.calls import (
    BadRequest,
    CallError,
    CallRequest,
    ContextTooLong,
    ModelCaller,
    Unavailable,
)
from harnessrl.proxy.parsers import HermesParser
from harnessrl.proxy.recorder import Recorder
from harnessrl.proxy.scripted import Reply, ScriptedEngine
from harnessrl.proxy.sglang import EngineClient, EngineRouter
from harnessrl.proxy.tito import ChatRenderer
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

TOK = load_tokenizer("tiny-1m")
R = ChatRenderer(TOK)
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List files."}]
CALL_LS = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


@pytest.fixture
async def bus(run_name: str):
    b = await connect(f"memory://{run_name}", run_name)
    yield b
    await b.close()


@contextlib.asynccontextmanager
async def stack(bus, script, router: bool = False, rec_kw=None, **caller_kw):
    """A scripted engine, a client (or router) to it, a recorder and a caller."""
    async with ScriptedEngine(TOK, script) as eng:
        gen = (
            EngineRouter([eng.url], health_interval=0, swap_wait_s=0.1)
            if router
            else EngineClient(eng.url)
        )
        async with gen, Recorder(bus, **(rec_kw or {})) as rec:
            yield eng, ModelCaller(gen, R, HermesParser(), rec, **caller_kw), rec


def rebuild(records: list[CallRecord]) -> dict[int, list[int]]:
    full: dict[int, list[int]] = {}
    for r in records:
        base: list[int] = []
        if r.parent_seq >= 0:
            parent = next(p for p in records if p.seq == r.parent_seq)
            base = (full[parent.seq] + unpack_ids(parent.output_ids).tolist())[: r.prefix_len]
        full[r.seq] = base + unpack_ids(r.suffix_ids).tolist()
        assert ids_hash(full[r.seq]) == r.input_hash
    return full


async def test_agent_loop_end_to_end(bus) -> None:
    """Tool call, result, answer: the engine sees TITO ids, records rebuild, the reply parses."""
    script = [f"Let me look.\n{CALL_LS}", "Two files: a.py, b.py."]
    async with ScriptedEngine(TOK, script) as eng, EngineClient(eng.url) as client:
        async with Recorder(bus) as rec:
            caller = ModelCaller(
                client, R, HermesParser(), rec, sampling=SamplingParams(temperature=0.6)
            )
            req = CallRequest("g-0-1", START, TOOLS, max_tokens=500, requested={"temperature": 0})
            first = await caller.call(req)
            assert first.finish == "tool_calls" and first.parsed.content == "Let me look."
            (call_id,) = first.tool_call_ids
            echo = {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "renamed",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command":"ls"}'},
                    }
                ],
            }
            msgs = START + [echo, {"role": "tool", "tool_call_id": call_id, "content": "a.py b.py"}]
            second = await caller.call(CallRequest("g-0-1", msgs, TOOLS))
            assert second.finish == "stop" and second.message["content"] == "Two files: a.py, b.py."
            assert second.prompt.hit
            assert await rec.flush("g-0-1") == 2
        sent = [r["input_ids"] for r in eng.requests]
    assert (
        sent[1][: len(sent[0]) + len(first.result.output_ids)] == sent[0] + first.result.output_ids
    )
    assert eng.requests[0]["sampling_params"]["temperature"] == 0.6
    assert eng.requests[0]["sampling_params"]["max_new_tokens"] == 500
    records = await bus.read_subject(bus.subjects.calls("g-0-1"), CallRecord)
    assert [(r.seq, r.parent_seq, r.tito_hit, r.status) for r in records] == [
        (0, -1, False, "ok"),
        (1, 0, True, "ok"),
    ]
    assert rebuild(records) == {0: sent[0], 1: sent[1]}
    assert records[0].requested == {"temperature": 0} and records[0].sampling.max_new_tokens == 500
    assert (second.prompt_tokens, second.completion_tokens) == (
        len(sent[1]),
        len(second.result.output_ids),
    )


async def test_context_too_long_is_400_and_recorded(bus) -> None:
    """A prompt filling the context never reaches the engine; it is still recorded. This one
    is known too long from its text's length alone (`TitoSession.prepare`'s bound): it is
    never even encoded, so the record holds no ids."""
    async with stack(bus, ["x"], max_context=20) as (eng, caller, rec):
        with pytest.raises(ContextTooLong, match="prompt is too long") as e:
            await caller.call(CallRequest("g-1-1", START, TOOLS))
        assert e.value.status == 400
        assert await rec.flush("g-1-1") == 1
        assert eng.requests == []
    (record,) = await bus.read_subject(bus.subjects.calls("g-1-1"), CallRecord)
    assert record.status == "error" and "at least" in record.error and record.input_len == 0


async def test_max_new_tokens_bounded_by_context(bus) -> None:
    """max_new_tokens never exceeds what is left of the context window."""
    async with stack(bus, ["ok"], max_context=200) as (eng, caller, _):
        reply = await caller.call(CallRequest("g-2-1", START, None))
    assert eng.requests[0]["sampling_params"]["max_new_tokens"] == 200 - reply.prompt_tokens


async def test_engine_errors_map_to_api_errors(bus) -> None:
    """Engine 400 -> BadRequest; 503 -> Unavailable with Retry-After; each recorded as error."""
    script = [Reply(status=400, error="bad temperature"), Reply(status=503, error="paused")]
    async with stack(bus, script) as (_, caller, rec):
        with pytest.raises(BadRequest, match="bad temperature"):
            await caller.call(CallRequest("g-3-1", START, TOOLS))
        with pytest.raises(Unavailable) as e:
            await caller.call(CallRequest("g-3-1", START, TOOLS))
        assert e.value.status == 503 and e.value.retry_after
        await rec.flush("g-3-1")
    records = await bus.read_subject(bus.subjects.calls("g-3-1"), CallRecord)
    assert [(r.seq, r.status) for r in records] == [(0, "error"), (1, "error")]
    assert records[1].parent_seq == 0 and records[1].prefix_len == records[1].input_len  # retry


async def test_failed_calls_are_not_tito_misses(bus) -> None:
    """Calls that fail (engine 503, engine 500, engine unreachable) are recorded as errors but
    never counted by TITO nor remembered by it: the miss counter does not move, the rollout's
    first successful call is its ``first`` and the next one a hit extending it."""

    def tito(kind: str) -> float:
        return metrics.sample_value("hrl_proxy_tito_total", {"result": kind})

    before = {k: tito(k) for k in ("first", "hit", "miss")}
    script = [
        Reply(status=503, error="paused"),
        "Hello.",
        Reply(status=503, error="paused"),
        Reply(status=500, error="boom"),
        "Bye.",
    ]
    async with stack(bus, script) as (eng, caller, rec):
        with pytest.raises(Unavailable):
            await caller.call(CallRequest("g-3-2", START, TOOLS))
        first = await caller.call(CallRequest("g-3-2", START, TOOLS))
        msgs = START + [first.message, {"role": "user", "content": "again"}]
        for err in (Unavailable, CallError):
            with pytest.raises(err):
                await caller.call(CallRequest("g-3-2", msgs, TOOLS))
        await eng.stop()  # the engine goes away: connection refused
        with pytest.raises(Unavailable):
            await caller.call(CallRequest("g-3-2", msgs, TOOLS))
        await eng.start()
        last = await caller.call(CallRequest("g-3-2", msgs, TOOLS))
        session = caller.tito.session("g-3-2")
        await rec.flush("g-3-2")
    assert (first.prompt.kind, last.prompt.kind) == ("first", "hit")
    assert session.counts == {"first": 1, "hit": 1, "miss": 0} and len(session.anchors) == 4
    assert {k: tito(k) - before[k] for k in before} == {"first": 1, "hit": 1, "miss": 0}
    records = await bus.read_subject(bus.subjects.calls("g-3-2"), CallRecord)
    assert [r.status for r in sorted(records, key=lambda r: r.seq)] == [
        "error", "ok", "error", "error", "error", "ok",
    ]  # fmt: skip
    assert [r.tito_hit for r in records if r.status == "ok"] == [False, True]


async def test_engine_abort_is_retryable_and_recorded_as_aborted(bus) -> None:
    """An abort nobody retried (not a weight swap) answers 503; the record says aborted."""
    async with stack(bus, [Reply(ids=[], finish="abort")], router=True) as (_, caller, rec):
        with pytest.raises(Unavailable, match="aborted"):
            await caller.call(CallRequest("g-4-1", START, TOOLS))
        await rec.flush("g-4-1")
    (record,) = await bus.read_subject(bus.subjects.calls("g-4-1"), CallRecord)
    assert (record.status, record.finish_reason) == ("aborted", "abort")


async def test_full_record_buffer_refuses_before_the_engine(run_name: str) -> None:
    """With the bus unable to take records, calls are refused (503) before any engine work."""

    class DownBus(MemoryBus):
        down = True

        async def publish_bytes(self, subject, data, msg_id):
            if self.down:
                raise ConnectionError("bus down")
            return await super().publish_bytes(subject, data, msg_id)

    bus = DownBus(run_name)
    await bus.ensure_streams()
    kw = {"capacity": 1, "retry_delay": 0.01}
    async with stack(bus, ["a", "b"], rec_kw=kw) as (eng, caller, rec):
        await caller.call(CallRequest("g-5-1", START, TOOLS))
        with pytest.raises(Unavailable, match="waiting for the bus"):
            await caller.call(CallRequest("g-5-1", START, TOOLS))
        assert len(eng.requests) == 1
        bus.down = False
        await rec.flush("g-5-1", timeout=5)


async def test_labels_and_headers_are_recorded(bus) -> None:
    """A sub-agent call (by header) is labelled and its header kept."""
    headers = {"X-Claude-Code-Agent-Id": "agent-7", "Authorization": "Bearer x"}
    async with stack(bus, ["hi"]) as (_, caller, _):
        reply = await caller.call(CallRequest("g-6-1", START, TOOLS, headers=headers))
    assert reply.record.label == "subagent"
    assert reply.record.headers == {"x-claude-code-agent-id": "agent-7"}


async def test_cancelled_call_is_recorded_as_aborted(bus) -> None:
    """The harness went away mid-generation: the record says aborted, the engine got an abort."""
    async with stack(bus, [Reply(text="slow", delay=5)]) as (eng, caller, rec):
        task = asyncio.create_task(caller.call(CallRequest("g-7-1", START, TOOLS)))
        await until(lambda: eng.requests, 10, "the call at the engine")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await rec.flush("g-7-1") == 1
    assert any(p == "/abort_request" for p, _ in eng.control)
    (record,) = await bus.read_subject(bus.subjects.calls("g-7-1"), CallRecord)
    assert record.status == "aborted"


@pytest.fixture(scope="module")
def embedded_engine():
    """The project's embedded CPU engine (tiny-1m) as a child process."""
    try:
        from harnessrl.proxy.engine_cmd import spawn_engine
    except ImportError as e:  # pragma: no cover - the engine lands separately
        pytest.skip(f"embedded engine not available: {e}")
    proc, url = spawn_engine(["--model", "tiny-1m", "--port", "0", "--threads", "1", "--insecure"])
    yield url
    proc.terminate()
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def test_loop_against_embedded_engine(embedded_engine: str, bus) -> None:
    """Real engine, real sampling: three calls of a loop extend each other's sampled ids, the
    records rebuild exactly and carry the engine's log-probs."""
    async with EngineRouter([embedded_engine], health_interval=0) as router, Recorder(bus) as rec:
        info = await router.model_info()
        caller = ModelCaller(
            router,
            R,
            HermesParser(),
            rec,
            sampling=SamplingParams(max_new_tokens=24),
            max_context=int(info["context_length"]),
        )
        msgs = list(START)
        replies = []
        for turn in range(3):
            reply = await caller.call(CallRequest("g-8-1", msgs, TOOLS))
            replies.append(reply)
            echo = json.loads(json.dumps(reply.message))  # what the harness sends back
            msgs = msgs + [echo, {"role": "user", "content": f"continue {turn}"}]
        await rec.flush("g-8-1")
    for a, b in zip(replies, replies[1:], strict=False):
        head = a.prompt.input_ids + a.result.output_ids  # every sampled id is kept
        assert b.prompt.input_ids[: len(head)] == head and b.prompt.hit
    records = await bus.read_subject(bus.subjects.calls("g-8-1"), CallRecord)
    full = rebuild(records)
    assert [full[i] for i in range(3)] == [r.prompt.input_ids for r in replies]
    assert all(len(r.output_logprobs) == 4 * len(unpack_ids(r.output_ids)) for r in records)


async def test_seeded_rollouts_replay_their_draws(embedded_engine: str, bus) -> None:
    """A rollout's seed fixes its draws: two rollouts seeded alike sample the same ids even
    when batched with others (the engine's per-request generator), another seed samples
    differently, and an unseeded rollout is not replayed; ``drop`` forgets the seed."""
    async with EngineRouter([embedded_engine], health_interval=0) as router, Recorder(bus) as rec:
        caller = ModelCaller(
            router, R, HermesParser(), rec, sampling=SamplingParams(max_new_tokens=24)
        )
        for rid, seed in (("s-0-1", 7), ("s-1-1", 7), ("s-2-1", 8)):
            caller.seed_rollout(rid, seed)
        rids = ["s-0-1", "s-1-1", "s-2-1", "u-0-1", "u-1-1"]
        replies = await asyncio.gather(*(caller.call(CallRequest(r, START, TOOLS)) for r in rids))
        out = {r: rep.result.output_ids for r, rep in zip(rids, replies, strict=True)}
        assert out["s-0-1"] == out["s-1-1"]
        assert out["s-0-1"] != out["s-2-1"]
        assert out["u-0-1"] != out["u-1-1"]
        caller.drop("s-0-1")
        assert "s-0-1" not in caller.seeds and "s-0-1" not in caller.tito.sessions
