"""Real third-party harnesses: install from npm, run ``--version``, then drive them headless.

Claude Code runs against an in-test Anthropic messages server (SSE) and Codex against an
in-test OpenAI Responses server (SSE), each *inside a real bubblewrap sandbox* launched from the
adapter's `LaunchSpec` — the path an actor takes — with the fake listening on the unix socket
the sandbox's forwarder relays to. Each fake scripts one shell tool call that writes a file,
then a final text answer.

Installs go to the persistent harness cache (``$HRL_HARNESS_CACHE`` or
``~/.cache/harnessrl/harnesses``), reused across runs; ``HRL_TEST_FRESH_INSTALL=1`` installs
into a temporary dir instead. Tests skip (saying why) only when npm cannot install.

``HRL_SAVE_HARNESS_FIXTURES=1`` rewrites ``tests/fixtures/harness_requests/*.json`` (the first
and second request each harness sent) for the proxy's tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from harnessrl.actors.harnesses import (
    HarnessContext,
    HarnessInstallError,
    default_cache_dir,
    get_adapter,
    launch,
)

pytestmark = pytest.mark.harness

TOKEN = "tok-harness-test"
FIXTURES = Path(__file__).parent / "fixtures" / "harness_requests"
INSTALLED: dict[str, Path] = {}


@pytest.fixture(scope="session")
def harness_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("HRL_TEST_FRESH_INSTALL") == "1":
        return tmp_path_factory.mktemp("harness-cache")
    return default_cache_dir()


async def installed(name: str, cache: Path) -> Path:
    """Install (or reuse) a harness; skip the test when npm cannot install it."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed on this machine")
    adapter = get_adapter(name)
    try:
        await adapter.install(cache)
    except HarnessInstallError as e:
        pytest.skip(f"npm could not install {name}: {str(e)[-400:]}")
    assert adapter.is_installed(cache)
    return adapter.install_dir(cache)


def host_path(name: str, cache: Path, inside: str) -> str:
    """A path of the adapter's install as seen inside the sandbox → the host path."""
    adapter = get_adapter(name)
    return inside.replace(adapter.mount_dir(), str(adapter.install_dir(cache)), 1)


@pytest.mark.integration
async def test_claude_code_installs_and_reports_version(harness_cache: Path):
    """``npm i @anthropic-ai/claude-code`` into the cache; the native binary answers --version."""
    await installed("claude-code", harness_cache)
    spec = get_adapter("claude-code").prepare(HarnessContext("x", "t", cache_dir=harness_cache))
    binary = host_path("claude-code", harness_cache, spec.argv[0])
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Claude Code" in out.stdout, out


@pytest.mark.integration
async def test_codex_installs_and_reports_version(harness_cache: Path):
    """``npm i @openai/codex`` into the cache; the vendored binary answers --version."""
    await installed("codex", harness_cache)
    spec = get_adapter("codex").prepare(HarnessContext("x", "t", cache_dir=harness_cache))
    binary = host_path("codex", harness_cache, spec.argv[0])
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("codex-cli"), out


# ---------------------------------------------------------------------------------------------
# Fake model servers (SSE), recording every request


