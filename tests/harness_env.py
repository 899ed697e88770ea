"""Running a real harness through the real proxy, with a scripted model behind it.

The stack is the one an actor builds for a rollout, faking only the model:

    harness (bwrap sandbox) -> 127.0.0.1:18080 forwarder -> unix socket -> ProxyServer
        -> ModelCaller (TITO, parser, labels) -> EngineClient -> ScriptedEngine (a ``Brain``)
        -> Recorder -> real nats-server (CallRecords on ``hrl.<run>.calls.<rollout_id>``)

A ``Brain`` is the scripted engine's callable: it sees exactly what a model would see (the
prompt ids, decoded with the stack's tokenizer: tiny-1m unless a test passes another) and answers text in the template's tool-call
format. It reads the tools the harness offered from the rendered ``<tools>`` block, so a test
uses each harness's own tool names and schemas.

``HRL_SAVE_CALL_FIXTURES=1`` lets the fixture tests rewrite ``tests/fixtures/calls/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from aiohttp import web

from harnessrl.actors.harnesses import (
    HarnessContext,
    HarnessInstallError,
    default_cache_dir,
    get_adapter,
    launch,
)
from harnessrl.common.bus import Bus, connect
from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import (
    CallRecord,
    RolloutResult,
    SamplingParams,
    decode,
    encode,
    ids_hash,
    unpack_ids,
)
from harnessrl.common.tree import leaves
from harnessrl.proxy.calls import ModelCaller
from harnessrl.proxy.parsers import HermesParser
from harnessrl.proxy.recorder import Recorder
from harnessrl.proxy.scripted import Reply, ScriptedEngine
from harnessrl.proxy.server import ProxyServer
from harnessrl.proxy.sglang import EngineClient
from harnessrl.proxy.tito import ChatRenderer

TOKEN = "tok-proxy-harness"
ROLLOUT = "g-0-1"
MODEL = "policy-test"
TOKENIZER = load_tokenizer("tiny-1m")
RENDERER = ChatRenderer(TOKENIZER)
FIXTURES = Path(__file__).parent / "fixtures" / "calls"


# ---------------------------------------------------------------------------------------------
# what the scripted model sees


@dataclass
class Prompt:
    """One engine request, decoded: the rendered chat as the model would read it."""

    ids: list[int]
    text: str
    tools: dict[str, dict[str, Any]]
    """Tool name -> its JSON schema (``parameters``), from the template's ``<tools>`` block."""
    turns: list[tuple[str, str]]
    """``(role, text)`` of every ``<|im_start|>`` turn, the open generation turn excluded."""

    @property
    def system(self) -> str:
        return self.turns[0][1] if self.turns and self.turns[0][0] == "system" else ""

    @property
    def n_tool_results(self) -> int:
        return self.text.count("<tool_response>")

    @property
    def last_user(self) -> str:
        return next((t for r, t in reversed(self.turns) if r == "user"), "")

    def first_user(self) -> str:
        return next((t for r, t in self.turns if r == "user"), "")


_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?=<\|im_start\|>|\Z)", re.DOTALL)


def decode_prompt(ids: list[int], tokenizer: Any = None) -> Prompt:
    text = (tokenizer or TOKENIZER).decode(ids, skip_special_tokens=False)
    tools: dict[str, dict[str, Any]] = {}
    block = re.search(r"<tools>\n(.*?)\n</tools>", text, re.DOTALL)
    if block:
        for line in block.group(1).splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                fn = json.loads(line)["function"]
                tools[fn["name"]] = fn.get("parameters") or {}
    turns = [
        (m.group(1), m.group(2).removesuffix("\n").removesuffix("<|im_end|>"))
        for m in _TURN.finditer(text)
    ]
    if turns and turns[-1][0] == "assistant" and not turns[-1][1].strip():
        turns.pop()  # the generation prompt
    return Prompt(ids, text, tools, turns)


def tool_call(name: str, arguments: dict[str, Any], text: str = "") -> str:
    """Model text calling one tool, exactly as the template renders it."""
    call = f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    return f"{text}\n{call}" if text else call


