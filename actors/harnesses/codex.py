r"""``codex``: OpenAI's Codex CLI (``codex exec``), against the proxy's Responses API.

Install: ``npm install @openai/codex`` into ``<cache>/codex``; we run the vendored native binary
(``@openai/codex-linux-<arch>/vendor/<triple>/bin/codex``) directly, with its ``codex-path`` dir
(ripgrep) first on PATH, as the npm wrapper would.

Files: ``<home>/.codex/config.toml``::

    model = "<model>"
    model_provider = "hrl"
    approval_policy = "never"
    sandbox_mode = "danger-full-access"
    check_for_update_on_startup = false
    [analytics]
    enabled = false
    [model_providers.hrl]
    name = "harnessrl"
    base_url = "<proxy>/v1"
    env_key = "HRL_API_KEY"
    wire_api = "responses"          # "chat" is a hard error in current Codex

Launch (task on stdin via ``-``)::

    codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox \
        --color never [--json] -C <ws> -   < instruction
    env: HOME=<home> CODEX_HOME=<home>/.codex HRL_API_KEY=<token>

Context window and output limit (measured with codex-cli 0.171.0):

* ``model_context_window = W`` (``ctx.context_window``);
* ``model_auto_compact_token_limit = W - max(O, W // 4)`` (``ctx.compaction_limit()``; O is
  ``ctx.output_limit()``): 24,576 (3/4) for W=32,768 and O=4,096. Codex compacts once the last
  reply's reported input + output, plus an estimate of the items since, reaches the limit, but
  it checks only after a reply: the next request goes out with the new tool output unchecked
  (measured: a limit of W - O = 28,672 let a 30,021-token request through, leaving 2.7k for
  the reply). The quarter of the window kept free covers a reply and a turn's tool output.
* Output: Codex sends no ``max_output_tokens`` and has no setting for it; its replies are cut
  by the run's ``max_new_tokens`` alone, and a cut reply (``status: incomplete``) fails the
  turn ("Incomplete response returned, reason: max_output_tokens": ``codex exec`` exits 1).
* Its own prompt is ~12.5k tokens, so against a 32k window about 12k of work fits between
  compactions.

Codex has no turn limit: only the sandbox's wall clock bounds it (and it has no guard against
compaction loops, so the proxy must never report inflated usage).

Options: ``json`` (bool, default True: JSONL events on stdout), ``request_max_retries``,
``stream_max_retries``, ``max_output_tokens`` (overrides ``ctx.max_output_tokens`` in the
compaction limit), ``extra_args`` (list), ``config`` (dict of extra top-level keys, applied
last: ``model_auto_compact_token_limit`` there wins).

API: OpenAI Responses ``POST /v1/responses``, always streaming. Call labels: sub-agents carry
``x-openai-subagent`` (and ``x-codex-parent-thread-id``); compaction is a request without tools
whose last input starts "You are performing a CONTEXT CHECKPOINT COMPACTION".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harnessrl.actors.harnesses._platform import npm_arch, rust_triple
from harnessrl.actors.harnesses.base import HarnessContext, LaunchSpec
from harnessrl.actors.harnesses.install import NpmAdapter

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def toml_value(v: Any) -> str:
    """A TOML literal for a str/bool/int/float (JSON string escapes are valid TOML)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))


def toml_table(name: str | None, values: dict[str, Any]) -> str:
    head = [f"[{name}]"] if name else []
    return "\n".join(head + [f"{k} = {toml_value(v)}" for k, v in values.items()]) + "\n"


class CodexAdapter(NpmAdapter):
    name = "codex"
    api = "responses"
    first_request_tokens = 12543
    measured_version = "0.171.0"
    summary = "OpenAI Codex CLI (npm @openai/codex), Responses API"
    packages = ("@openai/codex",)

    def _vendor(self) -> str:
        return f"node_modules/@openai/codex-linux-{npm_arch()}/vendor/{rust_triple()}"

    def check_paths(self) -> tuple[str, ...]:
        return (f"{self._vendor()}/bin/codex", f"{self._vendor()}/codex/codex")

    def binary(self, cache_dir: Path) -> str:
        return self.locate(cache_dir, *self.check_paths(), "node_modules/.bin/codex")

    def config_toml(self, ctx: HarnessContext) -> str:
        top: dict[str, Any] = {
            "model": ctx.model,
            "model_provider": "hrl",
            "approval_policy": "never",
            "sandbox_mode": "danger-full-access",
            "check_for_update_on_startup": False,
        }
        if ctx.context_window:
            top["model_context_window"] = ctx.context_window
            top["model_auto_compact_token_limit"] = ctx.compaction_limit()
        top |= ctx.options.get("config", {})
        provider: dict[str, Any] = {
            "name": "harnessrl",
            "base_url": ctx.openai_base_url,
            "env_key": "HRL_API_KEY",
            "wire_api": "responses",
        }
        for key in ("request_max_retries", "stream_max_retries"):
            if ctx.options.get(key) is not None:
                provider[key] = int(ctx.options[key])
        return "\n".join(
            [
                toml_table(None, top),
                toml_table("analytics", {"enabled": False}),
                toml_table("model_providers.hrl", provider),
            ]
        )

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        binary = self.binary(ctx.cache_dir)
        codex_home = ctx.in_home(".codex")
        argv = [
            binary,
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
        ]
        argv += ["--color", "never"]
        if ctx.options.get("json", True):
            argv.append("--json")
        argv += ["-C", ctx.workspace, *ctx.options.get("extra_args", []), "-"]
        path = SYSTEM_PATH
        if "/vendor/" in binary:  # the npm wrapper puts the vendored ripgrep first on PATH
            path = binary.rsplit("/bin/", 1)[0] + "/codex-path:" + path
        env = self.base_env(ctx) | {
            "CODEX_HOME": codex_home,
            "HRL_API_KEY": ctx.token,
            "PATH": path,
            "CODEX_MANAGED_BY_NPM": "1",
        }
        spec = LaunchSpec(
            argv=argv,
            env=env,
            api=self.api,
            files={f"{codex_home}/config.toml": self.config_toml(ctx)},
            ro_binds=self.binds(ctx.cache_dir),
            stdin=ctx.instruction.encode(),
        )
        return self.finish(ctx, spec)
