"""SGLang-native client and router, against scripted engines over loopback HTTP."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.common.files import free_port
from harnessrl.common.models import load_tokenizer
from harnessrl.proxy.scripted import Reply, ScriptedEngine
from harnessrl.proxy.sglang import (
    EngineBadRequest,
    EngineClient,
    EngineError,
    EngineRouter,
    EngineUnavailable,
    GenerateResult,
    IdsJson,
)
from tests.helpers.wait import until

REPO = Path(__file__).resolve().parents[1]
TOK = load_tokenizer("tiny-1m")
SAMPLING = {"max_new_tokens": 64, "temperature": 1.0, "stop_token_ids": [2]}


# ---------------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_generate_forces_logprobs_and_raw_text() -> None:
    """Every /generate asks for log-probs, special tokens and untrimmed stops; the reply is
    normalised (ids incl. the stop token, float32 log-probs, versions as ints)."""
    async with ScriptedEngine(TOK, ["Hello!"], weight_version=7) as eng, EngineClient(eng.url) as c:
        res = await c.generate([1, 2, 3], {**SAMPLING, "skip_special_tokens": True}, rid="r1")
        sent = eng.requests[0]
    assert sent["return_logprob"] is True and sent["rid"] == "r1"
    assert sent["sampling_params"]["skip_special_tokens"] is False
    assert sent["sampling_params"]["no_stop_trim"] is True
    assert sent["input_ids"] == [1, 2, 3]
    assert res.output_ids == TOK.encode("Hello!") + [2]
    assert res.text == "Hello!<|im_end|>" and res.finish_reason == "stop"
    assert len(res.logprobs) == len(res.output_ids) and res.logprobs[0] == pytest.approx(-0.1)
    assert (res.weight_version_start, res.weight_version_end) == (7, 7)
    assert (res.prompt_tokens, res.completion_tokens, res.engine) == (
        3,
        len(res.output_ids),
        eng.url,
    )


@pytest.mark.integration
async def test_length_finish_and_cached_tokens() -> None:
    """max_new_tokens cuts the reply (finish length); the second call reports a prefix-cache hit."""
    async with ScriptedEngine(TOK, [[5, 6, 7, 8], [9]]) as eng, EngineClient(eng.url) as c:
        a = await c.generate([1, 2, 3], {"max_new_tokens": 2})
        b = await c.generate([1, 2, 3, 5, 6, 4], {"max_new_tokens": 2})
    assert (a.output_ids, a.finish_reason) == ([5, 6], "length")
    assert b.cached_tokens == 5


@pytest.mark.integration
async def test_keyed_calls_send_the_ids_they_are_given() -> None:
    """A rollout's calls (``key``) reuse the text of the ids the last call sent where the new
    ids extend them; the engine receives exactly each call's ids all the same, forks included,
    and ``forget`` drops the key."""
    calls = [[1, 2, 3], [1, 2, 3, 5, 6, 4], [1, 2, 3, 5, 6, 4], [1, 2, 9], [1, 2, 9, 10]]
    async with ScriptedEngine(TOK, [[7]] * 6) as eng, EngineClient(eng.url) as c:
        for ids in calls:
            await c.generate(np.asarray(ids, np.int32), SAMPLING, key="r")
        assert [r["input_ids"] for r in eng.requests] == calls
        assert c.ids_json.reused == 3  # the 2nd, the 3rd (same ids) and the 5th
        c.forget("r")
        await c.generate([1, 2, 9, 10, 11], SAMPLING, key="r")
        assert eng.requests[-1]["input_ids"] == [1, 2, 9, 10, 11]
    assert c.ids_json.reused == 3


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.lists(st.integers(0, 2**31 - 1), max_size=6)),
        min_size=1,
        max_size=12,
    )
)
def test_ids_json_is_the_json_of_the_ids(steps: list[tuple[int, list[int]]]) -> None:
    """Whatever a key's calls do (extend, repeat, cut back and fork, start empty), each encoded
    text decodes to that call's ids; a byte bound evicts old keys without changing a text."""
    cache = IdsJson(max_bytes=200)
    last: dict[str, list[int]] = {}
    for i, (cut, new) in enumerate(steps):
        key = "ab"[i % 2] if i % 3 else "c"
        prev = last.get(key, [])
        ids = prev[: max(0, len(prev) - cut)] + new
        raw = cache.encode(np.asarray(ids, np.int32), key)
        assert isinstance(raw, msgspec.Raw)
        assert json.loads(bytes(raw)) == ids
        last[key] = ids
    assert cache._bytes == sum(a.nbytes + len(b) for a, b in cache._last.values())
    assert cache._bytes <= 200 or len(cache._last) == 1  # the newest key is always kept


