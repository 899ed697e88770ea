"""Exact records from real harness traffic: a linear conversation through the real
proxy HTTP server, whatever the API, streaming or not, however each turn ended, assembles into
exactly one branch; and the learner's log-probs over the assembled tree are the engine's."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.common.bus import connect
from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import CallRecord, RolloutResult, SamplingParams
from harnessrl.common.tree import assemble_detailed, expand
from harnessrl.proxy.calls import ModelCaller
from harnessrl.proxy.parsers import HermesParser
from harnessrl.proxy.recorder import Recorder
from harnessrl.proxy.scripted import Reply, ScriptedEngine
from harnessrl.proxy.server import ProxyServer
from harnessrl.proxy.sglang import EngineClient
from harnessrl.proxy.tito import ChatRenderer

pytestmark = pytest.mark.integration

TOK = load_tokenizer("tiny-1m")
R = ChatRenderer(TOK)
IM_END, EOT = 2, 0
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def rollout_result(rid: str, n_calls: int) -> RolloutResult:
    group, k, attempt = rid.rsplit("-", 2)
    return RolloutResult(
        rollout_id=rid, task_id="t", group_id=group, k=int(k), attempt=int(attempt),
        n_calls=n_calls, reward=1.0,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the harness side: each API's request shape, and its reply read back (streamed or not)
# ---------------------------------------------------------------------------------------------


def _events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for block in body.decode().split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _chat_streamed(events: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    calls = []
    for ev in events:
        for c in ev.get("choices", []):
            d = c["delta"]
            msg["content"] += d.get("content") or ""
            if d.get("reasoning_content"):
                msg["reasoning_content"] = msg.get("reasoning_content", "") + d["reasoning_content"]
            calls += [
                {k: v for k, v in tc.items() if k != "index"} for tc in d.get("tool_calls", [])
            ]
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages_streamed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for ev in events:
        if ev["type"] == "content_block_start":
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            b, d = blocks[ev["index"]], ev["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            else:
                b["input"] = json.loads(d["partial_json"])
    return blocks


class Conversation:
    """One harness conversation in one API's shape: the request body, and history updates."""

    def __init__(self, api: str, tools: bool) -> None:
        self.api = api
        self.tools = TOOLS if tools else None
        self.system = "You are terse."
        self.items: list[dict[str, Any]] = []  # messages (chat, messages) or input items
        if api == "chat":
            self.items.append({"role": "system", "content": self.system})

    def body(self, stream: bool) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "m", "stream": stream}
        if self.api == "chat":
            b.update(messages=self.items, max_tokens=4096)
            if self.tools:
                b["tools"] = self.tools
            if stream:
                b["stream_options"] = {"include_usage": True}
        elif self.api == "messages":
            b.update(system=self.system, messages=self.items, max_tokens=4096)
            if self.tools:
                b["tools"] = [
                    {
                        "name": t["function"]["name"],
                        "description": t["function"]["description"],
                        "input_schema": t["function"]["parameters"],
                    }
                    for t in self.tools
                ]
        else:
            b.update(instructions=self.system, input=self.items, max_output_tokens=4096)
            if self.tools:
                b["tools"] = [{"type": "function", **t["function"]} for t in self.tools]
        return b

    def user(self, text: str) -> None:
        if self.api == "responses":
            self.items.append({"type": "message", "role": "user", "content": text})
        else:
            self.items.append({"role": "user", "content": text})

    def reply(self, body: bytes, stream: bool) -> list[str]:
        """Append the assistant's reply (as the harness echoes it); return its tool-call ids."""
        if self.api == "chat":
            msg = _chat_streamed(_events(body)) if stream else json.loads(body)["choices"][0]
            msg = msg if stream else msg["message"]
            self.items.append(msg)
            return [tc["id"] for tc in msg.get("tool_calls") or []]
        if self.api == "messages":
            blocks = _messages_streamed(_events(body)) if stream else json.loads(body)["content"]
            self.items.append({"role": "assistant", "content": blocks})
            return [b["id"] for b in blocks if b["type"] == "tool_use"]
        if stream:
            items = [e["item"] for e in _events(body) if e["type"] == "response.output_item.done"]
        else:
            items = json.loads(body)["output"]
        self.items.extend(items)
        return [i["call_id"] for i in items if i["type"] == "function_call"]

    def results(self, ids: list[str], texts: list[str], user: str | None) -> None:
        """Tool results for ``ids`` (and a user text after them, or alone)."""
        if self.api == "chat":
            for i, t in zip(ids, texts, strict=True):
                self.items.append({"role": "tool", "tool_call_id": i, "content": t})
            if user is not None:
                self.user(user)
        elif self.api == "messages":
            blocks: list[dict[str, Any]] = [
                {"type": "tool_result", "tool_use_id": i, "content": t}
                for i, t in zip(ids, texts, strict=True)
            ]
            if user is not None:
                blocks.append({"type": "text", "text": user})
            self.items.append({"role": "user", "content": blocks})
        else:
            for i, t in zip(ids, texts, strict=True):
                self.items.append({"type": "function_call_output", "call_id": i, "output": t})
            if user is not None:
                self.user(user)