class Brain:
    """The scripted engine's callable: ``decide(prompt)`` returns a reply (text or ``Reply``).

    Every prompt and reply is kept in ``log`` (for assertions and for debugging a harness).
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.log: list[tuple[Prompt, Any]] = []
        self.tokenizer = tokenizer
        """The tokenizer prompts are decoded with (None: tiny-1m's)."""

    def __call__(self, ids: list[int], body: dict[str, Any]) -> Any:
        prompt = decode_prompt(ids, self.tokenizer)
        reply = self.decide(prompt)
        self.log.append((prompt, reply))
        return reply

    def decide(self, p: Prompt) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError


WRITE_TEXT = "hi from the harness\n"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SHELL_TOOLS = ("Bash", "bash", "exec_command", "shell", "exec", "run")


def shell_call(p: Prompt, command: str, description: str = "") -> str | None:
    """A call of the harness's own shell tool running ``command`` (its argument name taken
    from the offered schema), or None when it offers none."""
    name = next((n for n in SHELL_TOOLS if n in p.tools), None)
    if name is None:
        return None
    props = p.tools[name].get("properties") or {}
    key = next((k for k in ("command", "cmd") if k in props), None)
    key = key or next(iter(p.tools[name].get("required") or props or ["command"]))
    args: dict[str, Any] = {key: command}
    if "description" in props:
        args["description"] = description or "run a command"
    return tool_call(name, args)


def write_call(p: Prompt, path: str = "hello.txt", text: str = WRITE_TEXT) -> str | None:
    """A call that writes ``path``: the harness's file-writing tool when it offers one
    (Claude Code's ``Write``, OpenClaw's ``write``), else its shell tool."""
    for name in ("Write", "write"):
        props = (p.tools.get(name) or {}).get("properties") or {}
        key = next((k for k in ("file_path", "filePath", "path") if k in props), None)
        if key and "content" in props:
            where = path if key == "path" else f"/workspace/{path}"
            return tool_call(name, {key: where, "content": text})
    quoted = text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "")
    return shell_call(p, f"printf '{quoted}' > {path}", f"write {path}")


class WriteThenAnswer(Brain):
    """Two steps: a tool call that writes hello.txt, then a final answer (mini-swe-agent, whose
    run ends on a command, gets its submit command instead). Tool-less calls (titles) get a
    short text."""

    def decide(self, p: Prompt) -> Any:
        if not p.tools:
            return "Greeting file"
        if p.n_tool_results == 0:
            return write_call(p)
        if SUBMIT.split()[1] in p.system + p.first_user():
            return shell_call(p, SUBMIT)
        return "Done."


CLAUDE_SUMMARY = (
    "<analysis>\nThe user asked for numbered step files; I write them one by one.\n</analysis>\n\n"
    "<summary>\n1. Primary Request and Intent: write numbered step files.\n"
    "2. Current Work: {done} of {total} steps done.\n</summary>"
)
CODEX_SUMMARY = "Progress: {done} of {total} steps done, one file per step. Next: write the rest."
SUBTASK = "SUBTASK: create sub.txt containing the word sub."


def is_compaction(p: Prompt) -> bool:
    """Claude Code's or Codex's compaction instruction in the last user turn."""
    last = p.last_user
    return ("<analysis>" in last and "<summary>" in last) or "CONTEXT CHECKPOINT COMPACTION" in last


class ScenarioBrain(Brain):
    """A multi-step agent run with optional events, for the assembler's fixtures.

    Main calls: (``subagent``) one call of Claude Code's ``Agent`` tool handing ``SUBTASK`` to a
    foreground sub-agent; then ``steps`` shell steps (the first writes hello.txt, later ones
    print 200 lines into ``stepK.txt`` so the context grows towards compaction); then a final
    answer. The ``fail_at``-th main call (1-based) is answered with HTTP 500 once, so the
    harness retries it. Compaction requests get a summary in the harness's expected form;
    the sub-agent writes sub.txt with its shell tool and reports back; tool-less calls (titles)
    get a short text.
    """

    def __init__(self, steps: int = 1, *, fail_at: int = 0, subagent: bool = False) -> None:
        super().__init__()
        self.steps, self.fail_at, self.subagent = steps, fail_at, subagent
        self.main_calls = self.steps_done = 0
        self.failed = self.spawned = False
        self.events: list[str] = []

    def decide(self, p: Prompt) -> Any:
        if is_compaction(p):
            self.events.append("compaction")
            summary = CLAUDE_SUMMARY if "<analysis>" in p.last_user else CODEX_SUMMARY
            # a summary says how far the work got (a constant one would make every restart
            # the very same prompt, which is a retry to the assembler)
            return summary.format(done=self.steps_done, total=self.steps)
        if not p.tools:
            self.events.append("aux")
            return "Step files"
        if SUBTASK in p.first_user():
            self.events.append("subagent")
            if p.n_tool_results == 0:
                return shell_call(p, "echo sub > sub.txt", "write sub.txt")
            return "Sub-agent finished: sub.txt written."
        self.main_calls += 1
        self.events.append("main")
        if self.main_calls == self.fail_at and not self.failed:
            self.failed = True
            self.events[-1] = "main-500"
            return Reply(status=500, error="scripted engine failure")
        if self.subagent and not self.spawned and "Agent" in p.tools:
            self.spawned = True
            args = {"description": "Write sub file", "prompt": SUBTASK}
            args |= {"subagent_type": "general-purpose", "run_in_background": False}
            return tool_call("Agent", args)
        if self.steps_done < self.steps:
            k, self.steps_done = self.steps_done, self.steps_done + 1
            if k == 0:
                return write_call(p)
            return shell_call(p, f"seq 1 200 | tee step{k}.txt", f"step {k}")
        return "Done."