@pytest.mark.integration
async def test_weight_version_start_reported_when_it_changed() -> None:
    """A swap during generation: start and end versions differ."""
    async with (
        ScriptedEngine(TOK, [Reply(text="x", set_version=4)], weight_version=3) as eng,
        EngineClient(eng.url) as c,
    ):
        res = await c.generate([1], SAMPLING)
    assert (res.weight_version_start, res.weight_version_end) == (3, 4)


@pytest.mark.unit
def test_start_version_is_the_first_weight_version_span() -> None:
    """SGLang reports the versions over output-token ranges (``weight_versions``): the call
    started under the first span's, ended under ``weight_version``."""
    meta = {
        "finish_reason": {"type": "length", "length": 3},
        "weight_version": "9",
        "weight_versions": [
            {"version": "8", "start": 0, "end": 2},
            {"version": "9", "start": 2, "end": 3},
        ],
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
    }
    res = GenerateResult.from_json({"text": "", "output_ids": [5, 6, 7], "meta_info": meta})
    assert (res.weight_version_start, res.weight_version_end) == (8, 9)
    meta["weight_versions"] = [{"version": "9", "start": 0, "end": 3}]
    res = GenerateResult.from_json({"text": "", "output_ids": [5, 6, 7], "meta_info": meta})
    assert (res.weight_version_start, res.weight_version_end) == (9, 9)


@pytest.mark.integration
async def test_info_falls_back_to_the_old_paths() -> None:
    """An SGLang release before ``/model_info`` and ``/server_info`` answers only the
    ``/get_*`` names: the client falls back to them once and remembers."""
    async with ScriptedEngine(TOK, [], weight_version=6, context_length=4096) as eng:
        eng.fail("/model_info", 404, times=1)
        eng.fail("/server_info", 404, times=1)
        async with EngineClient(eng.url) as c:
            assert await c.weight_version() == 6
            assert (await c.server_info())["context_length"] == 4096
            assert await c.weight_version() == 6
            assert c._old_info is True
        async with EngineClient(eng.url) as c:  # a current server: the new names only
            assert await c.weight_version() == 6
            assert c._old_info is False


@pytest.mark.unit
def test_result_without_output_ids_uses_logprob_tokens() -> None:
    """Engines that omit output_ids: ids come from output_token_logprobs; misalignment fails."""
    body = {
        "text": "ab",
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": "default",
            "output_token_logprobs": [[-0.5, 10, None], [None, 11, None]],
        },
    }
    res = GenerateResult.from_json(body)
    assert (res.output_ids, res.weight_version_end) == ([10, 11], -1)
    assert res.logprobs[0] == -0.5 and math.isnan(res.logprobs[1])  # missing: NaN, never 0
    with pytest.raises(EngineError, match="2 log-probs"):
        GenerateResult.from_json({**body, "output_ids": [10, 11, 12]})


