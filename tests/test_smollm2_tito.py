"""Token-in-token-out with a real tokenizer and chat template: SmolLM2's (49k byte-level BPE,
ChatML, no tool section: the proxy's Hermes-style tool fallback writes the tools).

Through the real proxy (HTTP, ``ModelCaller``, TITO, parser, records on a real nats-server),
a scripted engine answering with SmolLM2's tokenizer, and real clients: a 50-call scripted
``command`` client in a bubblewrap sandbox (short replies; tool results with unicode, code,
trailing spaces and newlines), a 10-call mini-swe-agent (unmodified) on a ``workspace`` task,
and the official Anthropic and OpenAI (Responses) SDKs. Each asserts 0 TITO misses, 0 false
forks, one leaf, and that every call's input ids equal a fresh render + encode of the messages
that call sent (converted by the API layer, rendered by the template, encoded whole): the byte-
level BPE never merges across a turn boundary, ``<|im_end|>`` and the whitespace after special
tokens are written exactly as a full render writes them.

A reply whose first characters would merge with the generation prompt in a full render
(``"\\n\\n..."`` after ``assistant\\n``) is the one documented exception: TITO keeps the sampled
ids (tested below), so only such replies are left out of the equality checks.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from harnessrl.common.models import CHAT_TEMPLATE, load_tokenizer, render_chat
from harnessrl.common.records import CallRecord, unpack_ids
from harnessrl.common.tasks import load_task
from harnessrl.common.tree import assemble, leaves
from harnessrl.proxy.messages_api import messages_request
from harnessrl.proxy.parsers import HermesParser
from harnessrl.proxy.responses_api import responses_request
from harnessrl.proxy.server import chat_request
from harnessrl.proxy.tito import ChatRenderer, TitoSession, normalize_messages
from harnessrl.proxy.tool_fallback import TOOLS_HEADER, hermes_messages, template_renders_tools
from tests.harness_env import (
    MODEL,
    ROLLOUT,
    SUBMIT,
    TOKEN,
    Brain,
    Prompt,
    full_inputs,
    proxy_stack,
    result_for,
    run_harness,
    shell_call,
    tool_call,
)
from tests.test_proxy_tito import conversations

P = HermesParser()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
RESULTS = [
    "héllo wörld — 日本語テキスト 🙂🚀 Ελληνικά\n",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "trailing spaces   \n   \n",
    "  leading\tand\ttabs\r\nwindows line\r\n",
    "",
    '{"a": [1, 2.5e-3, null], "b": "x\\ny"}',
    "\n\n\nnewlines first",
    "    2024-01-01  12:30   x  1\n" * 3,
    "<|im_start|> is text here, and so is </tool_response>",
    "x" * 300,
]
USER_FOLLOWUPS = ["go on  ", "next\n", "  continue\n\n", "ok 🙂"]


@pytest.fixture(scope="module")
def tok(smollm2: Path):
    return load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def renderer(tok) -> ChatRenderer:
    return ChatRenderer(tok)


# ------------------------------------------------------------------------------------------
# the Hermes-style tool fallback
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_fallback_only_for_templates_without_tools(renderer: ChatRenderer, tok) -> None:
    """SmolLM2's template ignores tools, so the fallback is on; the project's template (Qwen
    style) renders them itself, so it is off and renders exactly as before."""
    assert renderer.tool_fallback
    tiny = ChatRenderer(load_tokenizer("tiny-1m"))
    assert not tiny.tool_fallback
    msgs = [{"role": "user", "content": "hi"}]
    assert tiny.render(msgs, TOOLS, gen=True) == render_chat(
        msgs, tools=TOOLS, add_generation_prompt=True, template=CHAT_TEMPLATE
    )
    bare = render_chat(msgs, tools=TOOLS, template=tok.chat_template)
    assert "bash" not in bare  # what SmolLM2's template alone would show the model

    def refuses(m: Any, t: Any) -> str:
        if t:
            raise ValueError("no tools here")
        return "x"

    assert not template_renders_tools(refuses)


@pytest.mark.unit
def test_fallback_render_exact(renderer: ChatRenderer) -> None:
    """Tools in the system turn, tool calls as ``<tool_call>`` text, each tool result its own
    ``tool`` turn wrapped in ``<tool_response>``; without a system message the tools block is
    the system turn (instead of the template's default prompt)."""
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}  # fmt: skip
    msgs = [
        {"role": "user", "content": "List."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py\n"},
        {"role": "assistant", "content": "Two.", "tool_calls": [call, call]},
    ]
    block = TOOLS_HEADER + json.dumps(TOOLS[0], ensure_ascii=False)
    tc = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    want = (
        f"<|im_start|>system\n{block}\n</tools>\n\nFor each function call, return a json object "
        "with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nList.<|im_end|>\n"
        f"<|im_start|>assistant\n{tc}<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\na.py\n\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nTwo.\n{tc}\n{tc}<|im_end|>\n"
    )
    assert renderer.render(msgs, TOOLS, gen=False) == want
    with_system = [{"role": "system", "content": "Be brief."}, *msgs[:1]]
    text = renderer.render(with_system, TOOLS, gen=True)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{block}\n</tools>")
    assert "SmolLM" not in text and text.endswith("<|im_start|>assistant\n")
    # the input messages are left as they were
    assert msgs[1]["content"] == "" and "tool_calls" in msgs[1]
    assert hermes_messages(msgs, None)[0] == msgs[0]


@pytest.mark.unit
def test_fallback_parse_and_render_are_inverse(renderer: ChatRenderer, tok) -> None:
    """For canonical output, render(msgs, gen) + output + turn end == render(msgs + [parsed]):
    what TITO and the parser rely on, with the fallback as with a tool template."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Go."}]
    for text in (
        tool_call("bash", {"command": "printf 'héllo\\n'"}),
        tool_call("bash", {"command": "ls"}, text="Listing  the files."),
        tool_call("bash", {"command": "ls"}) + "\n" + tool_call("bash", {"command": "pwd"}),
        "Just text, with trailing spaces   ",
    ):
        parsed = P.parse(text + "<|im_end|>")
        assert (bool(parsed.tool_calls), parsed.stopped) == ("<tool_call>" in text, True)
        whole = renderer.render(msgs + [parsed.message()], TOOLS, gen=False)
        assert renderer.render(msgs, TOOLS, gen=True) + text + "<|im_end|>\n" == whole, text


@pytest.mark.unit
def test_window_rendering_stays_exact(renderer: ChatRenderer) -> None:
    """The fallback is a function of the messages: the window probe passes, so TITO renders
    new parts from a window of the conversation with this template too."""
    assert renderer.window_exact()


# ------------------------------------------------------------------------------------------
# TITO invariants over random conversations, with the real tokenizer
# ------------------------------------------------------------------------------------------

_chars = st.sampled_from(
    list("abcxyz ABC.,:;!?-_/()[]'\"{}<>|\n\t\r0123456789éß中日本🙂—") + ["  ", "\n\n", "   "]
)
texts = st.lists(_chars, max_size=20).map("".join)


@pytest.mark.unit
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(conv=conversations(texts))
def test_invariant_echo_equals_full_render(renderer: ChatRenderer, conv) -> None:
    """Echoed unchanged, every call is a hit (after the first) whose ids equal a full render,
    for every conversation whose replies do not merge with the generation prompt (reasoning
    included: SmolLM2's template drops it, the sampled ids keep it)."""
    start, tools, steps = conv
    s = TitoSession(renderer)
    msgs = normalize_messages(start)
    for seq, (intended, new) in enumerate(steps):
        p = s.prepare(msgs, tools)
        assert p.input_ids == renderer.encode(renderer.render(msgs, tools, True))
        assert p.kind == ("first" if seq == 0 else "hit") and not p.false_fork
        whole = renderer.encode(renderer.render(msgs + [intended], tools, False))
        assume(whole[: len(p.input_ids)] == p.input_ids)  # no merge with the prompt's end
        out = whole[len(p.input_ids) : -1]  # ... up to <|im_end|>, without the newline after
        reply = P.parse(renderer.decode(out)).message()
        s.commit(seq, p, out, reply)
        msgs = normalize_messages([*msgs, reply, *new])
    assert s.prepare(msgs, tools).input_ids == renderer.encode(renderer.render(msgs, tools, True))


@pytest.mark.unit
def test_reply_merging_with_the_prompt_keeps_sampled_ids(renderer: ChatRenderer) -> None:
    """A reply starting with blank lines: a full render merges the prompt's last ``\\n`` with
    them (``ĊĊ``), the sampled ids do not; TITO keeps the sampled ids (a hit that extends them)
    and the exact full render of the new part after them."""
    msgs = normalize_messages([{"role": "user", "content": "hi"}])
    s = TitoSession(renderer)
    p = s.prepare(msgs, TOOLS)
    out = renderer.encode("\n\nHello.") + [2]
    s.commit(0, p, out, P.parse(renderer.decode(out)).message())
    nxt = normalize_messages([*msgs, {"role": "assistant", "content": "\n\nHello."}])
    nxt.append({"role": "user", "content": "more"})
    q = s.prepare(nxt, TOOLS)
    assert q.kind == "hit" and q.input_ids[: len(p.input_ids) + len(out)] == p.input_ids + out
    full = renderer.encode(renderer.render(nxt, TOOLS, True))
    assert full != q.input_ids  # the documented exception: a full render re-merges
    assert renderer.decode(full) == renderer.decode(q.input_ids)  # same text either way


# ------------------------------------------------------------------------------------------
# through the proxy: real clients
# ------------------------------------------------------------------------------------------

CONVERT = {"chat": chat_request, "messages": messages_request, "responses": responses_request}


def check_exact(
    records: list[CallRecord], requests: list[dict], renderer: ChatRenderer, api: str, n: int
) -> None:
    """n calls, every call's input == render + encode of what it sent, 0 misses, 0 false
    forks, one leaf holding every sampled token."""
    posts = [r for r in requests if r["method"] == "POST"]
    assert [r["status"] for r in posts] == [200] * n and len(records) == n
    assert [r.seq for r in records] == list(range(n)) and {r.api for r in records} == {api}
    full = full_inputs(records)
    for rec, post in zip(records, posts, strict=True):
        req = CONVERT[api](post["body"], ROLLOUT, post["headers"])
        want = renderer.encode(renderer.render(req.messages, req.tools, gen=True))
        got = full[rec.seq].tolist()
        assert got == want, (rec.seq, renderer.decode(got[-80:]), renderer.decode(want[-80:]))
        assert rec.status == "ok" and (rec.seq == 0 or rec.tito_hit), rec.seq
    sample = assemble(records, result_for(records))
    assert not sample.is_tombstone, sample.dropped_reason
    c = sample.counters
    assert (c.tito_misses, c.false_forks, c.n_leaves, len(leaves(sample))) == (0, 0, 1, 1)
    n_out = sum(len(unpack_ids(r.output_ids)) for r in records)
    assert c.model_tokens == n_out


class Scripted(Brain):
    """Answers from a list of replies (callables of the prompt or text), cycling."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__()
        self.script = script

    def decide(self, p: Prompt) -> Any:
        item = self.script[len(self.log) % len(self.script)]
        return item(p) if callable(item) else item


CLIENT = r"""
import json, os, sys, urllib.request
RESULTS = json.loads(sys.argv[2])
FOLLOWUPS = json.loads(sys.argv[3])
TOOLS = json.loads(sys.argv[4])
base = os.environ["OPENAI_BASE_URL"].rstrip("/")
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
           "Content-Type": "application/json"}
msgs = [{"role": "system", "content": "You run shell commands. Be brief.  "},
        {"role": "user", "content": os.environ["HRL_INSTRUCTION"]}]
for i in range(int(sys.argv[1])):
    body = {"model": os.environ["OPENAI_MODEL"], "messages": msgs, "tools": TOOLS}
    req = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(), headers)
    reply = json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]["message"]
    msgs.append({k: reply[k] for k in ("role", "content", "tool_calls") if reply.get(k) is not None})
    calls = reply.get("tool_calls") or []
    for j, tc in enumerate(calls):
        out = RESULTS[(i + j) % len(RESULTS)]
        msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": out})
    if not calls:
        msgs.append({"role": "user", "content": FOLLOWUPS[i % len(FOLLOWUPS)]})
