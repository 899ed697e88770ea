r"""``claude-code``: Anthropic's Claude Code CLI, headless (``-p``), against the proxy.

Install: ``npm install @anthropic-ai/claude-code`` into ``<cache>/claude-code`` (the native
binary comes in the ``@anthropic-ai/claude-code-linux-<arch>`` dependency; we run it directly,
so no Node is needed at run time).

Launch (inside the sandbox; the task goes on stdin, so a task starting with ``-`` is safe)::

    <mount>/node_modules/@anthropic-ai/claude-code-linux-x64/claude -p \
        --dangerously-skip-permissions --model <model> --output-format json --bare \
        [--max-turns N]  < instruction
    env: HOME=<home> ANTHROPIC_BASE_URL=<proxy> ANTHROPIC_API_KEY=<token> IS_SANDBOX=1
         CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1
         DISABLE_ERROR_REPORTING=1 CLAUDE_CODE_ATTRIBUTION_HEADER=0
         [CLAUDE_CODE_MAX_CONTEXT_TOKENS=W CLAUDE_CODE_AUTO_COMPACT_WINDOW=W]
         [CLAUDE_CODE_MAX_OUTPUT_TOKENS=O]

``IS_SANDBOX=1`` lets it skip permissions as root; ``--bare`` shrinks the first request from
~12k to ~1.2k tokens; ``CLAUDE_CODE_ATTRIBUTION_HEADER=0`` keeps a version-stamped billing line
out of the system prompt (it would break prefix sharing across versions).

Context window and output limit (measured with 2.1.332 and read from its code):

* ``CLAUDE_CODE_MAX_CONTEXT_TOKENS=W`` (``ctx.context_window``) is the model window it believes
  in; for a model it does not know it otherwise assumes 200,000 (measured: no compaction up to
  30k tokens). ``CLAUDE_CODE_AUTO_COMPACT_WINDOW=W`` is set too, but alone it changed nothing
  (the same run with it set to 32,768 alone).
* ``CLAUDE_CODE_MAX_OUTPUT_TOKENS=O`` (``ctx.output_limit()``, the run's ``max_new_tokens``) is
  the ``max_tokens`` of every request, compaction requests included. Unset, it asks for 32,000
  (up to 128,000) and reserves ``min(O, 20000)`` of the window for it.
* It compacts once its count (the last reply's reported input + output tokens, plus an estimate
  of what came after) reaches ``W - min(O, 20000) - 13000`` (13,000: its fixed summary
  buffer): 15,672 (48%) for W=32,768 and O=4,096; measured, its first compaction request then
  carried 17.7k–18.1k tokens (54–55%). With O unset that is below zero: against a 32,768 window
  it compacted after its second call (2.1k–4.2k tokens of history) and then stopped with
  "Autocompact is thrashing".

Options: ``bare`` (default True), ``output_format`` (``json``/``stream-json``/``text``),
``max_retries`` (CLAUDE_CODE_MAX_RETRIES), ``disable_betas`` (bool), ``max_output_tokens``
(overrides ``ctx.max_output_tokens``), ``extra_args`` (list).

API: Anthropic ``POST /v1/messages?beta=true``, always streaming. Call labels (proxy/labels.py):
``x-claude-code-agent-id`` marks sub-agents; compaction requests end with an instruction asking
for ``<analysis>``/``<summary>`` blocks.
"""

from __future__ import annotations

from pathlib import Path

from harnessrl.actors.harnesses._platform import npm_arch
from harnessrl.actors.harnesses.base import HarnessContext, LaunchSpec
from harnessrl.actors.harnesses.install import NpmAdapter


class ClaudeCodeAdapter(NpmAdapter):
    name = "claude-code"
    api = "messages"
    first_request_tokens = 1346
    measured_version = "2.1.332"
    summary = "Anthropic Claude Code CLI (npm @anthropic-ai/claude-code)"
    packages = ("@anthropic-ai/claude-code",)

    def binary(self, cache_dir: Path) -> str:
        a = npm_arch()
        return self.locate(
            cache_dir,
            f"node_modules/@anthropic-ai/claude-code-linux-{a}/claude",
            f"node_modules/@anthropic-ai/claude-code-linux-{a}-musl/claude",
            "node_modules/@anthropic-ai/claude-code/bin/claude.exe",
        )

    def check_paths(self) -> tuple[str, ...]:
        # Not bin/claude.exe: without the platform package it is only a stub printing advice.
        a = npm_arch()
        return (
            f"node_modules/@anthropic-ai/claude-code-linux-{a}/claude",
            f"node_modules/@anthropic-ai/claude-code-linux-{a}-musl/claude",
        )

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        opts = ctx.options
        argv = [self.binary(ctx.cache_dir), "-p", "--dangerously-skip-permissions"]
        argv += ["--model", ctx.model, "--output-format", opts.get("output_format", "json")]
        if opts.get("output_format") == "stream-json":
            argv.append("--verbose")  # stream-json requires it with -p
        if opts.get("bare", True):
            argv.append("--bare")
        if ctx.max_turns is not None:
            argv += ["--max-turns", str(ctx.max_turns)]
        argv += list(opts.get("extra_args", []))
        env = self.base_env(ctx) | {
            "ANTHROPIC_BASE_URL": ctx.proxy_url,
            "ANTHROPIC_API_KEY": ctx.token,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "IS_SANDBOX": "1",
            "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        }
        if ctx.context_window:
            env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(ctx.context_window)
            env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(ctx.context_window)
        if (out := ctx.output_limit()) is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(out)
        if opts.get("max_retries") is not None:
            env["CLAUDE_CODE_MAX_RETRIES"] = str(opts["max_retries"])
        if opts.get("disable_betas"):
            env["CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS"] = "1"
        spec = LaunchSpec(
            argv=argv,
            env=env,
            api=self.api,
            ro_binds=self.binds(ctx.cache_dir),
            stdin=ctx.instruction.encode(),
        )
        return self.finish(ctx, spec)
