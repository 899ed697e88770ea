"""``harnessrl.proxy.stack``: the one wiring of the proxy (router, renderer, recorder, ModelCaller) and
each rollout's engine outcome, against a scripted engine (and a port nobody listens on)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from harnessrl.actors.harnesses.reference_agent import LABEL_HEADER
from harnessrl.common.bus import connect
from harnessrl.common.records import CallRecord
from harnessrl.proxy.calls import CallRequest, UpstreamError
from harnessrl.proxy.labels import label_call
from harnessrl.proxy.proxy_config import ProxySettings
from harnessrl.proxy.scripted import Reply, ScriptedEngine
from harnessrl.proxy.sglang import EngineBadRequest, EngineError, EngineUnavailable
from harnessrl.proxy.stack import LABEL_RULES, TrackingRouter, failure_reason, open_proxy_stack
from tests.helpers.rollout import TOK

SAMPLING = {"max_new_tokens": 8}


def closed_port_url() -> str:
    """An URL nobody listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.unit
def test_failure_reasons():
    """Unreachable, 5xx-unavailable and other engine failures are infrastructure; a 400 and a
    cancelled call (the harness went away) are not."""
    assert failure_reason(EngineUnavailable("refused", url="u")) == "engine_unreachable"
    assert failure_reason(EngineUnavailable("busy", url="u", status=503)) == "engine_unavailable"
    assert failure_reason(EngineError("HTTP 500", url="u", status=500)) == "engine_failed"
    assert failure_reason(EngineBadRequest("too long", url="u", status=400)) == ""
    assert failure_reason(asyncio.CancelledError()) == ""


@pytest.mark.unit
def test_label_rules_know_the_reference_agent():
    """Every proxy labels the reference agent's calls by its own header."""
    assert LABEL_HEADER in LABEL_RULES.subagent_headers
    assert label_call([], None, {LABEL_HEADER: "compaction"}, LABEL_RULES)[0] == "compaction"
    assert label_call([], None, {LABEL_HEADER: "subagent"}, LABEL_RULES)[0] == "subagent"


@pytest.mark.integration
async def test_router_outcomes_per_rollout():
    """Failures count until a call of the same rollout generates; other rollouts are apart;
    a 400 is neither; forget drops the entry."""
    async with ScriptedEngine(TOK, default="hi") as eng:
        router = TrackingRouter(eng.url, health_interval=0)
        await router.start()
        try:
            eng.fail("/generate", 500, times=2)
            for _ in range(2):
                with pytest.raises(EngineError):
                    await router.generate([1, 2], SAMPLING, key="r1")
            o = router.outcome("r1")
            assert (o.failures, o.since_ok, o.failed, o.reason) == (2, 2, True, "engine_failed")
            assert o.engine == eng.url and "500" in o.error
            await router.generate([1, 2], SAMPLING, key="r1")
            o = router.outcome("r1")
            assert (o.ok, o.failures, o.since_ok, o.failed) == (1, 2, 0, False)
            eng.fail("/generate", 400)
            with pytest.raises(EngineBadRequest):
                await router.generate([1, 2], SAMPLING, key="r2")
            assert not router.outcome("r2").failed and router.outcome("r2").failures == 0
            router.forget("r1")
            assert router.outcome("r1").failures == 0
        finally:
            await router.close()


@pytest.mark.integration
async def test_unreachable_engine_outcome():
    """A port nobody listens on: the call fails as engine_unreachable."""
    router = TrackingRouter(closed_port_url(), health_interval=0, wait_healthy_s=0.2)
    try:
        with pytest.raises(EngineUnavailable):
            await router.generate([1], SAMPLING, key="r")
    finally:
        await router.close()
    o = router.outcome("r")
    assert (o.failures, o.failed, o.reason) == (1, True, "engine_unreachable")


@pytest.mark.integration
async def test_stack_serves_records_and_tracks(run_name: str):
    """The stack as both proxies use it: an engine that will not say its context length does
    not stop it (context unchecked); a call is recorded on the bus with the harness identity
    registered, and its engine failure is in the router's outcome."""
    bus = await connect(f"memory://{run_name}", run_name)
    try:
        async with ScriptedEngine(TOK, [Reply(status=500), "hello"]) as eng:
            eng.fail("/get_model_info", 500, times=10)
            settings = ProxySettings(engines=[eng.url], model="tiny-1m")
            async with open_proxy_stack(settings, bus, record_buffer=8) as stack:
                assert stack.max_context == 0 and stack.caller.max_context == 0
                assert stack.caller.label_rules is LABEL_RULES
                assert stack.caller.engine is stack.router
                stack.recorder.register("s-0-1", harness="reference", harness_version="9.9")
                msgs = [{"role": "user", "content": "hi"}]
                with pytest.raises(UpstreamError):
                    await stack.caller.call(CallRequest("s-0-1", msgs))
                assert stack.router.outcome("s-0-1").failed
                reply = await stack.caller.call(CallRequest("s-0-1", msgs))
                assert reply.record.status == "ok"
                assert not stack.router.outcome("s-0-1").failed
                assert await stack.recorder.flush("s-0-1", timeout=10) == 2
        calls = await bus.read_subject(bus.subjects.calls("s-0-1"), CallRecord)
    finally:
        await bus.close()
    assert sorted(c.status for c in calls) == ["error", "ok"]
    assert {(c.harness, c.harness_version) for c in calls} == {("reference", "9.9")}