# ---------------------------------------------------------------------------------------------
# a proxy on a real port, driven from synchronous hypothesis tests through one loop
# ---------------------------------------------------------------------------------------------


class Served:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def start(self) -> None:
        import aiohttp

        self.bus = await connect("memory://exact", "exact")
        self.engine = await ScriptedEngine(TOK).start()
        self.client = EngineClient(self.engine.url)
        self.recorder = await Recorder(self.bus).start()
        caller = ModelCaller(self.client, R, HermesParser(), self.recorder)
        self.server = await ProxyServer(caller, {}, ping_s=0.01, stream_grace_s=0.0).start()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def stop(self) -> None:
        await self.session.close()
        await self.server.stop()
        await self.recorder.close()
        await self.client.close()
        await self.engine.stop()
        await self.bus.close()

    async def post(self, api: str, token: str, body: dict[str, Any]) -> bytes:
        headers = (
            {"x-api-key": token} if api == "messages" else {"Authorization": f"Bearer {token}"}
        )
        url = self.server.url + PATHS[api]
        async with self.session.post(url, json=body, headers=headers) as resp:
            data = await resp.read()
            assert resp.status == 200, data[:500]
            return data


@pytest.fixture(scope="module")
def served():
    s = Served()
    s.run(s.start())
    yield s
    s.run(s.stop())
    s.loop.close()


# ---------------------------------------------------------------------------------------------
# what the model says, turn by turn
# ---------------------------------------------------------------------------------------------

_words = st.sampled_from(["ls", "the", "file", "a.py", "is", "done", "OK", "42", "x", "fix"])
texts = st.lists(_words, min_size=1, max_size=6).map(" ".join)


@st.composite
def turns(draw, tools: bool) -> dict[str, Any]:
    n_calls = draw(st.integers(0, 2)) if tools else 0
    return {
        "reasoning": draw(st.none() | texts),
        "content": draw(st.sampled_from(["", "Checking."]) | texts) if n_calls else draw(texts),
        "commands": [draw(texts) for _ in range(n_calls)],
        "end": draw(st.sampled_from(["im_end", "endoftext", "length"])),
        "cut": draw(st.integers(0, 3)),
        "results": [draw(texts) for _ in range(n_calls)],
        "user": draw(st.none() | texts) if n_calls else draw(texts),
    }


@st.composite
def conversations(draw) -> tuple[str, bool, bool, list[dict[str, Any]]]:
    api = draw(st.sampled_from(["chat", "messages", "responses"]))
    tools = draw(st.booleans())
    n = draw(st.integers(1, 40))
    return api, draw(st.booleans()), tools, [draw(turns(tools)) for _ in range(n)]


def output_ids(turn: dict[str, Any]) -> list[int]:
    """The sampled ids of one turn in the format the template writes, ending on <|im_end|>, on
    <|endoftext|> (another stop id), or cut off by max_new_tokens (some trailing ids gone)."""
    text = ""
    if turn["reasoning"] is not None:
        text += f"<think>\n{turn['reasoning']}\n</think>\n\n"
    text += turn["content"]
    for cmd in turn["commands"]:
        call = json.dumps({"name": "bash", "arguments": {"command": cmd}})
        text += f"\n<tool_call>\n{call}\n</tool_call>"
    ids = R.encode(text)
    if turn["end"] == "length":
        return ids[: max(1, len(ids) - turn["cut"])]
    return ids + [IM_END if turn["end"] == "im_end" else EOT]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(conversations())
def test_linear_conversation_is_one_branch(served: Served, conv) -> None:
    """1-40 turns through one API (streamed or not, with or without tool calls), each turn
    ending on <|im_end|>, on <|endoftext|> or cut off: the records assemble into exactly one
    leaf, every call after the first is a TITO hit, and no sampled id is lost."""
    api, stream, tools, steps = conv
    rid = f"lin{uuid.uuid4().hex[:10]}-0-1"
    token = f"sk-{rid}"
    served.server.tokens[token] = rid
    c = Conversation(api, tools)
    c.user("Fix the bug.")
    sent: list[list[int]] = []
    for turn in steps:
        out = output_ids(turn)
        sent.append(out)
        served.engine.push(Reply(ids=out))
        body = served.run(served.post(api, token, c.body(stream)))
        ids = c.reply(body, stream)
        c.results(ids, turn["results"][: len(ids)], turn["user"] if ids else turn["user"] or "go")
    served.run(served.recorder.flush(rid, timeout=10))
    records = served.run(served.bus.read_subject(served.bus.subjects.calls(rid), CallRecord))
    assert [r.status for r in records] == ["ok"] * len(steps)
    done = assemble_detailed(records, rollout_result(rid, len(steps)))
    sample = done.sample
    assert not sample.is_tombstone, sample.dropped_reason
    assert sample.counters.n_leaves == 1 and sample.counters.tito_misses == 0
    (branch,) = expand(sample)
    model = branch.token_ids[branch.loss_mask == 1].tolist()
    assert model == [t for out in sent for t in out]  # every sampled id, in order, trained once
    served.server.tokens.pop(token)