@pytest.mark.integration
async def test_errors_are_classified() -> None:
    """400 -> EngineBadRequest with the engine's message; 503 -> EngineUnavailable; 500 ->
    EngineError (not retryable); an abort with status_code 400 inside a 200 -> EngineBadRequest."""
    too_long = {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "finish_reason": {
                "type": "abort",
                "message": "input is longer than the context",
                "status_code": 400,
            }
        },
    }
    script = [
        Reply(status=400, error="The input (9000 tokens) is longer than the model's context"),
        Reply(status=503, error="paused"),
        Reply(status=500, error="boom"),
        Reply(raw=too_long),
    ]
    async with ScriptedEngine(TOK, script) as eng, EngineClient(eng.url) as c:
        with pytest.raises(EngineBadRequest, match="9000 tokens") as bad:
            await c.generate([1], SAMPLING)
        assert bad.value.status == 400
        with pytest.raises(EngineUnavailable, match="paused"):
            await c.generate([1], SAMPLING)
        with pytest.raises(EngineError, match="boom") as err:
            await c.generate([1], SAMPLING)
        assert not isinstance(err.value, EngineUnavailable)
        with pytest.raises(EngineBadRequest, match="longer than the context"):
            await c.generate([1], SAMPLING)


@pytest.mark.integration
async def test_connection_refused_is_unavailable() -> None:
    """Nothing listening: EngineUnavailable, quickly; health() says False without raising."""
    c = EngineClient(f"http://127.0.0.1:{free_port()}", retries=1, retry_backoff=0.01)
    try:
        with pytest.raises(EngineUnavailable, match="failed"):
            await c.generate([1], SAMPLING)
        assert await c.health() is False
        with pytest.raises(EngineUnavailable):
            await c.weight_version()
    finally:
        await c.close()


@pytest.mark.integration
async def test_idempotent_reads_are_retried() -> None:
    """Health, model info and version survive transient 503s; generate is not retried."""
    async with (
        ScriptedEngine(TOK, ["a"], weight_version=2) as eng,
        EngineClient(eng.url, retries=2, retry_backoff=0.01) as c,
    ):
        eng.fail("/model_info", 503, times=2)
        assert await c.weight_version() == 2
        eng.fail("/model_info", 502, times=1)
        assert (await c.model_info())["model_path"] == "scripted"
        eng.fail("/health", 503, times=1)
        assert await c.health() is True
        eng.fail("/generate", 503, times=1)
        with pytest.raises(EngineUnavailable):
            await c.generate([1], SAMPLING)
        assert (await c.generate([1], SAMPLING)).output_ids  # the script was not consumed


@pytest.mark.integration
async def test_timeout_is_unavailable_and_aborts_the_request() -> None:
    """A generate that outlives its timeout fails as unavailable and is aborted on the engine."""
    async with ScriptedEngine(TOK, [Reply(text="slow", delay=5)]) as eng:
        async with EngineClient(eng.url) as c:
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailable, match="timed out"):
                await c.generate([1], SAMPLING, rid="slow-1", timeout=0.3)
            assert time.monotonic() - t0 < 2
        assert ("/abort_request", {"rid": "slow-1"}) in eng.control


@pytest.mark.integration
async def test_cancelled_generate_aborts_on_engine() -> None:
    """The harness went away (task cancelled): the engine gets /abort_request for the rid."""
    async with ScriptedEngine(TOK, [Reply(text="slow", delay=5)]) as eng:
        async with EngineClient(eng.url) as c:
            task = asyncio.create_task(c.generate([1], SAMPLING, rid="gone-1"))
            await until(lambda: eng.requests, 10, "the call at the engine")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert ("/abort_request", {"rid": "gone-1"}) in eng.control


@pytest.mark.integration
async def test_control_calls() -> None:
    """Weight update (version passed as a string inside it), pause/resume, abort."""
    async with ScriptedEngine(TOK, []) as eng, EngineClient(eng.url) as c:
        res = await c.update_weights_from_disk("/ckpt/v5", 5, abort_all_requests=False)
        assert res["success"] and await c.weight_version() == 5
        await c.pause("retract")
        assert eng.paused
        await c.resume()
        assert not eng.paused
        await c.abort("x")
        with pytest.raises(ValueError):
            await c.pause("nap")
    paths = [p for p, _ in eng.control]
    assert paths == [
        "/update_weights_from_disk",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
    ]
    assert eng.control[0][1] == {
        "model_path": "/ckpt/v5",
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "5",
    }


