"""Tests for the embedded engine (proxy/engine/): SGLang's native API over loopback HTTP.

Every test starts a real ``EngineServer`` on a free port with the tiny-1m model and checks its
replies against fresh full forward passes of a separately loaded reference model (fp32, 1e-4).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from harnessrl.common import metrics
from harnessrl.common.config import undocumented_fields
from harnessrl.common.models import load_model, resolve_model
from harnessrl.common.weights import WeightSender, init_weight_group, push_weights_distributed
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine import (
    EngineServer,
    PrefixCache,
    SamplingParams,
    load_state_dict,
    sample,
)

TOL = 1e-4
VOCAB = 8192


# ------------------------------------------------------------------------------------------
# Fixtures and helpers
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model("tiny-1m")


@pytest.fixture(scope="module")
def new_dir() -> Path:
    """Same architecture, other weights: the target of weight updates."""
    return resolve_model("tiny-1m@seed1")


@pytest.fixture(scope="module")
def ref(model_dir: Path):
    return load_model(model_dir).requires_grad_(False)


@pytest.fixture(scope="module")
def ref_new(new_dir: Path):
    return load_model(new_dir).requires_grad_(False)


@contextlib.asynccontextmanager
async def engine(model_dir: Path, **overrides: Any):
    """A running engine and an HTTP session to it."""
    cfg = EngineConfig(model=str(model_dir), port=0, threads=1, **overrides)
    async with EngineServer(cfg) as srv, aiohttp.ClientSession(srv.url) as http:
        yield srv, http


async def post(http: aiohttp.ClientSession, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    async with http.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


async def generate(http: aiohttp.ClientSession, ids: list[int], **sp: Any) -> dict[str, Any]:
    rid = sp.pop("rid", None)
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    if rid:
        body["rid"] = rid
    status, reply = await post(http, "/generate", body)
    assert status == 200, reply
    return reply


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def ref_truncate(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Reference top-k / top-p / min-p truncation, one row at a time."""
    x = x.clone()
    for row in x:
        if 0 < top_k < row.numel():
            row[row < row.sort(descending=True).values[top_k - 1]] = -math.inf
        if top_p < 1:
            vals, order = row.sort(descending=True)
            probs = vals.softmax(-1)
            before = probs.cumsum(-1) - probs  # mass strictly above each token
            row[order[before > top_p]] = -math.inf
        if min_p > 0:
            probs = row.softmax(-1)
            row[probs < min_p * probs.max()] = -math.inf
    return x


def ref_logprobs(
    model, prompt: list[int], output: list[int], sp: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``output`` under a fresh full forward pass, as the engine defines them, and
    the raw logits of the positions that predicted them."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    t = sp.get("temperature", 1.0)
    x = ref_truncate(logits / t, sp.get("top_k", -1), sp.get("top_p", 1.0), 0.0) if t else logits
    lp = torch.log_softmax(x, -1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0], logits


def got_logprobs(reply: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]])


def assert_matches(model, prompt: list[int], reply: dict[str, Any], sp: dict[str, Any]) -> None:
    out = [t for _, t, _ in reply["meta_info"]["output_token_logprobs"]]
    exp, logits = ref_logprobs(model, prompt, out, sp)
    err = float((exp - got_logprobs(reply)).abs().max())
    assert err < TOL, (err, sp, reply["meta_info"]["cached_tokens"])
    if sp.get("temperature", 1.0) == 0:  # greedy: each token is the argmax of the forward
        assert logits.argmax(-1).tolist() == out


async def wait_generated(srv: EngineServer, n: int, timeout: float = 60.0) -> None:
    """Wait until the engine has run at least ``n`` steps (requests are in flight)."""
    start = srv.engine.steps
    for _ in range(int(timeout / 0.01)):
        if srv.engine.steps >= start + n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine made no progress")


# ------------------------------------------------------------------------------------------
# Config, sampler and cache units
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_config_fields_documented() -> None:
    assert undocumented_fields(EngineConfig) == []
    with pytest.raises(ValueError):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ValueError):
        EngineConfig(bogus=1)


