"""``opencode``: the opencode CLI (``opencode run``), via an OpenAI-compatible provider.

Install: ``npm install opencode-ai`` into ``<cache>/opencode``; we run the native binary from
``opencode-linux-<arch>`` (or the ``-baseline`` build for CPUs without AVX2) directly.

Files: ``<home>/.config/opencode/opencode.json`` (also named by ``OPENCODE_CONFIG``)::

    {"$schema": "https://opencode.ai/config.json",
     "provider": {"hrl": {"npm": "@ai-sdk/openai-compatible", "name": "harnessrl",
                          "options": {"baseURL": "<proxy>/v1", "apiKey": "<token>"},
                          "models": {"<model>": {"name": "<model>",
                                                 "limit": {"context": C, "output": O}}}}},
     "model": "hrl/<model>", "small_model": "hrl/<model>",
     "autoupdate": false, "share": "disabled",
     "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"}}

Launch::

    opencode run -m hrl/<model> [--format json] -- <instruction>
    env: HOME=<home> OPENCODE_CONFIG=<file> OPENCODE_DISABLE_MODELS_FETCH=1
         OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1

Context window and output limit: ``limit.context`` is ``ctx.context_window`` (32768 when
unknown) and ``limit.output`` is ``ctx.output_limit()`` (8192 when unknown), sent as
``max_tokens`` (capped at 32,000 by opencode). opencode compacts once the last reply's reported
input + output reaches ``context - output``: 28,672 for 32,768 and 4,096. It checks after a
reply, so the call before its compaction may pass that (measured with 1.18.33: 29,475 tokens,
leaving 3.3k of the window for the reply). Its compaction request is tool-less, with a system
prompt beginning "You are a context summarization agent" (the proxy labels it ``main`` today).

Options: ``format`` (``json`` default, or ``default``), ``max_output_tokens`` (overrides
``ctx.max_output_tokens``), ``extra_args`` (list), ``config`` (dict merged into the top level).

API: OpenAI chat completions, streaming with ``include_usage``. Call labels: a concurrent
title-generation request is an ``aux`` call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harnessrl.actors.harnesses._platform import npm_arch
from harnessrl.actors.harnesses.base import HarnessContext, LaunchSpec
from harnessrl.actors.harnesses.install import NpmAdapter


class OpencodeAdapter(NpmAdapter):
    name = "opencode"
    api = "chat"
    first_request_tokens = 9482
    measured_version = "1.18.33"
    summary = "opencode CLI (npm opencode-ai), chat completions"
    packages = ("opencode-ai",)

    def check_paths(self) -> tuple[str, ...]:
        a = npm_arch()
        return (
            f"node_modules/opencode-linux-{a}/bin/opencode",
            f"node_modules/opencode-linux-{a}-baseline/bin/opencode",
            "node_modules/opencode-ai/bin/opencode.exe",
        )

    def binary(self, cache_dir: Path) -> str:
        return self.locate(cache_dir, *self.check_paths())

    def config(self, ctx: HarnessContext) -> dict[str, Any]:
        limit = {
            "context": ctx.context_window or 32768,
            "output": ctx.output_limit(8192),
        }
        cfg: dict[str, Any] = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                "hrl": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "harnessrl",
                    "options": {"baseURL": ctx.openai_base_url, "apiKey": ctx.token},
                    "models": {ctx.model: {"name": ctx.model, "limit": limit}},
                }
            },
            "model": f"hrl/{ctx.model}",
            "small_model": f"hrl/{ctx.model}",
            "autoupdate": False,
            "share": "disabled",
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        }
        return cfg | ctx.options.get("config", {})

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        cfg_file = ctx.in_home(".config/opencode/opencode.json")
        argv = [self.binary(ctx.cache_dir), "run", "-m", f"hrl/{ctx.model}"]
        fmt = ctx.options.get("format", "json")
        if fmt:
            argv += ["--format", fmt]
        argv += [*ctx.options.get("extra_args", []), "--", ctx.instruction]
        env = self.base_env(ctx) | {
            "OPENCODE_CONFIG": cfg_file,
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        }
        spec = LaunchSpec(
            argv=argv,
            env=env,
            api=self.api,
            files={cfg_file: json.dumps(self.config(ctx), indent=2) + "\n"},
            ro_binds=self.binds(ctx.cache_dir),
        )
        return self.finish(ctx, spec)