# ---------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------


def _engines(n: int, **kw) -> list[ScriptedEngine]:
    return [ScriptedEngine(TOK, lambda ids, body: Reply(text="ok", **kw)) for _ in range(n)]


async def _start(engines: list[ScriptedEngine]) -> None:
    for e in engines:
        await e.start()


async def _stop(engines: list[ScriptedEngine]) -> None:
    for e in engines:
        await e.stop()


@pytest.mark.integration
async def test_router_is_sticky_per_key() -> None:
    """Calls of one rollout stay on one engine (its prefix cache); rollouts spread out."""
    engines = _engines(2)
    await _start(engines)
    try:
        async with EngineRouter([e.url for e in engines], health_interval=0) as router:
            served = {}
            for rollout in ("a", "b", "c", "d"):
                urls = {
                    (await router.generate([1, 2], SAMPLING, key=rollout)).engine for _ in range(3)
                }
                assert len(urls) == 1
                served[rollout] = urls.pop()
            reused = sum(s.client.ids_json.reused for s in router.slots)
            router.forget("a")
            assert sum("a" in s.client.ids_json._last for s in router.slots) == 0
        assert set(served.values()) == {e.url for e in engines}
        assert reused == 8  # the 2nd and 3rd call of each rollout
    finally:
        await _stop(engines)


@pytest.mark.integration
async def test_router_least_outstanding() -> None:
    """Concurrent unkeyed calls go to the engine with the fewest in flight."""
    engines = _engines(2, delay=0.3)
    await _start(engines)
    try:
        async with EngineRouter([e.url for e in engines], health_interval=0) as router:
            results = await asyncio.gather(*(router.generate([1], SAMPLING) for _ in range(6)))
        counts = [sum(r.engine == e.url for r in results) for e in engines]
        assert counts == [3, 3]
        # a busy sticky engine gives its key away once it is max_imbalance ahead
        async with EngineRouter([e.url for e in engines], health_interval=0, max_imbalance=1) as r2:
            first = await r2.generate([1], SAMPLING, key="k")
            sent = sum(len(e.requests) for e in engines)
            busy = [asyncio.create_task(r2.generate([1], SAMPLING, key="k")) for _ in range(2)]
            at_engines = lambda: sum(len(e.requests) for e in engines) == sent + 2  # noqa: E731
            await until(at_engines, 10, "both busy calls at the engine")
            moved = await r2.generate([1], SAMPLING, key="k")
            await asyncio.gather(*busy)
        assert moved.engine != first.engine
    finally:
        await _stop(engines)


@pytest.mark.integration
async def test_router_ejects_unhealthy_and_readmits() -> None:
    """An engine failing health checks leaves rotation, and comes back when healthy."""
    engines = _engines(2)
    await _start(engines)
    bad = engines[0]
    try:
        async with EngineRouter(
            [e.url for e in engines], health_interval=0.05, eject_after=2
        ) as router:
            healthy = lambda: [s["healthy"] for s in router.status()]  # noqa: E731
            bad.healthy = False
            await until(lambda: healthy() == [False, True], 10, "the bad engine ejected")
            for key in "abcd":
                assert (await router.generate([1], SAMPLING, key=key)).engine == engines[1].url
            bad.healthy = True
            await until(lambda: healthy() == [True, True], 10, "the engine readmitted")
            got = {(await router.generate([1], SAMPLING, key=k)).engine for k in "efgh"}
            assert bad.url in got
    finally:
        await _stop(engines)


@pytest.mark.integration
async def test_router_moves_call_off_a_dead_engine() -> None:
    """A refused generate ejects the engine at once and the call is served elsewhere."""
    engines = _engines(2)
    await _start(engines)
    try:
        async with EngineRouter([e.url for e in engines], health_interval=0) as router:
            first = await router.generate([1], SAMPLING, key="r")
            dead = next(e for e in engines if e.url == first.engine)
            await dead.stop()
            again = await router.generate([1], SAMPLING, key="r")
            assert again.engine != dead.url
            assert not next(s for s in router.status() if s["url"] == dead.url)["healthy"]
            await dead.start()  # same port
            await router.check_once()
            assert all(s["healthy"] for s in router.status())
    finally:
        await _stop(engines)