print("calls made:", i + 1)
"""


@pytest.mark.integration
async def test_fifty_calls_of_a_scripted_command_client(
    nats_url: str, run_name: str, tmp_path: Path, tok, renderer: ChatRenderer
) -> None:
    """50 calls of a stdlib client run by the ``command`` harness in a sandbox: short replies,
    tool calls (one or two), tool results with unicode, code, trailing spaces and newlines."""
    script = [
        lambda p: shell_call(p, "ls -la"),
        "ok",
        tool_call("bash", {"command": "printf 'héllo — 日本語 🙂\\n'"}),
        "Fine, continuing.",
        tool_call("bash", {"command": "python3 -c 'print(1+1)'"}, text="Running it."),
        tool_call("bash", {"command": "ls"}) + "\n" + tool_call("bash", {"command": "pwd  "}),
        "Done.  ",
    ]
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    argv = ["/usr/bin/python3", "/opt/hrl/client.py", "50"]
    argv += [json.dumps(RESULTS), json.dumps(USER_FOLLOWUPS), json.dumps(TOOLS)]
    brain = Scripted(script)
    async with proxy_stack(nats_url, run_name, brain, tmp_path, tokenizer=tok) as st:
        run = await asyncio.wait_for(
            run_harness(
                "command",
                st,
                tmp_path,
                "Explore the workspace.",
                timeout_s=600,
                options={"command": argv, "ro_binds": [[str(client), "/opt/hrl/client.py"]]},
            ),
            620,
        )
        assert run.returncode == 0 and "calls made: 50" in run.stdout, run.tail()
        records = await st.records()
        requests = st.server.requests
    check_exact(records, requests, renderer, "chat", 50)
    assert '"arguments": {"command": "pwd  "}' in renderer.decode(full_inputs(records)[49])


class TenSteps(Brain):
    """Nine shell commands on the config task's workspace (unicode, code, trailing spaces in
    their output), then mini-swe-agent's submit command."""

    COMMANDS = (
        "ls -la config",
        "cat config/app.json",
        "python3 -c \"import json; print(sorted(json.load(open('config/app.json'))))\"",
        "printf 'héllo wörld — 日本語 🙂  \\n\\n'",
        "sed -n '1,4p' config/app.json | cat -A",
        "python3 - <<'EOF'\nimport json\nfrom pathlib import Path\np = Path('config/app.json')\n"
        "cfg = json.loads(p.read_text())\ncfg['server']['port'] = 9090\ncfg['debug'] = False\n"
        "cfg['features'].append('metrics')\np.write_text(json.dumps(cfg, indent=2) + '\\n')\nEOF",
        "grep -n 'port\\|debug' config/app.json",
        "python3 -m json.tool config/app.json > /dev/null && echo valid   ",
        "echo '   spaces   '; echo",
    )

    def decide(self, p: Prompt) -> Any:
        k = len(self.log)
        return shell_call(p, self.COMMANDS[k] if k < len(self.COMMANDS) else SUBMIT)