@dataclass
class Recorder:
    requests: list[dict] = field(default_factory=list)

    def record(self, request: web.Request, body: dict) -> int:
        self.requests.append(
            {
                "method": request.method,
                "path": request.path_qs,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        return len(self.requests)


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


WRITE_CMD = "printf 'hi from the harness\\n' > hello.txt"


class FakeAnthropic(Recorder):
    """``POST /v1/messages``: first a Bash tool_use writing hello.txt, then text, end_turn."""

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = self.record(request, body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"input_tokens": 100, "output_tokens": 1}
        message = {
            "id": f"msg_{n}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        await resp.write(sse("message_start", {"type": "message_start", "message": message}))
        tools = {t.get("name") for t in body.get("tools", [])}
        if n == 1 and "Bash" in tools:
            block = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps({"command": WRITE_CMD, "description": "write"}),
            }
            stop = "tool_use"
        else:
            block, delta, stop = (
                {"type": "text", "text": ""},
                {"type": "text_delta", "text": "Done."},
                "end_turn",
            )
        await resp.write(
            sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
        )
        await resp.write(sse("ping", {"type": "ping"}))
        await resp.write(
            sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        )
        await resp.write(sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
        await resp.write(
            sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": 20},
                },
            )
        )
        await resp.write(sse("message_stop", {"type": "message_stop"}))
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_route("*", "/{tail:.*}", self.other)
        return app

    async def other(self, request: web.Request) -> web.Response:
        self.record(request, {})
        return web.json_response(
            {"type": "error", "error": {"type": "not_found_error", "message": "no"}}, status=404
        )


class FakeResponses(Recorder):
    """``POST /v1/responses``: first an exec_command function call, then a message."""

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = self.record(request, body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = f"resp_{n}"
        await resp.write(
            sse(
                "response.created",
                {
                    "type": "response.created",
                    "response": {
                        "id": rid,
                        "object": "response",
                        "status": "in_progress",
                        "output": [],
                    },
                },
            )
        )
        tools = {t.get("name") for t in body.get("tools", [])}
        if n == 1 and "exec_command" in tools:
            item = {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": WRITE_CMD}),
                "status": "completed",
            }
        else:
            item = {
                "type": "message",
                "id": f"msg_{n}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
            }
        await resp.write(
            sse(
                "response.output_item.done",
                {"type": "response.output_item.done", "output_index": 0, "item": item},
            )
        )
        usage = {
            "input_tokens": 100,
            "output_tokens": 20,
            "total_tokens": 120,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        await resp.write(
            sse(
                "response.completed",
                {
                    "type": "response.completed",
                    "response": {
                        "id": rid,
                        "object": "response",
                        "status": "completed",
                        "output": [item],
                        "usage": usage,
                    },
                },
            )
        )
        await resp.write_eof()
        return resp

    async def other(self, request: web.Request) -> web.Response:
        self.record(request, {})
        return web.json_response({"error": {"message": "not found"}}, status=404)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_route("*", "/{tail:.*}", self.other)
        return app


async def serve_unix(app: web.Application, sock: Path) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    os.chmod(sock, 0o777)  # the sandbox runs as its own uid
    return runner


async def run_in_sandbox(name: str, cache: Path, fake: Recorder, tmp_path: Path):
    """prepare → bwrap sandbox bound to the fake's socket → launch; returns (ExecResult, ws)."""
    from harnessrl.actors.sandbox.base import SandboxSpec
    from tests.helpers.sandboxes import bwrap_or_skip

    backend = await bwrap_or_skip(tmp_path / "sandboxes")
    ctx = HarnessContext(
        instruction="Create hello.txt containing a greeting.",
        token=TOKEN,
        model="policy-test",
        max_turns=5,
        timeout_s=180,
        cache_dir=cache,
    )
    spec = get_adapter(name).prepare(ctx)
    sock = tmp_path / "proxy.sock"
    runner = await serve_unix(fake.app(), sock)
    try:
        async with backend:
            sb = await backend.create(
                SandboxSpec(
                    proxy_socket=sock, proxy_port=18080, ro_binds=spec.ro_binds, owner="test"
                )
            )
            async with sb:
                res = await launch(sb, spec)
                try:
                    hello = await sb.read_file("hello.txt")
                except FileNotFoundError:
                    hello = None
    finally:
        await runner.cleanup()
    return res, hello


def save_fixture(name: str, fake: Recorder) -> None:
    if os.environ.get("HRL_SAVE_HARNESS_FIXTURES") != "1":
        return
    FIXTURES.mkdir(parents=True, exist_ok=True)
    posts = [r for r in fake.requests if r["method"] == "POST"]
    for label, req in zip(("first", "second", "third"), posts, strict=False):
        (FIXTURES / f"{name}_{label}_request.json").write_text(json.dumps(req, indent=2) + "\n")


def canonical(obj):
    """Claude Code re-serialises history: it moves its ``cache_control`` marker to the newest
    block on every request, and sends a string ``content`` back as a list of text blocks."""
    if isinstance(obj, dict):
        out = {k: canonical(v) for k, v in obj.items() if k != "cache_control"}
        if isinstance(out.get("content"), str) and "role" in out:
            out["content"] = [{"type": "text", "text": out["content"]}]
        return out
    if isinstance(obj, list):
        return [canonical(v) for v in obj]
    return obj


@pytest.mark.integration
async def test_claude_code_headless_in_sandbox(harness_cache: Path, tmp_path: Path):
    """Claude Code -p in bwrap: streams from the fake, runs Bash, writes the file, exits 0."""
    await installed("claude-code", harness_cache)
    fake = FakeAnthropic()
    res, hello = await asyncio.wait_for(
        run_in_sandbox("claude-code", harness_cache, fake, tmp_path), 240
    )
    save_fixture("claude_code", fake)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert hello == b"hi from the harness\n"
    result = json.loads(res.stdout.decode().strip().splitlines()[-1])
    assert result["is_error"] is False and result["result"] == "Done."
    posts = [
        r for r in fake.requests if r["method"] == "POST" and r["path"].startswith("/v1/messages")
    ]
    assert len(posts) >= 2
    first, second = posts[0], posts[1]
    assert first["path"] == "/v1/messages?beta=true"
    assert first["headers"]["x-api-key"] == TOKEN
    assert first["body"]["stream"] is True and first["body"]["model"] == "policy-test"
    m1, m2 = (canonical(p["body"]["messages"]) for p in (first, second))
    assert m2[: len(m1)] == m1  # the history extends, by meaning
    assert m2[len(m1)]["content"][0]["type"] == "tool_use"
    assert m2[-1]["content"][0]["type"] == "tool_result"


@pytest.mark.integration
async def test_codex_exec_in_sandbox(harness_cache: Path, tmp_path: Path):
    """codex exec in bwrap: Responses stream from the fake, exec_command, writes the file."""
    await installed("codex", harness_cache)
    fake = FakeResponses()
    res, hello = await asyncio.wait_for(run_in_sandbox("codex", harness_cache, fake, tmp_path), 240)
    save_fixture("codex", fake)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert hello == b"hi from the harness\n"
    posts = [r for r in fake.requests if r["method"] == "POST" and r["path"] == "/v1/responses"]
    assert len(posts) >= 2
    first, second = posts[0]["body"], posts[1]["body"]
    assert posts[0]["headers"]["Authorization"] == f"Bearer {TOKEN}"
    assert first["stream"] is True and first["model"] == "policy-test"
    assert second["input"][: len(first["input"])] == first["input"]
    kinds = [i.get("type") for i in second["input"][len(first["input"]) :]]
    assert "function_call" in kinds and "function_call_output" in kinds
    events = [json.loads(line) for line in res.stdout.decode().splitlines() if line.startswith("{")]
    assert any(e.get("item", {}).get("text") == "Done." for e in events)


# ---------------------------------------------------------------------------------------------
# Chat-completions harnesses (opencode, mini-swe-agent, openclaw): only when already installed,
# since each is 350–850 MiB (`harnessrl harness install NAME` first).

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SHELL_TOOLS = ("bash", "exec", "shell", "Bash", "exec_command", "run")


class FakeChatCompletions(Recorder):
    """``POST /v1/chat/completions`` (streaming or not): the harness's shell tool writes
    hello.txt; then mini-swe-agent gets its submit command, the others a final text."""

    def plan(self, body: dict) -> tuple[str | None, dict | None]:
        tools = {t["function"]["name"]: t["function"] for t in body.get("tools", [])}
        shell = next((n for n in SHELL_TOOLS if n in tools), None)
        if shell is None:  # an aux call (e.g. title generation): plain text
            return "Greeting file", None
        params = tools[shell].get("parameters", {})
        key = next(iter(params.get("required") or params.get("properties") or ["command"]))
        wrote = any(m.get("role") == "tool" for m in body["messages"])
        is_mini = SUBMIT.split()[1] in json.dumps(body["messages"][:1])
        if not wrote:
            return None, {"name": shell, "arguments": json.dumps({key: WRITE_CMD})}
        if is_mini:
            return None, {"name": shell, "arguments": json.dumps({key: SUBMIT})}
        return "Done.", None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = self.record(request, body)
        text, call = self.plan(body)
        tool_calls = (
            [{"index": 0, "id": f"call_{n}", "type": "function", "function": call}]
            if call
            else None
        )
        finish = "tool_calls" if call else "stop"
        usage = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
        base = {"id": f"chatcmpl-{n}", "created": 0, "model": body["model"]}
        if not body.get("stream"):
            msg = {"role": "assistant", "content": text}
            if tool_calls:
                msg["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in tool_calls
                ]
            return web.json_response(
                base
                | {
                    "object": "chat.completion",
                    "usage": usage,
                    "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = base | {"object": "chat.completion.chunk"}

        async def send(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        delta = (
            {"role": "assistant", "content": text}
            if text
            else {"role": "assistant", "tool_calls": tool_calls}
        )
        await send(chunk | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        await send(chunk | {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send(chunk | {"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def other(self, request: web.Request) -> web.Response:
        self.record(request, {})
        return web.json_response({"error": {"message": "not found"}}, status=404)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_route("*", "/{tail:.*}", self.other)
        return app


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("opencode", marks=pytest.mark.slow),  # ~60 s on a loaded machine
        pytest.param("mini-swe-agent", marks=pytest.mark.integration),
        pytest.param("openclaw", marks=pytest.mark.slow),  # ~30 s start
    ],
)
async def test_chat_harness_in_sandbox(name: str, tmp_path: Path):
    """opencode / mini-swe-agent / openclaw in bwrap against a chat-completions fake."""
    cache = default_cache_dir()
    if not get_adapter(name).is_installed(cache):
        pytest.skip(f"{name} is not installed in {cache}: run `harnessrl harness install {name}`")
    fake = FakeChatCompletions()
    res, hello = await asyncio.wait_for(run_in_sandbox(name, cache, fake, tmp_path), 240)
    save_fixture(name.replace("-", "_"), fake)
    out = (res.stdout[-3000:], res.stderr[-3000:])
    assert res.returncode == 0, out
    assert hello == b"hi from the harness\n", out
    posts = [r for r in fake.requests if r["method"] == "POST"]
    assert all(r["path"] == "/v1/chat/completions" for r in posts), [
        r["path"] for r in fake.requests
    ]
    assert all(r["headers"]["Authorization"] == f"Bearer {TOKEN}" for r in posts)