@pytest.mark.unit
def test_sampler_truncation() -> None:
    """top_k=1 and a tiny top_p pick the argmax with log-prob 0; T=0 reports T=1 log-probs."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.3, top_p=1e-6),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.5),
    ]
    toks, lps = sample(logits, params, [0.3, 0.9, 0.0, 0.99])
    best = logits.argmax(-1).tolist()
    assert toks[:3] == best[:3]
    assert lps[0] == 0.0 and lps[1] == 0.0
    assert lps[2] == pytest.approx(float(torch.log_softmax(logits[2], -1)[best[2]]), abs=1e-6)
    ref = torch.log_softmax(ref_truncate(logits[3:4], 5, 0.5, 0.0), -1)[0]
    assert math.isfinite(lps[3]) and lps[3] == pytest.approx(float(ref[toks[3]]), abs=1e-6)
    assert params[0].truncated and not params[2].truncated


@pytest.mark.unit
def test_prefix_cache_lru_and_cover() -> None:
    """Entries that a longer one extends are dropped; the byte bound evicts least recently used."""
    kv = lambda n: lambda: torch.zeros(1, 2, 1, n, 4)  # noqa: E731 - 32 bytes per token
    cache = PrefixCache(capacity_bytes=32 * 100 + 8 * 200)
    a = torch.arange(10).numpy()
    assert cache.insert(a, kv(10))
    assert cache.insert(torch.arange(20).numpy(), kv(20))  # extends a: a is dropped
    assert len(cache.entries) == 1
    assert not cache.insert(a, kv(10))  # covered by the longer entry
    entry, n = cache.lookup(torch.tensor([0, 1, 2, 99]).numpy(), limit=3)
    assert n == 3 and len(entry.tokens) == 20
    b = (torch.arange(60) + 1000).numpy()
    assert cache.insert(b, kv(60))
    c = (torch.arange(60) + 5000).numpy()
    assert cache.insert(c, kv(60))  # over the bound: evicts the oldest (0..19)
    assert [len(e.tokens) for e in cache.entries.values()] == [60, 60]
    assert cache.lookup(a, limit=9) == (None, 0)
    assert cache.nbytes <= cache.capacity


# ------------------------------------------------------------------------------------------
# /generate
# ------------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_reply_shape(model_dir: Path, ref) -> None:
    """The reply has SGLang's shape, field by field, and greedy log-probs match a forward."""
    prompt = rand_ids(12, 1)
    sp = {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}
    async with engine(model_dir) as (_, http):
        reply = await generate(http, prompt, rid="req-1", **sp)
    assert set(reply) == {"text", "output_ids", "meta_info"}
    meta = reply["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "length", "length": 7}
    assert meta["prompt_tokens"] == 12 and meta["completion_tokens"] == 7
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 7}]
    assert meta["logprobs_truncated"] is False
    assert isinstance(meta["e2e_latency"], float)
    lps = meta["output_token_logprobs"]
    assert len(lps) == 7 and all(len(e) == 3 and e[2] is None for e in lps)
    assert all(isinstance(lp, float) and lp <= 0 and isinstance(t, int) for lp, t, _ in lps)
    assert reply["output_ids"] == [t for _, t, _ in lps]
    assert isinstance(reply["text"], str) and reply["text"]
    assert_matches(ref, prompt, reply, sp)


@pytest.mark.integration
async def test_finish_reasons_and_stop_trim(model_dir: Path, ref, tmp_path: Path) -> None:
    """stop_token_ids and eos end with type stop + matched; no_stop_trim keeps the token."""
    prompt = rand_ids(9, 2)
    async with engine(model_dir) as (_, http):
        first = await generate(http, prompt, max_new_tokens=5, temperature=0)
        stop = first["output_ids"][2]
        upto = first["output_ids"].index(stop) + 1
        sp = {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [stop]}
        kept = await generate(http, prompt, no_stop_trim=True, **sp)
        trimmed = await generate(http, prompt, **sp)
        for reply in (kept, trimmed):
            assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            assert reply["meta_info"]["completion_tokens"] == upto
            assert len(reply["meta_info"]["output_token_logprobs"]) == upto
        assert kept["output_ids"] == first["output_ids"][:upto]
        assert trimmed["output_ids"] == first["output_ids"][: upto - 1]

        # A model that always says <|im_end|> (id 2) next: an eos stop, by default.
        folder = _eos_model(model_dir, ref, prompt, tmp_path)
        status, body = await post(http, "/update_weights_from_disk", {"model_path": str(folder)})
        assert status == 200 and body["success"], body
        eos = await generate(http, prompt, max_new_tokens=5, temperature=0, no_stop_trim=True)
        assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
        assert eos["output_ids"] == [2] and eos["text"] == ""
        status, plain = await post(http, "/generate", {"input_ids": prompt})
        assert plain["output_ids"] == [] and plain["text"] == ""  # SGLang's default trims it
        raw = await generate(
            http,
            prompt,
            max_new_tokens=1,
            temperature=0,
            no_stop_trim=True,
            skip_special_tokens=False,
        )
        assert raw["text"] == "<|im_end|>"
        ignored = await generate(http, prompt, max_new_tokens=3, temperature=0, ignore_eos=True)
        assert ignored["meta_info"]["finish_reason"]["type"] == "length"