@pytest.mark.slow
@pytest.mark.harness
async def test_ten_calls_of_mini_swe_agent_on_a_workspace_task(
    nats_url: str, run_name: str, tmp_path: Path, tok, renderer: ChatRenderer
) -> None:
    """mini-swe-agent, unmodified, in a sandbox on ``workspace/config_port_update``: its
    ``bash`` tool reaches the model through the fallback, and all 10 calls are exact."""
    task = load_task("workspace", "config_port_update")
    brain = TenSteps()
    async with proxy_stack(nats_url, run_name, brain, tmp_path, tokenizer=tok) as st:
        run = await asyncio.wait_for(
            run_harness(
                "mini-swe-agent",
                st,
                tmp_path,
                task.instruction,
                read=("config/app.json",),
                max_turns=12,
                timeout_s=600,
                workspace=task.workspace_dir,
            ),
            620,
        )
        assert run.returncode == 0, run.tail()
        records = await st.records()
        requests = st.server.requests
    assert "bash" in brain.log[0][0].tools  # its tool, as the fallback wrote it
    check_exact(records, requests, renderer, "chat", 10)
    cfg = json.loads(run.files["config/app.json"])
    assert cfg["server"]["port"] == 9090 and cfg["debug"] is False


SDK_SCRIPT = [
    tool_call("bash", {"command": "ls -la"}),
    "Two files, héllo.txt and a.py.  ",
    tool_call("bash", {"command": "cat a.py"}, text="Reading it."),
    tool_call("bash", {"command": "wc -l a.py"}) + "\n" + tool_call("bash", {"command": "pwd"}),
    "Done: 🙂",
    tool_call("bash", {"command": "printf '%s\\n' 日本語"}),
]