@pytest.mark.integration
async def test_router_no_engine_is_unavailable() -> None:
    """With every engine down, a call waits wait_healthy_s and then fails as unavailable."""
    router = EngineRouter(
        [f"http://127.0.0.1:{free_port()}"],
        health_interval=0,
        wait_healthy_s=0.2,
        client_kw={"retries": 0},
    )
    await router.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="no healthy engine"):
            await router.generate([1], SAMPLING)
        assert 0.15 < time.monotonic() - t0 < 2
    finally:
        await router.close()


@pytest.mark.integration
async def test_router_retries_abort_caused_by_weight_swap() -> None:
    """A weight update aborts the call before any token: the router retries it on the new
    weights; the harness never sees the abort."""
    async with (
        ScriptedEngine(TOK, [Reply(text="old", delay=5), "new"], weight_version=1) as eng,
        EngineRouter([eng.url], health_interval=0) as router,
    ):
        call = asyncio.create_task(router.generate([1], SAMPLING, rid="w1"))
        await until(lambda: eng.requests, 10, "the call at the engine")
        async with EngineClient(eng.url) as c:
            await c.update_weights_from_disk("/ckpt/2", 2, abort_all_requests=True)
        res = await call
    assert res.finish_reason == "stop" and res.text == "new<|im_end|>"
    assert res.weight_version_end == 2
    assert [r["rid"] for r in eng.requests] == ["w1", "w1-1"]


@pytest.mark.integration
async def test_router_does_not_retry_its_own_abort() -> None:
    """An abort the proxy asked for (harness gone) is final."""
    async with (
        ScriptedEngine(TOK, [Reply(text="x", delay=5), "y"]) as eng,
        EngineRouter([eng.url], health_interval=0, swap_wait_s=0.2) as router,
    ):
        call = asyncio.create_task(router.generate([1], SAMPLING, rid="mine"))
        await until(lambda: eng.requests, 10, "the call at the engine")
        await router.abort("mine")
        res = await call
    assert (res.finish_reason, res.output_ids) == ("abort", [])
    assert len(eng.requests) == 1


@pytest.mark.integration
async def test_router_pause_abort_then_swap_is_retried() -> None:
    """SGLang-style update: pause(abort) first, new version a little later, then continue."""
    async with (
        ScriptedEngine(TOK, [Reply(text="old", delay=5), "new"], weight_version=1) as eng,
        EngineRouter([eng.url], health_interval=0) as router,
    ):
        call = asyncio.create_task(router.generate([1], SAMPLING))
        await until(lambda: eng.requests, 10, "the call at the engine")
        async with EngineClient(eng.url) as c:
            await c.pause("abort")
            await asyncio.sleep(0.2)  # the new version comes a little after the pause
            await c.update_weights_from_disk("/ckpt/2", 2)
            await c.resume()
        res = await call
    assert (res.text, res.weight_version_end) == ("new<|im_end|>", 2)


# ---------------------------------------------------------------------------------------------
# scripted engine as a subprocess
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_scripted_engine_subprocess(tmp_path: Path) -> None:
    """``python -m harnessrl.proxy.scripted`` prints its URL and serves the script file."""
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"replies": [[7, 8, 2]], "default": {"ids": [9]}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "harnessrl.proxy.scripted", "--port", "0", "--script", str(script)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.startswith("scripted engine ready: http://127.0.0.1:")
        url = line.split(": ", 1)[1].strip()
        async with EngineClient(url) as c:
            a = await c.generate([1], {"stop_token_ids": [2]})
            b = await c.generate([1], {})
        assert (a.output_ids, a.finish_reason) == ([7, 8, 2], "stop")
        assert (b.output_ids, b.finish_reason) == ([9], "length")
    finally:
        proc.terminate()
        proc.wait(10)