# ---------------------------------------------------------------------------------------------
# the proxy stack


class RecordingProxy(ProxyServer):
    """The real ProxyServer, also keeping every HTTP request it received (path, headers, body)
    and every response status, for assertions and for debugging harness behaviour."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.requests: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def keep(request: web.Request, handler: Any) -> web.StreamResponse:
            entry: dict[str, Any] = {
                "method": request.method,
                "path": request.path_qs,
                "headers": dict(request.headers),
            }
            if request.can_read_body:
                raw = await request.read()  # cached: the handler reads it again
                with contextlib.suppress(ValueError):
                    entry["body"] = json.loads(raw)
            self.requests.append(entry)
            resp = await handler(request)
            entry["status"] = resp.status
            return resp

        app.middlewares.append(keep)
        return app

    def posts(self, path: str = "") -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == "POST" and r["path"].startswith(path)]


@dataclass
class Stack:
    engine: ScriptedEngine
    brain: Brain
    caller: ModelCaller
    server: RecordingProxy
    recorder: Recorder
    bus: Bus
    socket: Path
    rollout: str = ROLLOUT

    async def records(self, timeout: float = 30.0) -> list[CallRecord]:
        """Every CallRecord of the rollout, once the bus acknowledged them, in seq order."""
        await self.recorder.flush(self.rollout, timeout=timeout)
        recs = await self.bus.read_subject(self.bus.subjects.calls(self.rollout), CallRecord)
        return sorted(recs, key=lambda r: r.seq)


@contextlib.asynccontextmanager
async def proxy_stack(
    nats_url: str,
    run: str,
    brain: Brain,
    tmp_path: Path,
    *,
    max_context: int = 0,
    max_new_tokens: int | None = None,
    tokenizer: Any = None,
    port: int | None = None,
) -> AsyncIterator[Stack]:
    """ScriptedEngine(brain) + EngineClient + Recorder on NATS + ProxyServer on a unix socket.

    ``max_context`` is the window the proxy enforces (0: none); ``max_new_tokens`` the run's
    output limit (``None``: ``SamplingParams``' default); ``tokenizer`` the model's (None:
    tiny-1m's; the brain decodes with the same one); ``port``: also listen on loopback TCP
    (0: a free port; ``Stack.server.url``)."""
    tok = tokenizer or TOKENIZER
    renderer = RENDERER if tok is TOKENIZER else ChatRenderer(tok)
    if brain.tokenizer is None:
        brain.tokenizer = tok
    sock = tmp_path / "proxy.sock"
    bus = await connect(nats_url, run)
    try:
        async with (
            ScriptedEngine(tok, brain) as engine,
            EngineClient(engine.url) as client,
            Recorder(bus) as recorder,
        ):
            sampling = (
                None if max_new_tokens is None else SamplingParams(max_new_tokens=max_new_tokens)
            )
            caller = ModelCaller(
                client,
                renderer,
                HermesParser(),
                recorder,
                sampling=sampling,
                max_context=max_context,
            )
            where = {"unix_path": str(sock)} if port is None else {"port": port}
            server = RecordingProxy(caller, {TOKEN: ROLLOUT}, model_name=MODEL, ping_s=1.0, **where)
            async with server:
                if port is None:
                    os.chmod(sock, 0o777)  # the sandbox runs as its own uid
                yield Stack(engine, brain, caller, server, recorder, bus, sock)
    finally:
        await bus.close()


# ---------------------------------------------------------------------------------------------
# harnesses


async def ensure_installed(name: str) -> Path:
    """The harness cache holding ``name``, installing it there if needed; skips (saying why)
    only when it is missing and cannot be installed."""
    cache = default_cache_dir()
    adapter = get_adapter(name)
    if adapter.is_installed(cache):
        return cache
    if shutil.which("npm") is None and name != "mini-swe-agent":
        pytest.skip(f"{name} is not installed in {cache} and npm is missing")
    try:
        await adapter.install(cache)
    except HarnessInstallError as e:
        pytest.skip(f"{name} is not installed in {cache} and could not be installed: {e!s:.300}")
    return cache


@dataclass
class HarnessRun:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    files: dict[str, bytes | None]

    def tail(self, n: int = 3000) -> str:
        return f"rc={self.returncode} timed_out={self.timed_out}\n--- stdout\n{self.stdout[-n:]}\n--- stderr\n{self.stderr[-n:]}"


async def run_harness(
    name: str,
    stack: Stack,
    tmp_path: Path,
    instruction: str,
    *,
    read: tuple[str, ...] = (),
    timeout_s: float = 180.0,
    context_window: int | None = None,
    max_output_tokens: int | None = None,
    max_turns: int | None = 8,
    options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    workspace: Path | None = None,
) -> HarnessRun:
    """Launch ``name`` in a bwrap sandbox whose forwarder reaches ``stack``'s proxy socket;
    return its exit and the workspace files named in ``read`` (None when missing).
    ``workspace``: a folder whose files are copied into the workspace first (a task's)."""
    from harnessrl.actors.sandbox.base import SandboxSpec
    from tests.helpers.sandboxes import bwrap_or_skip

    cache = await ensure_installed(name)
    backend = await bwrap_or_skip(tmp_path / "sandboxes")
    ctx = HarnessContext(
        instruction=instruction,
        token=TOKEN,
        model=MODEL,
        max_turns=max_turns,
        timeout_s=timeout_s,
        context_window=context_window,
        max_output_tokens=max_output_tokens,
        cache_dir=cache,
        options=dict(options or {}),
        env=dict(env or {}),
    )
    spec = get_adapter(name).prepare(ctx)
    async with backend:
        sb = await backend.create(
            SandboxSpec(
                proxy_socket=stack.socket, proxy_port=18080, ro_binds=spec.ro_binds, owner="t"
            )
        )
        async with sb:
            if workspace is not None:
                for f in sorted(workspace.rglob("*")):
                    if f.is_file():
                        await sb.write_file(str(f.relative_to(workspace)), f.read_bytes())
            res = await launch(sb, spec)
            files: dict[str, bytes | None] = {}
            for path in read:
                try:
                    files[path] = await sb.read_file(path)
                except FileNotFoundError:
                    files[path] = None
    return HarnessRun(
        res.returncode,
        res.stdout.decode(errors="replace"),
        res.stderr.decode(errors="replace"),
        res.timed_out,
        files,
    )


# ---------------------------------------------------------------------------------------------
# records


def full_inputs(records: list[CallRecord]) -> dict[int, np.ndarray]:
    """Every call's full input rebuilt from its delta (and checked against its hash)."""
    full: dict[int, np.ndarray] = {}
    by_seq = {r.seq: r for r in records}
    for r in sorted(records, key=lambda r: r.seq):
        base = np.zeros(0, dtype="<i4")
        if r.parent_seq >= 0:
            p = by_seq[r.parent_seq]
            base = np.concatenate([full[p.seq], unpack_ids(p.output_ids)])[: r.prefix_len]
        ids = np.concatenate([base, unpack_ids(r.suffix_ids)]).astype("<i4")
        assert len(ids) == r.input_len and ids_hash(ids) == r.input_hash, f"bad delta {r.seq}"
        full[r.seq] = ids
    return full


def extends(records: list[CallRecord], a: int, b: int) -> bool:
    """Whether call ``b``'s input starts with call ``a``'s input + output exactly."""
    full = full_inputs(records)
    by_seq = {r.seq: r for r in records}
    path = np.concatenate([full[a], unpack_ids(by_seq[a].output_ids)])
    return len(full[b]) >= len(path) and bool(np.array_equal(full[b][: len(path)], path))


def save_calls(name: str, records: list[CallRecord], expected: dict[str, Any]) -> Path:
    """Write ``<name>.msgpack`` (a msgpack array of encoded CallRecords) and ``<name>.json``."""
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / f"{name}.msgpack"
    path.write_bytes(msgpack.packb([encode(r) for r in records], use_bin_type=True))
    (FIXTURES / f"{name}.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return path


def load_calls(name: str) -> tuple[list[CallRecord], dict[str, Any]]:
    """A fixture's records and its description (see ``save_calls``)."""
    raw = msgpack.unpackb((FIXTURES / f"{name}.msgpack").read_bytes(), raw=False)
    expected = json.loads((FIXTURES / f"{name}.json").read_text())
    return [decode(b, CallRecord) for b in raw], expected


def saving_fixtures() -> bool:
    return os.environ.get("HRL_SAVE_CALL_FIXTURES") == "1"


def result_for(records: list[CallRecord]) -> RolloutResult:
    """The RolloutResult a fixture's records belong to (status ok, every seq accounted)."""
    n = 1 + max((r.seq for r in records), default=-1)
    return RolloutResult(rollout_id=ROLLOUT, task_id="fixture", group_id="g", k=0, n_calls=n)


def leaves_per_root(sample) -> list[int]:
    """Leaves under each root (in root order)."""
    root_of: list[int] = []
    for n in sample.nodes:
        root_of.append(len(root_of) if n.parent < 0 else root_of[n.parent])
    roots = [i for i, n in enumerate(sample.nodes) if n.parent < 0]
    per = Counter(root_of[i] for i in leaves(sample))
    return [per[r] for r in roots]