@pytest.mark.integration
async def test_anthropic_sdk_conversation(
    nats_url: str, run_name: str, tmp_path: Path, tok, renderer: ChatRenderer
) -> None:
    """The official ``anthropic`` SDK, tool_use / tool_result turns, a streamed call too."""
    import anthropic

    tools = [
        {
            "name": "bash",
            "description": "Run a shell command.",
            "input_schema": TOOLS[0]["function"]["parameters"],
        }  # fmt: skip
    ]
    async with proxy_stack(
        nats_url, run_name, Scripted(SDK_SCRIPT), tmp_path, tokenizer=tok, port=0
    ) as st:
        client = anthropic.AsyncAnthropic(base_url=st.server.url, api_key=TOKEN, max_retries=0)
        messages: list[dict] = [{"role": "user", "content": "Look around.  "}]
        for i in range(len(SDK_SCRIPT)):
            kw = dict(model=MODEL, max_tokens=256, system="Be brief.", tools=tools)
            if i == 3:
                async with client.messages.stream(messages=messages, **kw) as s:
                    r = await s.get_final_message()
            else:
                r = await client.messages.create(messages=messages, **kw)
            blocks = [b.model_dump(exclude_none=True) for b in r.content]
            messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in r.content if b.type == "tool_use"]
            assert (r.stop_reason == "tool_use") == bool(uses)
            if uses:
                results = [
                    {"type": "tool_result", "tool_use_id": u.id, "content": RESULTS[i + j]}
                    for j, u in enumerate(uses)
                ]
                messages.append({"role": "user", "content": results})
            else:
                messages.append({"role": "user", "content": USER_FOLLOWUPS[i % 4]})
        await client.close()
        records = await st.records()
        requests = st.server.requests
    check_exact(records, requests, renderer, "messages", len(SDK_SCRIPT))


