"""The reference agent CLI, for real, against a scripted OpenAI-compatible aiohttp server.

The agent runs as a subprocess with the host's plain ``/usr/bin/python3`` (no venv, no
harnessrl on the path), exactly as it runs inside a sandbox. The server records every request
(headers and body) and answers from a per-test script of replies and HTTP errors.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from harnessrl.actors.harnesses import HarnessContext, get_adapter, launch
from harnessrl.actors.harnesses.base import host_python
from harnessrl.actors.harnesses.reference import SCRIPT
from harnessrl.actors.harnesses.reference_agent import COMPACTION_PROMPT, LABEL_HEADER

TOKEN = "tok-rollout-123"


def call(name: str, args: dict | str, call_id: str) -> dict:
    """One tool call as the server sends it (``args`` as a string is sent verbatim)."""
    arguments = args if isinstance(args, str) else json.dumps(args)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def reply(*calls: dict, content: str | None = None, prompt_tokens: int = 100) -> dict:
    return {"content": content, "tool_calls": list(calls), "prompt_tokens": prompt_tokens}


@dataclass
class FakeChat:
    """A scripted ``/v1/chat/completions``: each step is a reply dict or an HTTP status."""

    script: list = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if not self.script:
            return web.json_response({"error": {"message": "script exhausted"}}, status=400)
        step = self.script.pop(0)
        if isinstance(step, int):
            return web.json_response({"error": {"message": f"scripted {step}"}}, status=step)
        message = {"role": "assistant", "content": step["content"]}
        if step["tool_calls"]:
            message["tool_calls"] = step["tool_calls"]
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if step["tool_calls"] else "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": step["prompt_tokens"],
                    "completion_tokens": 10,
                    "total_tokens": step["prompt_tokens"] + 10,
                },
            }
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        return app


@pytest.fixture
async def fake():
    """A FakeChat on a free loopback port; yields (fake, base_url with /v1)."""
    chat = FakeChat()
    runner = web.AppRunner(chat.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield chat, f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


@dataclass
class Run:
    code: int
    result: dict
    stderr: str


async def run_agent(base_url: str, workspace: Path, task: str, *flags: str) -> Run:
    """The agent as the sandbox runs it: host python3, a clean env, the script by path."""
    env = {
        "PATH": "/usr/bin:/bin",
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": TOKEN,
        "HRL_MODEL": "policy-test",
    }
    proc = await asyncio.create_subprocess_exec(
        host_python(),
        "-I",  # isolated: no user site, no PYTHON* env, script dir not special
        str(SCRIPT),
        "--workspace",
        str(workspace),
        "--retry-base",
        "0.01",
        *flags,
        task,
        env=env,
        cwd="/",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    last = out.decode().strip().splitlines()[-1]
    return Run(proc.returncode, json.loads(last), err.decode())


def is_prefix(shorter: list, longer: list) -> bool:
    return longer[: len(shorter)] == shorter


@pytest.mark.integration
async def test_writes_file_then_finishes(fake, tmp_path: Path):
    """A write_file call lands in the workspace; finish ends the run with exit 0."""
    chat, url = fake
    chat.script = [
        reply(call("write_file", {"path": "out/hello.txt", "content": "hi there\n"}, "call_1")),
        reply(call("finish", {"summary": "wrote it"}, "call_2")),
    ]
    run = await run_agent(url, tmp_path, "Write hi there to out/hello.txt")
    assert run.code == 0, run.stderr
    assert (tmp_path / "out/hello.txt").read_text() == "hi there\n"
    assert run.result["status"] == "finished"
    assert run.result["summary"] == "wrote it"
    assert run.result["turns"] == 2 and run.result["calls"] == 2
    first, second = chat.requests
    assert chat.headers[0]["authorization"] == f"Bearer {TOKEN}"
    assert first["model"] == "policy-test"
    assert {t["function"]["name"] for t in first["tools"]} == {
        "read_file",
        "write_file",
        "list_dir",
        "run",
        "finish",
    }
    assert LABEL_HEADER not in chat.headers[0]


@pytest.mark.integration
async def test_history_is_prefix_extending_and_echoes_tool_calls(fake, tmp_path: Path):
    """Every request extends the previous one; assistant tool calls come back unchanged."""
    chat, url = fake
    (tmp_path / "a.txt").write_text("alpha")
    sent = [
        reply(call("list_dir", {"path": "."}, "call_ls"), content="Looking."),
        reply(call("read_file", {"path": "a.txt"}, "call_rd")),
        reply(call("run", {"cmd": "echo hi; exit 3"}, "call_run")),
        reply(call("finish", {"summary": "ok"}, "call_fin")),
    ]
    chat.script = [dict(s) for s in sent]
    run = await run_agent(url, tmp_path, "Look around")
    assert run.code == 0, run.stderr
    reqs = [r["messages"] for r in chat.requests]
    for a, b in zip(reqs, reqs[1:], strict=False):
        assert is_prefix(a, b)
    for i, msgs in enumerate(reqs[1:]):
        echoed = msgs[len(reqs[i])]
        assert echoed["role"] == "assistant"
        assert echoed["tool_calls"] == sent[i]["tool_calls"]
        assert echoed["content"] == sent[i]["content"]
    tools = [m for m in reqs[-1] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["call_ls", "call_rd", "call_run"]
    assert tools[0]["content"] == "a.txt"
    assert tools[1]["content"] == "alpha"
    assert tools[2]["content"].startswith("exit code: 3\nhi")


@pytest.mark.integration
async def test_retries_5xx_then_succeeds(fake, tmp_path: Path):
    """500 and 503 are retried with the same body; the run then finishes normally."""
    chat, url = fake
    chat.script = [500, 503, reply(call("finish", {"summary": "done"}, "c1"))]
    run = await run_agent(url, tmp_path, "Finish")
    assert run.code == 0, run.stderr
    assert len(chat.requests) == 3
    assert chat.requests[0] == chat.requests[1] == chat.requests[2]
    assert run.result["calls"] == 3 and run.result["turns"] == 1
    assert "HTTP 500" in run.stderr and "HTTP 503" in run.stderr


@pytest.mark.integration
async def test_4xx_is_fatal(fake, tmp_path: Path):
    """A 400 is not retried: exit status 1 with the error in the JSON summary."""
    chat, url = fake
    chat.script = [400]
    run = await run_agent(url, tmp_path, "Anything")
    assert run.code == 1
    assert len(chat.requests) == 1
    assert run.result["status"] == "error"
    assert "HTTP 400" in run.result["error"]


@pytest.mark.integration
async def test_connection_refused_exhausts_retries(tmp_path: Path):
    """No server at all: retried, then exit status 1 (not a traceback)."""
    run = await run_agent("http://127.0.0.1:9/v1", tmp_path, "Anything", "--retries", "2")
    assert run.code == 1
    assert run.result["calls"] == 3
    assert "giving up after 3 attempts" in run.result["error"]


@pytest.mark.integration
async def test_malformed_tool_calls_get_error_messages(fake, tmp_path: Path):
    """Bad JSON, an unknown tool and missing arguments are answered, never a crash."""
    chat, url = fake
    chat.script = [
        reply(
            call("write_file", '{"path": "x.txt", "content": ', "bad_json"),
            call("frobnicate", {}, "unknown"),
            call("write_file", {"path": "x.txt"}, "missing_arg"),
            call("read_file", '["not", "an", "object"]', "not_object"),
            call("read_file", {"path": "nope.txt"}, "no_file"),
        ),
        reply(call("finish", {"summary": "recovered"}, "fin")),
    ]
    run = await run_agent(url, tmp_path, "Break things")
    assert run.code == 0, run.stderr
    tools = {
        m["tool_call_id"]: m["content"] for m in chat.requests[1]["messages"] if m["role"] == "tool"
    }
    assert tools["bad_json"].startswith("error: malformed tool call")
    assert tools["unknown"].startswith("error: unknown tool 'frobnicate'")
    assert tools["missing_arg"].startswith("error: bad arguments for write_file")
    assert tools["not_object"].startswith("error: malformed tool call")
    assert tools["no_file"].startswith("error: FileNotFoundError")
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.integration
async def test_compacts_through_the_model_when_over_budget(fake, tmp_path: Path):
    """Over budget: a labelled no-tools compaction call, then the history restarts from it."""
    chat, url = fake
    chat.script = [
        reply(call("list_dir", {"path": "."}, "c1"), prompt_tokens=5000),
        reply(content="SUMMARY: listed the dir, it was empty."),
        reply(call("finish", {"summary": "done"}, "c2")),
    ]
    run = await run_agent(url, tmp_path, "Compact me", "--compact-tokens", "1000")
    assert run.code == 0, run.stderr
    assert run.result["compactions"] == 1
    first, compaction, after = chat.requests
    assert chat.headers[1][LABEL_HEADER] == "compaction"
    assert "tools" not in compaction
    assert compaction["messages"][-1] == {"role": "user", "content": COMPACTION_PROMPT}
    assert is_prefix(first["messages"], compaction["messages"])
    assert LABEL_HEADER not in chat.headers[2]
    system, user = after["messages"]
    assert system == first["messages"][0]
    assert user["content"].startswith("Compact me")
    assert "SUMMARY: listed the dir, it was empty." in user["content"]


@pytest.mark.integration
async def test_subagent_runs_a_labelled_nested_loop(fake, tmp_path: Path):
    """delegate() starts a fresh history labelled subagent; its summary returns to the parent."""
    chat, url = fake
    chat.script = [
        reply(call("delegate", {"task": "count the files"}, "d1")),
        reply(call("list_dir", {"path": "."}, "s1")),
        reply(call("finish", {"summary": "there are 0 files"}, "s2")),
        reply(call("finish", {"summary": "main done"}, "m2")),
    ]
    run = await run_agent(url, tmp_path, "Delegate it", "--subagent")
    assert run.code == 0, run.stderr
    assert run.result["subagents"] == 1
    labels = [h.get(LABEL_HEADER) for h in chat.headers]
    assert labels == [None, "subagent", "subagent", None]
    assert "delegate" in {t["function"]["name"] for t in chat.requests[0]["tools"]}
    assert "delegate" not in {t["function"]["name"] for t in chat.requests[1]["tools"]}
    sub_msgs = chat.requests[1]["messages"]
    assert [m["role"] for m in sub_msgs] == ["system", "user"]
    assert sub_msgs[1]["content"] == "count the files"
    assert is_prefix(chat.requests[0]["messages"], chat.requests[3]["messages"])
    tool = chat.requests[3]["messages"][-1]
    assert tool == {
        "role": "tool",
        "tool_call_id": "d1",
        "content": "sub-agent finished: there are 0 files",
    }


@pytest.mark.integration
async def test_max_turns_exit_code_and_nudge(fake, tmp_path: Path):
    """Replies without tool calls get a nudge; running out of turns exits 2."""
    chat, url = fake
    chat.script = [reply(content="thinking..."), reply(content="still thinking")]
    run = await run_agent(url, tmp_path, "Never finish", "--max-turns", "2")
    assert run.code == 2
    assert run.result["status"] == "max_turns"
    last = chat.requests[1]["messages"]
    assert last[-1]["role"] == "user" and "finish" in last[-1]["content"]


@pytest.mark.integration
async def test_run_tool_timeout_kills_the_command(fake, tmp_path: Path):
    """A command past --cmd-timeout is killed (with its children) and reported."""
    chat, url = fake
    chat.script = [
        reply(call("run", {"cmd": "sleep 30 & sleep 30; echo never"}, "r1")),
        reply(call("finish", {"summary": "ok"}, "f")),
    ]
    run = await run_agent(url, tmp_path, "Sleep", "--cmd-timeout", "0.5")
    assert run.code == 0, run.stderr
    out = chat.requests[1]["messages"][-1]["content"]
    assert out.startswith("timed out after 0.5s")
    assert "never" not in out


@pytest.mark.integration
def test_runs_as_module_help():
    """``python -m harnessrl.actors.harnesses.reference_agent --help`` works (the package entry)."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "harnessrl.actors.harnesses.reference_agent", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0
    assert "--compact-tokens" in res.stdout