# ---------------------------------------------------------------------------------------------
# the learner recomputes the engine's log-probs over the assembled tree
# ---------------------------------------------------------------------------------------------


def stop_prone_model(folder: Path) -> Path:
    """A copy of tiny-1m that often stops: ids 0 (<|endoftext|>) and 2 (<|im_end|>) get a
    logit of about 4.7 where the near-uniform others have about 0 (~9% each per token at
    temperature 0.7), so a short conversation ends turns on both stop ids and by length."""
    import torch
    from safetensors.torch import load_file, save_file

    from harnessrl.common.models import load_model, resolve_model

    src = resolve_model("tiny-1m")
    shutil.copytree(src, folder)
    lm = load_model(src)
    start = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    with torch.no_grad():
        h = lm.model(input_ids=torch.tensor([R.encode(R.render(start, None, True))]))
    mean = h.last_hidden_state[0].mean(0)
    (weights,) = folder.glob("*.safetensors")
    state = load_file(str(weights))
    emb = state["model.embed_tokens.weight"].clone()
    emb[[EOT, IM_END]] = mean / mean.norm() ** 2 * 4.7  # tied: the LM head's rows too
    state["model.embed_tokens.weight"] = emb
    state.pop("lm_head.weight", None)
    weights.unlink()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


async def test_learner_logprobs_match_the_engine_over_the_tree(run_name: str, tmp_path) -> None:
    """A multi-turn conversation through the proxy's HTTP server against the real embedded
    engine (fp32, temperature 0.7), whose turns end on <|im_end|>, on <|endoftext|> and by
    length: the records assemble into one branch, and the learner's packed forward over the
    TreeSample gives every trained token the log-prob the engine recorded (within 1e-4)."""
    import aiohttp
    import torch

    from harnessrl.learner.packing import PackConfig, collate, pack
    from harnessrl.learner.policy import load_policy
    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import EngineServer

    temperature = 0.7
    model = stop_prone_model(tmp_path / "model")
    rid = "lp-0-1"
    bus = await connect(f"memory://{run_name}", run_name)
    cfg = EngineConfig(model=str(model), port=0, threads=1, dtype="float32")
    sampling = SamplingParams(temperature=temperature, max_new_tokens=8)
    endings: list[int | str] = []
    async with (
        EngineServer(cfg) as eng,
        EngineClient(eng.url) as client,
        Recorder(bus) as rec,
    ):
        caller = ModelCaller(client, R, HermesParser(), rec, sampling=sampling, max_context=4096)
        async with (
            ProxyServer(caller, {"sk": rid}) as srv,
            aiohttp.ClientSession() as http,
        ):
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "List files."},
            ]
            while len(endings) < 24 and not {EOT, IM_END, "length"} <= set(endings):
                body = {"model": "m", "messages": messages, "tools": TOOLS}
                headers = {"Authorization": "Bearer sk"}
                async with http.post(srv.url + PATHS["chat"], json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    reply = (await r.json())["choices"][0]["message"]
                last = int(rec.rollouts[rid].seqs[len(endings)][-1])  # input+output's last id
                endings.append(last if last in (EOT, IM_END) else "length")
                messages = messages + [reply, {"role": "user", "content": f"go on {len(endings)}"}]
            await rec.flush(rid)
    records = await bus.read_subject(bus.subjects.calls(rid), CallRecord)
    await bus.close()
    assert {EOT, IM_END, "length"} <= set(endings), endings
    sample = assemble_detailed(records, rollout_result(rid, len(endings))).sample
    assert not sample.is_tombstone, sample.dropped_reason
    assert sample.counters.n_leaves == 1 and sample.counters.tito_misses == 0

    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = load_policy(str(model), temperature=temperature, dtype="float32").eval()
        batch = collate(pack([sample], PackConfig(max_tokens=4096)).rows)
        with torch.no_grad():
            out = policy(**batch.model_inputs())
    finally:
        torch.set_num_threads(n_threads)
    mask = batch.loss_mask.numpy() > 0
    n_sampled = sum(len(r.output_ids) // 4 for r in records)
    assert mask.sum() == sample.counters.model_tokens == n_sampled  # every sampled id trained
    recorded = batch.rollout_logp.numpy()[mask]
    assert np.all(recorded < 0)
    diff = np.abs(out.logprobs.numpy()[mask] - recorded)
    assert diff.max() <= 1e-4, (diff.max(), int(diff.argmax()))