def _eos_model(model_dir: Path, ref, prompt: list[int], tmp_path: Path) -> Path:
    """A copy of the model whose next token after ``prompt`` is certainly id 2."""
    from safetensors.torch import save_file

    folder = tmp_path / "eos-model"
    shutil.copytree(model_dir, folder)
    state = load_state_dict(folder)
    with torch.no_grad():
        out = ref.model(input_ids=torch.tensor([prompt + [2, 2, 2, 2]]))
    h = out.last_hidden_state[0, len(prompt) - 1]
    emb = state["model.embed_tokens.weight"].clone()
    emb[2] = h / h.norm() ** 2 * 1000.0  # logit of id 2 becomes 1000
    state["model.embed_tokens.weight"] = emb
    state.pop("lm_head.weight", None)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.integration
@pytest.mark.parametrize(
    "overrides",
    [
        {"max_batch_size": 16, "prefill_chunk": 64},
        {"max_batch_size": 5, "prefill_chunk": 32},
    ],
    ids=["batch16-chunk64", "batch5-chunk32"],
)
async def test_concurrent_logprobs_match_forward(model_dir: Path, ref, overrides) -> None:
    """16 concurrent requests of mixed lengths and sampling params, some hitting the prefix
    cache: every log-prob equals a fresh full forward pass (fp32, 1e-4)."""
    warm_prompt = rand_ids(150, 3)
    kinds = [
        {"temperature": 0},
        {"temperature": 0.7},
        {"temperature": 1.3, "sampling_seed": 5},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.8, "top_k": 20},
        {"temperature": 1.0, "top_k": 50, "top_p": 0.8},
    ]
    async with engine(model_dir, **overrides) as (srv, http):
        warm = await generate(http, warm_prompt, max_new_tokens=12, temperature=0, ignore_eos=True)
        base = warm_prompt + warm["output_ids"]
        jobs = []
        for i in range(16):
            sp = {**kinds[i % len(kinds)], "max_new_tokens": 6 + (i * 5) % 17, "ignore_eos": True}
            if i % 3 == 0:  # extends the warm request: a prefix-cache hit
                prompt = base + rand_ids(1 + i, 100 + i)
            else:
                prompt = rand_ids(1 + (i * 37) % 260, 200 + i)
            jobs.append((prompt, sp))
        replies = await asyncio.gather(*(generate(http, p, **sp) for p, sp in jobs))
        peak = srv.engine.peak_batch
    assert peak >= 4
    for (prompt, sp), reply in zip(jobs, replies, strict=True):
        meta = reply["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["completion_tokens"] == sp["max_new_tokens"]
        assert meta["logprobs_truncated"] == ("top_p" in sp or "top_k" in sp)
        if prompt[: len(base)] == base:
            assert meta["cached_tokens"] >= len(base) - 1
        assert_matches(ref, prompt, reply, sp)


@pytest.mark.integration
async def test_prefix_cache_hit_gives_same_logprobs(model_dir: Path, ref) -> None:
    """A request extending an earlier input+output reuses its KV (cached_tokens) and gets the
    same tokens and log-probs as without the cache."""
    prompt = rand_ids(300, 4)
    async with engine(model_dir, prefill_chunk=128) as (_, http):
        first = await generate(http, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
        turn2 = prompt + first["output_ids"] + rand_ids(25, 5)
        hit = await generate(http, turn2, max_new_tokens=8, temperature=0, ignore_eos=True)
        status, _ = await post(http, "/flush_cache", {})
        assert status == 200
        miss = await generate(http, turn2, max_new_tokens=8, temperature=0, ignore_eos=True)
    assert hit["meta_info"]["cached_tokens"] == len(prompt) + 10 - 1
    assert miss["meta_info"]["cached_tokens"] == 0
    assert hit["output_ids"] == miss["output_ids"]
    assert float((got_logprobs(hit) - got_logprobs(miss)).abs().max()) < 1e-5
    assert_matches(ref, turn2, hit, {"temperature": 0})


@pytest.mark.integration
async def test_same_prompt_group_shares_one_prefill(model_dir: Path, ref) -> None:
    """n copies of one long prompt sent at once: one prefill, the others reuse it."""
    prompt = rand_ids(400, 6)
    sp = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    async with engine(model_dir, prefill_chunk=64) as (_, http):
        replies = await asyncio.gather(*(generate(http, prompt, **sp) for _ in range(4)))
    cached = sorted(r["meta_info"]["cached_tokens"] for r in replies)
    assert cached == [0, 399, 399, 399]
    for reply in replies:
        assert_matches(ref, prompt, reply, sp)


@pytest.mark.integration
async def test_batch_input_and_text(model_dir: Path) -> None:
    """A list of prompts is a batch (list reply); ``text`` input is tokenized."""
    async with engine(model_dir) as (_, http):
        body = {
            "input_ids": [rand_ids(5, 7), rand_ids(8, 8)],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "rid": ["a", "b"],
        }
        status, replies = await post(http, "/generate", body)
        assert status == 200 and [r["meta_info"]["id"] for r in replies] == ["a", "b"]
        status, reply = await post(
            http, "/generate", {"text": "Hello world", "sampling_params": {"max_new_tokens": 2}}
        )
        assert status == 200 and reply["meta_info"]["prompt_tokens"] >= 2


# ------------------------------------------------------------------------------------------
# Abort, pause, continue
# ------------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_abort_running_and_queued(model_dir: Path) -> None:
    """/abort_request ends a running request (tokens so far) and a queued one (no tokens)."""
    async with engine(model_dir) as (srv, http):
        sp = {"max_new_tokens": 20000, "temperature": 1.0, "ignore_eos": True}
        running = asyncio.ensure_future(generate(http, rand_ids(10, 9), rid="long", **sp))
        await wait_generated(srv, 3)
        status, body = await post(http, "/abort_request", {"rid": "long"})
        assert status == 200 and body["aborted"] == 1
        reply = await asyncio.wait_for(running, 60)
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < reply["meta_info"]["completion_tokens"] < 20000
        assert len(reply["meta_info"]["output_token_logprobs"]) == len(reply["output_ids"])

        # Queued behind a pause: aborted before prefill, so no tokens at all.
        await post(http, "/pause_generation", {"mode": "in_place"})
        queued = asyncio.ensure_future(generate(http, rand_ids(10, 10), rid="queued", **sp))
        await asyncio.sleep(0.2)
        assert not queued.done()
        status, body = await post(http, "/abort_request", {"rid": "queued"})
        assert status == 200 and body["aborted"] == 1
        reply = await asyncio.wait_for(queued, 30)
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        assert reply["output_ids"] == [] and reply["meta_info"]["completion_tokens"] == 0
        assert reply["meta_info"]["output_token_logprobs"] == []
        await post(http, "/continue_generation", {})
        ok = await generate(http, rand_ids(4, 11), max_new_tokens=2)
        assert ok["meta_info"]["completion_tokens"] == 2


@pytest.mark.integration
async def test_pause_modes(model_dir: Path, ref) -> None:
    """in_place freezes and resumes; retract recomputes and stays exact; abort ends requests."""
    prompt = rand_ids(40, 12)
    sp = {"max_new_tokens": 60, "temperature": 0.9, "ignore_eos": True}
    async with engine(model_dir) as (srv, http):
        for mode in ("in_place", "retract"):
            task = asyncio.ensure_future(generate(http, prompt, **sp))
            await wait_generated(srv, 2)
            status, body = await post(http, "/pause_generation", {"mode": mode})
            assert status == 200 and body["success"]
            steps = srv.engine.steps
            await asyncio.sleep(0.3)
            assert srv.engine.steps == steps and not task.done()
            await post(http, "/continue_generation", {})
            reply = await asyncio.wait_for(task, 60)
            assert reply["meta_info"]["finish_reason"]["type"] == "length"
            assert_matches(ref, prompt, reply, sp)
        task = asyncio.ensure_future(generate(http, prompt, **{**sp, "max_new_tokens": 20000}))
        await wait_generated(srv, 2)
        status, body = await post(http, "/pause_generation", {"mode": "abort"})
        assert status == 200 and body["requests"] == 1
        reply = await asyncio.wait_for(task, 30)
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        status, _ = await post(http, "/pause_generation", {"mode": "sideways"})
        assert status == 400


@pytest.mark.integration
async def test_client_disconnect_aborts(model_dir: Path) -> None:
    """A client that goes away frees its slot: the engine aborts the request."""
    async with engine(model_dir) as (srv, http):
        body = {"input_ids": rand_ids(8, 17), "sampling_params": {"max_new_tokens": 20000}}
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(post(http, "/generate", body), 0.5)
        for _ in range(1000):
            if not srv.engine.active and not srv.engine.waiting:
                break
            await asyncio.sleep(0.01)
        assert not srv.engine.active and not srv.engine.waiting


@pytest.mark.integration
async def test_failed_step_aborts_running_and_engine_survives(model_dir: Path, ref) -> None:
    """An exception inside a forward aborts the requests of that step, not the engine."""
    async with engine(model_dir) as (srv, http):
        real = srv.engine._run_packed

        def broken(*args: Any, **kwargs: Any) -> Any:
            srv.engine._run_packed = real
            raise RuntimeError("boom")

        srv.engine._run_packed = broken
        reply = await generate(http, rand_ids(10, 18), max_new_tokens=4)
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        assert "boom" in reply["meta_info"]["finish_reason"]["message"]
        prompt, sp = rand_ids(10, 19), {"max_new_tokens": 4, "temperature": 0}
        assert_matches(ref, prompt, await generate(http, prompt, **sp), sp)


# ------------------------------------------------------------------------------------------
# Weight updates
# ------------------------------------------------------------------------------------------


async def _check_new_weights(http, ref, ref_new, version: str) -> None:
    prompt = rand_ids(30, 13)
    sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    reply = await generate(http, prompt, **sp)
    assert reply["meta_info"]["weight_version"] == version
    assert reply["meta_info"]["weight_versions"] == [{"version": version, "start": 0, "end": 8}]
    assert_matches(ref_new, prompt, reply, sp)
    old, _ = ref_logprobs(ref, prompt, reply["output_ids"], sp)
    assert float((old - got_logprobs(reply)).abs().max()) > 1e-2
    async with http.get("/get_weight_version") as r:
        assert (await r.json()) == {"weight_version": version}


@pytest.mark.integration
async def test_update_from_disk_during_generation(
    model_dir: Path, new_dir: Path, ref, ref_new
) -> None:
    """Requests in flight finish across a swap (and say so); later ones use the new weights."""
    sp = {"max_new_tokens": 150, "temperature": 1.0, "ignore_eos": True}
    async with engine(model_dir) as (srv, http):
        tasks = [
            asyncio.ensure_future(generate(http, rand_ids(20, 20 + i), **sp)) for i in range(3)
        ]
        await wait_generated(srv, 3)
        status, body = await post(
            http, "/update_weights_from_disk", {"model_path": str(new_dir), "weight_version": "1"}
        )
        assert status == 200 and body["success"], body
        assert not all(t.done() for t in tasks)
        replies = await asyncio.gather(*tasks)
        for reply in replies:
            meta = reply["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 150
            assert meta["weight_version"] == "1"
        spans = [r["meta_info"]["weight_versions"] for r in replies]
        assert any(s[0]["version"] == "0" for s in spans)
        for s in spans:  # SGLang's spans: consecutive output-token ranges, ending at "1"
            assert s[0]["start"] == 0 and s[-1] == {
                "version": "1",
                "start": s[-1]["start"],
                "end": 150,
            }
            assert all(a["end"] == b["start"] for a, b in zip(s, s[1:], strict=False))
        await _check_new_weights(http, ref, ref_new, "1")
        # Without a version, a numeric one is incremented; abort_all_requests ends requests.
        task = asyncio.ensure_future(generate(http, rand_ids(9, 23), max_new_tokens=20000))
        await wait_generated(srv, 2)
        body = {"model_path": str(new_dir), "abort_all_requests": True}
        status, body = await post(http, "/update_weights_from_disk", body)
        assert status == 200
        reply = await asyncio.wait_for(task, 30)
        assert reply["meta_info"]["finish_reason"]["type"] == "abort"
        async with http.get("/get_weight_version") as r:
            assert (await r.json())["weight_version"] == "2"


@pytest.mark.integration
async def test_update_from_disk_bad_path_keeps_old_weights(
    model_dir: Path, ref, tmp_path: Path
) -> None:
    """A bad model_path (missing, not a model, wrong shapes) is a 400; the old weights serve."""
    wrong = tmp_path / "wrong"
    shutil.copytree(model_dir, wrong)
    from safetensors.torch import save_file

    state = load_state_dict(wrong)
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(wrong / "model.safetensors"))
    async with engine(model_dir) as (_, http):
        for path in ("/no/such/model", str(tmp_path), str(wrong)):
            status, body = await post(
                http, "/update_weights_from_disk", {"model_path": path, "weight_version": "9"}
            )
            assert status == 400 and body["success"] is False and body["message"], body
        prompt = rand_ids(15, 14)
        sp = {"max_new_tokens": 5, "temperature": 0}
        reply = await generate(http, prompt, **sp)
        assert reply["meta_info"]["weight_version"] == "0"
        assert_matches(ref, prompt, reply, sp)


@pytest.mark.integration
async def test_update_from_distributed_gloo(model_dir: Path, new_dir: Path, ref, ref_new) -> None:
    """SGLang's distributed update over gloo (trainer = this process, rank 0), in two buckets,
    with a request in flight."""
    named = list(load_state_dict(new_dir).items())
    sender = WeightSender(world_size=2, timeout_s=60)
    sp = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    try:
        async with engine(model_dir) as (srv, http):
            await init_weight_group(http, [""], sender)
            status, body = await post(http, "/init_weights_update_group", sender.init_request())
            assert status == 400  # the group exists already
            task = asyncio.ensure_future(generate(http, rand_ids(20, 15), **sp))
            await wait_generated(srv, 3)
            half = len(named) // 2
            await post(http, "/pause_generation", {"mode": "in_place"})
            first = await push_weights_distributed(http, [""], sender, named[:half])
            last = await push_weights_distributed(http, [""], sender, named[half:], "7")
            await post(http, "/continue_generation", {})
            for reply in first + last:
                assert reply["status"] == 200 and reply["success"], reply
            done = await asyncio.wait_for(task, 60)
            assert done["meta_info"]["weight_version"] == "7"
            assert done["meta_info"]["weight_versions"][0]["version"] == "0"
            await _check_new_weights(http, ref, ref_new, "7")
            status, body = await post(
                http,
                "/update_weights_from_distributed",
                {**sender.update_request(named), "group_name": "nope"},
            )
            assert status == 400
            status, body = await post(
                http, "/destroy_weights_update_group", {"group_name": sender.group_name}
            )
            assert status == 200 and body["success"]
    finally:
        sender.close()


# ------------------------------------------------------------------------------------------
# Bad input, info endpoints, CLI
# ------------------------------------------------------------------------------------------

BAD_BODIES = [
    "{not json",
    "[1, 2]",
    {},
    {"input_ids": []},
    {"input_ids": [1, VOCAB]},
    {"input_ids": [-1, 5]},
    {"input_ids": ["a", "b"]},
    {"input_ids": [1.5]},
    {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
    {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
    {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
    {"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}},
    {"input_ids": [1, 2], "sampling_params": {"top_k": -5}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [VOCAB]}},
    {"input_ids": [1, 2], "sampling_params": {"n": 2}},
    {"input_ids": [1, 2], "sampling_params": {"bogus": 1}},
    {"input_ids": [1, 2], "sampling_params": "greedy"},
    {"input_ids": [1, 2], "stream": True},
    {"input_ids": [1, 2], "rid": 5},
    {"input_ids": [1, 2], "bogus_field": 1},
    {"input_ids": [1] * 64},  # prompt as long as the context
]


@pytest.mark.integration
async def test_bad_inputs_are_400_and_server_keeps_serving(model_dir: Path) -> None:
    async with engine(model_dir, max_context=64) as (_, http):
        for body in BAD_BODIES:
            status, reply = await post(http, "/generate", body)
            assert status == 400, (body, reply)
            assert reply["error"]["code"] == 400 and reply["error"]["message"], reply
        for path, body in [
            ("/update_weights_from_disk", {}),
            ("/update_weights_from_disk", {"model_path": 5}),
            ("/abort_request", {}),
            ("/init_weights_update_group", {"master_address": "127.0.0.1"}),
            ("/update_weights_from_distributed", {"names": ["x"], "dtypes": [], "shapes": []}),
        ]:
            status, reply = await post(http, path, body)
            assert status == 400, (path, reply)
        status, reply = await post(
            http,
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
        )
        assert status == 400 and "gloo" in reply["message"]  # nccl (the default) is GPU-only
        # A prompt that fits but leaves little room: max_new_tokens is capped to the context.
        reply = await generate(http, [5] * 60, max_new_tokens=100, ignore_eos=True)
        assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert reply["meta_info"]["completion_tokens"] == 4
        reply = await generate(http, [5, 6], max_new_tokens=0)
        assert reply["output_ids"] == [] and reply["meta_info"]["finish_reason"]["type"] == "length"


HOSTILE_BODIES = [
    # (body, words the error must hold): each was a 500 or a 503 that could never succeed
    ({"input_ids": [1, 2**70]}, ["input_ids", str(2**70)]),
    ({"input_ids": [[1, 2], [-(2**70), 3]]}, ["input_ids[1]", "vocabulary"]),
    ({"text": "caf\udcff"}, ["text", "surrogate"]),
    ({"text": ["fine", "\udcff"]}, ["text[1]", "surrogate"]),
    ('{"input_ids": [1, 2], "rid": ' + "[" * 100_000 + "]" * 100_000 + "}", ["nested"]),
    ({"input_ids": [[1, 2]] * 9, "sampling_params": {"max_new_tokens": 1}}, ["9", "max_queue 8"]),
]


@pytest.mark.integration
async def test_hostile_bodies_are_400_naming_the_problem(model_dir: Path) -> None:
    """Ids beyond any integer type, text that is not Unicode, JSON nested 100,000 deep and a
    batch larger than the whole queue: 400s that say what is wrong (never a 500, nor a 503 a
    client would retry forever); a batch as large as the queue is served."""
    async with engine(model_dir, max_context=64, max_queue=8) as (_, http):
        for body, words in HOSTILE_BODIES:
            status, reply = await post(http, "/generate", body)
            assert status == 400, (str(body)[:80], reply)
            for w in words:
                assert w in reply["error"]["message"], (w, reply)
        body = {"input_ids": [[1, 2]] * 8, "sampling_params": {"max_new_tokens": 1}}
        status, replies = await post(http, "/generate", body)
        assert status == 200 and len(replies) == 8


@pytest.mark.integration
async def test_info_endpoints_and_metrics(model_dir: Path) -> None:
    async with engine(model_dir, weight_version="3") as (srv, http):
        async with http.get("/health") as r:
            assert r.status == 200
        async with http.get("/get_model_info") as r:
            info = await r.json()
        assert info["model_path"] == str(model_dir) and info["is_generation"] is True
        assert info["max_context_length"] == 32768 and info["vocab_size"] == VOCAB
        assert info["weight_version"] == "3"
        async with http.get("/get_weight_version") as r:
            assert await r.json() == {"weight_version": "3"}
        async with http.get("/get_server_info") as r:
            assert (await r.json())["max_running_requests"] == 16
        before = metrics.sample_value("hrl_engine_generated_tokens_total")
        await generate(http, rand_ids(6, 16), max_new_tokens=3, ignore_eos=True)
        async with http.get("/metrics") as r:
            text = await r.text()
        for name in (
            "hrl_engine_requests_total",
            "hrl_engine_tokens_per_second",
            "hrl_engine_batch_size",
            "hrl_engine_queue_depth",
            "hrl_engine_prefix_cache_lookups_total",
        ):
            assert name in text
        after = metrics.sample_value("hrl_engine_generated_tokens_total")
        assert after == before + 3
        srv.ready = False
        async with http.get("/health") as r:
            assert r.status == 503
        srv.ready = True


@pytest.mark.integration
def test_cli_ready_line_and_sigterm(model_dir: Path) -> None:
    """``python -m harnessrl.proxy.engine_cmd`` prints the ready line with a free port, stops on SIGTERM."""
    import urllib.request

    from harnessrl.proxy.engine_cmd import READY_RE, spawn_engine

    proc, url = spawn_engine(
        ["--model", str(model_dir), "--port", "0", "--threads", "1", "--insecure"]
    )
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        ready = [line for line in proc.output_lines if READY_RE.match(line)]
        assert len(ready) == 1 and "weight_version 0" in ready[0], proc.output_lines
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
