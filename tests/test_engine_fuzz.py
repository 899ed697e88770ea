"""Fuzz: malformed ``/generate`` bodies never get a 5xx from the embedded engine.

Hypothesis takes valid ``/generate`` bodies (ids or text, one prompt or a batch, with sampling
params and rids) and breaks them (``tests.fuzzing``: fields deleted or replaced, numbers out of
every range, lone surrogates, JSON nested 100,000 deep, integers beyond 64 bits, batches larger
than the queue), or sends bytes that are not JSON. Every answer must be a 200 with a reply per
prompt or a 4xx in SGLang's error shape; the engine serves on and its scheduler stays alive.

One real engine (tiny-1m, a 64-token context, a queue of 8) serves the whole module.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harnessrl.common.models import resolve_model
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine import EngineServer
from tests import fuzzing

SP = {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_token_ids": [2]}
VALID = [
    {"input_ids": [5, 6, 7], "sampling_params": SP, "return_logprob": True, "rid": "a"},
    {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": [SP, SP], "rid": ["b", "c"]},
    {"text": "Hello there", "sampling_params": {**SP, "skip_special_tokens": False}},
    {"text": ["one", "two"], "sampling_params": SP, "return_text_in_logprobs": True},
]
KEYS = st.sampled_from(
    ["input_ids", "text", "sampling_params", "rid", "return_logprob", "stream",
     "max_new_tokens", "temperature", "top_p", "stop_token_ids", "sampling_seed", "n"]
)  # fmt: skip


class Served:
    """An engine on a real port, driven from synchronous hypothesis tests through one loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def start(self) -> None:
        cfg = EngineConfig(
            model=str(resolve_model("tiny-1m")), port=0, threads=1, max_context=64, max_queue=8
        )
        self.srv = await EngineServer(cfg).start()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def stop(self) -> None:
        await self.session.close()
        await self.srv.stop()

    async def post(self, data: bytes, path: str = "/generate") -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        async with self.session.post(self.srv.url + path, data=data, headers=headers) as r:
            return r.status, json.loads(await r.read())


@pytest.fixture(scope="module")
def served():
    s = Served()
    s.run(s.start())
    yield s
    s.run(s.stop())
    s.loop.close()


def check_answer(body: Any, status: int, reply: Any) -> None:
    assert status < 500, (status, reply)
    if status != 200:
        assert status == 400, (status, reply)
        assert reply["error"]["code"] == 400 and isinstance(reply["error"]["message"], str)
        return
    replies = reply if isinstance(reply, list) else [reply]
    for r in replies:
        assert isinstance(r["output_ids"], list) and r["meta_info"]["finish_reason"]["type"]


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "bytes", "batch"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "batch":  # batches around the queue's size, some larger than it can ever hold
        n = draw(st.integers(1, 5000))
        return fuzzing.encode({"input_ids": [[5, 6]] * n, "sampling_params": {"max_new_tokens": 1}})
    return fuzzing.encode(draw(fuzzing.mutated(draw(st.sampled_from(VALID)), KEYS)))


FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.integration
def test_fuzzed_generate_never_gets_a_5xx(served: Served) -> None:
    """Broken ``/generate`` bodies: a 200 or a 400 in SGLang's error shape, never a 5xx."""

    @FUZZ
    @given(data=bodies())
    @example(data=b'{"input_ids": [1, 1180591620717411303424]}')
    @example(data=b'{"text": "caf\\udcff"}')
    @example(data=fuzzing.encode({"input_ids": [1, 2], "rid": fuzzing.DEEP}))
    @example(data=fuzzing.encode({"input_ids": [[1, 2]] * 5000}))
    def fuzz(data: bytes) -> None:
        check_answer(data, *served.run(served.post(data)))

    fuzz()


@pytest.mark.integration
def test_abort_request_fuzz_never_gets_a_5xx(served: Served) -> None:
    """``/abort_request`` with any body: a 200 or a 400, never a 5xx."""

    @FUZZ
    @given(body=fuzzing.mutated({"rid": "a", "abort_all": False}, KEYS))
    def fuzz(body: Any) -> None:
        status, reply = served.run(served.post(fuzzing.encode(body), "/abort_request"))
        assert status < 500, (status, reply)

    fuzz()


@pytest.mark.integration
def test_still_serving_after_the_fuzz(served: Served) -> None:
    """After all that, the scheduler is alive and a valid request of each kind is answered."""
    assert served.srv.engine.alive
    for body in VALID:
        status, reply = served.run(served.post(fuzzing.encode(body)))
        assert status == 200, reply
        check_answer(body, status, reply)