@pytest.mark.integration
async def test_responses_sdk_conversation(
    nats_url: str, run_name: str, tmp_path: Path, tok, renderer: ChatRenderer
) -> None:
    """The official ``openai`` SDK's Responses API: function_call / function_call_output
    items fed back as the SDK returned them."""
    import openai

    fn = TOOLS[0]["function"]
    tools = [{"type": "function", "name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]}]  # fmt: skip
    async with proxy_stack(
        nats_url, run_name, Scripted(SDK_SCRIPT), tmp_path, tokenizer=tok, port=0
    ) as st:
        client = openai.AsyncOpenAI(base_url=st.server.url + "/v1", api_key=TOKEN, max_retries=0)
        items: list[dict] = [{"role": "user", "content": "Look around.  "}]
        for i in range(len(SDK_SCRIPT)):
            r = await client.responses.create(
                model=MODEL, input=items, tools=tools, instructions="Be brief."
            )
            items += [o.model_dump(exclude_none=True) for o in r.output]
            calls = [o for o in r.output if o.type == "function_call"]
            if calls:
                items += [
                    {"type": "function_call_output", "call_id": c.call_id, "output": RESULTS[i + j]}
                    for j, c in enumerate(calls)
                ]
            else:
                items.append({"role": "user", "content": USER_FOLLOWUPS[i % 4]})
        await client.close()
        records = await st.records()
        requests = st.server.requests
    check_exact(records, requests, renderer, "responses", len(SDK_SCRIPT))
