"""The SGLang contract, checked against SGLang's own code at the release pinned by the
``sglang`` extra of ``pyproject.toml`` (``tests/sglang_source.py`` explains how its code is
loaded without importing ``sglang``, which needs a GPU stack).

* Every request harnessrl sends to an engine, made by the real code paths (the client, the
  router's health sweep, the proxy stack's start and calls, the weight updater, the learner's
  distributed publisher, the dashboard), goes to a scripted engine whose every request is
  first judged as SGLang's server judges it (`Contract`: its route table, its request classes
  validated with pydantic as FastAPI does, its generated ``/generate`` JSON contract). None may
  be refused, and the ``/generate`` body then passes what SGLang's tokenizer manager does next
  (``normalize_batch_and_arguments``, ``SamplingParams(...).normalize/verify``) with the values
  harnessrl relies on.
* The embedded and scripted engines answer ``/generate``, ``/model_info`` and ``/server_info``
  in the shapes SGLang's API types decode, with the fields the client reads, and serve no
  route SGLang lacks (except the few listed extensions).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import types
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web

from harnessrl.common.bus import connect
from harnessrl.common.models import load_tokenizer, resolve_model
from harnessrl.common.weights import WeightSender, init_weight_group
from harnessrl.proxy.calls import CallRequest
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine import EngineServer
from harnessrl.proxy.proxy_config import ProxySettings
from harnessrl.proxy.scripted import Reply, ScriptedEngine
from harnessrl.proxy.sglang import EngineClient, EngineRouter
from harnessrl.proxy.stack import engine_context, open_proxy_stack
from harnessrl.proxy.weights_sync import engine_apply
from tests import sglang_source
from tests.sglang_source import Contract, Violation

REPO = Path(__file__).resolve().parents[1]
TOK = load_tokenizer("tiny-1m")
VOCAB = 8192

EXTENSIONS = {
    ("GET", "/get_weight_version"): "kept for callers of older SGLang; clients read /model_info",
    ("GET", "/metrics"): "SGLang mounts it with --enable-metrics (a Starlette Mount, no route)",
}
"""Routes the embedded and scripted engines serve that SGLang's route table lacks."""


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract(sglang_source.Source())


@dataclasses.dataclass
class Seen:
    method: str
    path: str
    body: Any
    obj: Any


class CheckedEngine(ScriptedEngine):
    """A scripted engine whose every request is first judged by SGLang's `Contract`: a
    request SGLang would refuse is answered as SGLang would (404, 405, 422, 400) and kept in
    ``refused``; the others are kept in ``seen`` (with SGLang's validated request object)."""

    def __init__(self, contract: Contract, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.contract = contract
        self.seen: list[Seen] = []
        self.refused: list[tuple[str, str, bytes, Violation]] = []

    def app(self) -> web.Application:
        app = super().app()
        app.middlewares.insert(0, self._judge)
        return app

    @web.middleware
    async def _judge(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            obj = self.contract.check(request.method, request.path, raw, dict(request.query))
        except Violation as v:
            self.refused.append((request.method, request.path, raw, v))
            return web.json_response(v.body(), status=v.status)
        body = json.loads(raw) if raw.strip() else None
        self.seen.append(Seen(request.method, request.path, body, obj))
        return await handler(request)

    def calls(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]


# ---------------------------------------------------------------------------------------------
# the release and the checker
# ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_pinned_release_is_checked_and_documented(contract: Contract) -> None:
    """The wheel read is the pinned version's, and docs/sglang.md names that version."""
    version = sglang_source.pinned_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", version), version
    assert contract.source.path.name.startswith(f"sglang-{version}-")
    meta = contract.source.zip.read(f"sglang-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in meta
    doc = (REPO / "docs" / "sglang.md").read_text()
    assert f"sglang=={version}" in doc and f"SGLang {version}" in doc


@pytest.mark.unit
def test_the_checker_refuses_what_sglang_refuses(contract: Contract) -> None:
    """Negative controls: the checker is SGLang's judgement, so each of these bodies, which
    SGLang refuses or would silently ignore, is refused."""
    ok = {"model_path": "/w/v3", "weight_version": "3", "flush_cache": True}
    assert contract.check("POST", "/update_weights_from_disk", json.dumps(ok).encode())
    bad = [
        ("GET", "/get_weight_version", {}, 404),  # gone from SGLang: /model_info has it
        ("GET", "/generate", None, 405),
        ("POST", "/update_weights_from_disk", {**ok, "weight_version": 3}, 422),  # a str
        ("POST", "/update_weights_from_disk", {"weight_version": "3"}, 422),  # no model_path
        ("POST", "/update_weights_from_disk", {**ok, "flush": True}, 422),  # ignored by SGLang
        ("POST", "/pause_generation", {"mode": "inplace"}, 422),
        ("POST", "/continue_generation", None, 422),  # the body is a required parameter
        ("POST", "/init_weights_update_group", {"master_address": "h", "master_port": "x"}, 422),
        ("POST", "/generate", {"input_ids": [1, "2"]}, 422),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}}, 400),
        ("POST", "/generate", {"input_ids": [1], "sampling_params": {"top_k": 1.5}}, 400),
        # pydantic (lax) reads "yes" as true; the generated JSON contract refuses it
        ("POST", "/generate", {"input_ids": [1], "return_logprob": "yes"}, 400),
        ("GET", "/model_info", {"x": 1}, 422),  # a body SGLang never reads
    ]
    for method, path, body, status in bad:
        raw = None if body is None else json.dumps(body).encode()
        with pytest.raises(Violation) as err:
            contract.check(method, path, raw)
        assert err.value.status == status, (method, path, body, err.value)