@pytest.mark.unit
def test_is_stdlib_only():
    """The script imports nothing outside the standard library (it runs without a venv)."""
    import ast
    import sys

    tree = ast.parse(SCRIPT.read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


# ---------------------------------------------------------------------------------------------
# The adapter end to end: LaunchSpec → real bubblewrap sandbox → forwarder → unix-socket server


@pytest.fixture
async def fake_unix(tmp_path: Path):
    chat = FakeChat()
    sock = tmp_path / "proxy.sock"
    runner = web.AppRunner(chat.app())
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    os.chmod(sock, 0o777)  # the sandbox runs as its own uid
    yield chat, sock
    await runner.cleanup()


@pytest.mark.integration
async def test_reference_adapter_in_bwrap_sandbox(fake_unix, tmp_path: Path):
    """The reference LaunchSpec runs in a real sandbox and talks to the proxy's socket."""
    from harnessrl.actors.sandbox.base import SandboxSpec
    from tests.helpers.sandboxes import bwrap_or_skip

    chat, sock = fake_unix
    backend = await bwrap_or_skip(tmp_path / "sandboxes")
    chat.script = [
        reply(call("write_file", {"path": "answer.txt", "content": "42\n"}, "w")),
        reply(call("finish", {"summary": "answered"}, "f")),
    ]
    ctx = HarnessContext(
        instruction="Write 42 to answer.txt",
        token=TOKEN,
        model="policy-test",
        proxy_url="http://127.0.0.1:18080",
        max_turns=5,
        timeout_s=60,
    )
    spec = get_adapter("reference").prepare(ctx)
    async with backend:
        sandbox = await backend.create(
            SandboxSpec(proxy_socket=sock, proxy_port=18080, ro_binds=spec.ro_binds, owner="test")
        )
        async with sandbox:
            res = await launch(sandbox, spec)
            assert res.returncode == 0, res.stderr.decode()
            assert await sandbox.read_file("answer.txt") == b"42\n"
    assert json.loads(res.stdout.decode().splitlines()[-1])["status"] == "finished"
    assert chat.headers[0]["authorization"] == f"Bearer {TOKEN}"
    assert chat.requests[0]["messages"][1]["content"] == "Write 42 to answer.txt"