# ---------------------------------------------------------------------------------------------
# what harnessrl sends
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_every_request_harnessrl_sends_validates_as_sglang_validates_it(
    contract: Contract, tmp_path: Path, run_name: str
) -> None:
    def script(ids: list[int], body: dict[str, Any]) -> Reply:
        return Reply(text="slow", delay=5) if body["rid"] == "late" else Reply(text="ls -la")

    eng = CheckedEngine(contract, TOK, script, weight_version=2, context_length=900)
    async with eng:
        # the proxy stack as a rollout opens it: router health sweep, context window, calls
        settings = ProxySettings(engines=[eng.url], model="tiny-1m", top_k=40, max_new_tokens=64)
        bus = await connect(f"memory://{run_name}", run_name)
        try:
            async with open_proxy_stack(settings, bus, health_interval_s=0) as stack:
                assert stack.max_context == 900  # from /server_info: SGLang's model_info lacks it
                stack.caller.seed_rollout("g-0-1", 1234)
                msgs = [{"role": "user", "content": "List the files."}]
                first = await stack.caller.call(CallRequest("g-0-1", msgs, [], max_tokens=5000))
                msgs += [{"role": "assistant", "content": first.parsed.content}]
                msgs += [{"role": "user", "content": "And the hidden ones?"}]
                await stack.caller.call(CallRequest("g-0-1", msgs, []))
        finally:
            await bus.close()
        # the client's every other call
        async with EngineClient(eng.url) as c:
            await c.generate(np.arange(5, 40, dtype=np.int64), {"max_new_tokens": 3}, rid="r-1")
            assert await c.health() and await c.weight_version() == 2
            assert (await c.model_info())["model_path"] == "scripted"
            assert (await c.server_info())["context_length"] == 900
            await c.update_weights_from_disk("/w/v3", 3)
            await c.update_weights_from_disk("/w/v3", abort_all_requests=True)
            await engine_apply(c)(str(tmp_path / "v4"), 4)  # the weight updater's call
            for mode in ("abort", "retract", "in_place"):
                await c.pause(mode)
            await c.resume()
            await c.abort("r-1")
            await c.abort()
            with pytest.raises(Exception, match="timed out"):
                await c.generate([5, 6], {"max_new_tokens": 3}, rid="late", timeout=0.2)
            sender = WeightSender(world_size=2, group_name="hrl-g", timeout_s=5)
            try:
                await c.init_weights_update_group(**sender.init_request(1))
                named = [("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.ones(2, 4))]
                await c.update_weights_from_distributed(**sender.update_request(named, "5"))
            finally:
                sender.close()
        async with EngineRouter([eng.url], health_interval=0) as router:
            await router.check_once()
            assert await engine_context(router) == 900
        await _learner_distributed_publisher(eng.url, run_name)
        await _dashboard_version(eng.url)

    assert eng.refused == [], [(m, p, v.detail) for m, p, _, v in eng.refused]
    called = {(s.method, s.path) for s in eng.seen}
    expected = {
        ("POST", "/generate"),
        ("GET", "/health"),
        ("GET", "/model_info"),
        ("GET", "/server_info"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/abort_request"),
        ("POST", "/init_weights_update_group"),
        ("POST", "/update_weights_from_distributed"),
        ("POST", "/destroy_weights_update_group"),
    }
    assert called == expected, called ^ expected
    for method, path in called:  # the route table read is SGLang's, method included
        assert method in contract.routes[path].methods

    # /generate: every body, then what SGLang's tokenizer manager does with it
    gens = eng.calls("/generate")
    assert len(gens) == 4
    sampling = contract.source.extract("sglang.srt.sampling.sampling_params", "SamplingParams")
    for g in gens:
        obj = g.obj
        obj.normalize_batch_and_arguments()
        assert obj.is_single and obj.rid == g.body["rid"] and isinstance(obj.rid, str)
        assert obj.return_logprob is True and obj.logprob_start_len == -1
        assert obj.stream is False and obj.text is None
        assert obj.input_ids == g.body["input_ids"] and len(obj.input_ids) > 0
        assert all(type(i) is int and 0 <= i < VOCAB for i in obj.input_ids)
        sp = sampling(**obj.sampling_params)
        sp.normalize(None)
        sp.verify(VOCAB)
        assert sp.skip_special_tokens is False and sp.no_stop_trim is True
        assert sp.max_new_tokens == g.body["sampling_params"]["max_new_tokens"] >= 1
    calls = gens[:2]  # the proxy's: the run's sampling, the template's stop ids, a seed
    for g in calls:
        sp = sampling(**g.obj.sampling_params)
        sp.normalize(None)
        sp.verify(VOCAB)
        assert (sp.top_k, sp.temperature, sp.top_p) == (40, 1.0, 1.0)
        assert sp.stop_token_ids and sp.stop_token_ids == set(
            g.body["sampling_params"]["stop_token_ids"]
        )
        assert isinstance(sp.sampling_seed, int) and 0 <= sp.sampling_seed < 2**63
    assert calls[0].obj.sampling_params["max_new_tokens"] <= 900 - len(calls[0].obj.input_ids)
    assert calls[1].obj.input_ids[: len(calls[0].obj.input_ids)] == calls[0].obj.input_ids
    # sampling top_k -1 (the default: disabled) is SGLang's "whole vocabulary" too
    sp = sampling(top_k=-1)
    sp.normalize(None)
    sp.verify(VOCAB)

    # the weight endpoints: the values SGLang acts on
    disk = [s.obj for s in eng.calls("/update_weights_from_disk")]
    assert [(o.model_path, o.weight_version, o.abort_all_requests) for o in disk] == [
        ("/w/v3", "3", False),
        ("/w/v3", None, True),
        (str(tmp_path / "v4"), "4", False),
    ]
    assert all(o.flush_cache is True for o in disk)
    (init,) = [
        s.obj for s in eng.calls("/init_weights_update_group") if s.obj.group_name == "hrl-g"
    ]
    assert (init.rank_offset, init.world_size, init.backend) == (1, 2, "gloo")
    dist = [s.obj for s in eng.calls("/update_weights_from_distributed")]
    first = next(o for o in dist if o.group_name == "hrl-g")
    assert first.names == ["model.norm.weight", "lm_head.weight"]
    assert (first.dtypes, first.shapes, first.weight_version) == (
        ["float32", "float32"],
        [[4], [2, 4]],
        "5",
    )
    pauses = [s.obj.mode for s in eng.calls("/pause_generation")]
    assert pauses == ["abort", "retract", "in_place", "in_place"]
    aborts = [(s.obj.rid, s.obj.abort_all) for s in eng.calls("/abort_request")]
    assert ("r-1", False) in aborts and ("", True) in aborts and ("late", False) in aborts


async def _learner_distributed_publisher(url: str, run: str) -> None:
    """The learner's ``distributed`` transport: join, a 2-bucket version paused in place,
    teardown. The process group itself needs an engine that joins it: here the sender's
    ``connect`` and ``send`` are skipped, the HTTP calls are the real ones."""
    from harnessrl.learner.weights import DistributedPublisher

    bus = await connect(f"memory://{run}-dist", f"{run}-dist")
    pub = DistributedPublisher(bus, [url], bucket_bytes=16, timeout_s=10)
    try:
        pub.session = aiohttp.ClientSession()
        pub.sender = WeightSender(world_size=2, group_name=pub.group_name, timeout_s=5)
        pub.sender.connect = lambda: None  # type: ignore[method-assign]
        pub.sender.send = lambda named: None  # type: ignore[method-assign]
        await init_weight_group(pub.session, [url], pub.sender)
        state = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.ones(2, 4)}
        ready = await pub.publish(6, 6, state)
        assert ready.version == 6
    finally:
        await pub.close()
        await bus.close()


async def _dashboard_version(url: str) -> None:
    """The run dashboard's read of an engine's weight version."""
    from harnessrl.common.run.dashboard import Monitor

    async with aiohttp.ClientSession() as session:
        mon = types.SimpleNamespace(_session=session, engine_api_key_file="", engine_versions={})
        await Monitor._engine_version(mon, "e0", url)  # type: ignore[arg-type]
    assert mon.engine_versions == {"e0": "6"}  # the learner's last version


# ---------------------------------------------------------------------------------------------
# what harnessrl's engines answer
# ---------------------------------------------------------------------------------------------


def _check_generate_reply(contract: Contract, reply: dict[str, Any], n_prompt: int) -> None:
    """SGLang's API types decode the reply, and the fields the client reads are there."""
    api = contract.api
    decoded = api.GenerateResponse.from_json_value(reply)
    meta = reply["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert key in meta, key
    for key in ("weight_version", "weight_versions", "output_token_logprobs"):
        assert key in meta, key
    m = decoded.meta_info
    assert m.prompt_tokens == n_prompt and m.completion_tokens == len(reply["output_ids"])
    assert isinstance(m.finish_reason, api.FinishStop | api.FinishLength | api.FinishAbort)
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert isinstance(m.weight_version, str) and m.weight_versions
    assert m.weight_versions[-1].version == m.weight_version
    assert m.weight_versions[0].start == 0
    assert m.weight_versions[-1].end == m.completion_tokens
    assert [e.token_id for e in m.output_token_logprobs] == decoded.output_ids
    assert all(isinstance(e.logprob, float) and e.logprob <= 0 for e in m.output_token_logprobs)


def _check_info(contract: Contract, model: dict[str, Any], server: dict[str, Any]) -> None:
    api = contract.api
    info = api.GetModelInfoResponse.from_json_value(model)
    assert info.model_path and isinstance(info.weight_version, str)
    api.GetServerInfoResponse.from_json_value(server)
    assert isinstance(server.get("context_length"), int) and server["context_length"] > 0


def _check_routes(contract: Contract, app: web.Application, who: str) -> None:
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        if route.method == "HEAD" or (route.method, path) in EXTENSIONS:
            continue
        sglang = contract.routes.get(path)
        assert sglang is not None, f"{who} serves {path}, which SGLang does not"
        assert route.method in sglang.methods, f"{who}: {route.method} {path} is not SGLang's"


@pytest.mark.integration
async def test_embedded_engine_answers_in_sglang_shapes(contract: Contract) -> None:
    cfg = EngineConfig(model=str(resolve_model("tiny-1m")), port=0, threads=1)
    async with EngineServer(cfg) as srv, EngineClient(srv.url) as c:
        _check_routes(contract, srv._runner.app, "the embedded engine")  # type: ignore[union-attr]
        prompt = list(range(3, 20))
        body = c.generate_payload(prompt, {"max_new_tokens": 6, "temperature": 0.7}, "e-1")
        contract.check("POST", "/generate", json.dumps(body).encode())
        async with aiohttp.ClientSession() as http:
            async with http.post(srv.url + "/generate", json=body) as r:
                assert r.status == 200
                reply = await r.json()
            _check_generate_reply(contract, reply, len(prompt))
            for path in ("/model_info", "/server_info"):
                async with http.get(srv.url + path) as r:
                    assert r.status == 200
            _check_info(contract, await c.model_info(), await c.server_info())
        res = await c.generate(prompt, {"max_new_tokens": 6, "ignore_eos": True}, rid="e-2")
        assert len(res.output_ids) == len(res.logprobs) == 6
        assert res.weight_version_start == res.weight_version_end == 0
        # a weight update while a request runs: several spans, decoded by SGLang's types
        task = asyncio.ensure_future(
            c.generate(prompt, {"max_new_tokens": 400, "ignore_eos": True}, rid="e-3")
        )
        while not srv.engine.active:
            await asyncio.sleep(0.01)
        await c.update_weights_from_disk(str(resolve_model("tiny-1m@seed1")), 1)
        res = await task
    _check_generate_reply(contract, res.raw, len(prompt))
    assert (res.weight_version_start, res.weight_version_end) == (0, 1)


@pytest.mark.integration
async def test_scripted_engine_answers_in_sglang_shapes(contract: Contract) -> None:
    script = [Reply(text="hello"), Reply(text="x", set_version=4)]
    async with (
        ScriptedEngine(TOK, script, weight_version=3, context_length=512) as eng,
        EngineClient(eng.url) as c,
    ):
        _check_routes(contract, eng._runner.app, "the scripted engine")  # type: ignore[union-attr]
        for version in (3, 4):
            res = await c.generate([1, 2, 3], {"max_new_tokens": 20}, rid=f"s-{version}")
            _check_generate_reply(contract, res.raw, 3)
        assert (res.weight_version_start, res.weight_version_end) == (3, 4)
        _check_info(contract, await c.model_info(), await c.server_info())
