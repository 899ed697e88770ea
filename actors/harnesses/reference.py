r"""``reference``: harnessrl's own agent CLI (`reference_agent.py`), nothing to install.

Launch (inside the sandbox)::

    /usr/bin/python3 /opt/hrl/harnesses/reference/reference_agent.py \
        --workspace <ws> --task-file <home>/.hrl/instruction.md [--max-turns N] \
        [--compact-tokens N] [--subagent] [--cmd-timeout S] [--max-tokens N] [--temperature T]
    env: OPENAI_BASE_URL=<proxy>/v1  OPENAI_API_KEY=<token>  HRL_MODEL=<model>

The script is stdlib-only and bound read-only as a single file, so it runs with the host's
``/usr/bin/python3`` and needs no venv inside the sandbox.

Context window and output limit: ``--max-tokens`` is ``ctx.output_limit()`` (unset when
unknown) and ``--compact-tokens`` is ``ctx.compaction_limit()``, ``W - max(O, W // 4)``: 24,576
for W=32,768 and O=4,096. The agent compacts when the last reply's prompt + completion tokens
exceed it, checked after each reply (as Codex does, so the same reserve).

Options (``ctx.options``): ``compact_tokens`` (int, overrides the above; 0: never),
``subagent`` (bool), ``subagent_max_turns``, ``cmd_timeout``, ``max_tokens`` (or
``max_output_tokens``; either overrides ``ctx.max_output_tokens``), ``temperature``,
``python`` (interpreter inside the sandbox).

Call labels: the ``x-hrl-call-label`` header (``compaction``, ``subagent``); none means main.
"""

from __future__ import annotations

from pathlib import Path

from harnessrl.actors.harnesses import reference_agent
from harnessrl.actors.harnesses.base import HarnessAdapter, HarnessContext, LaunchSpec, host_python

SCRIPT = Path(reference_agent.__file__).resolve()
_FLAGS = {
    "subagent_max_turns": "--subagent-max-turns",
    "cmd_timeout": "--cmd-timeout",
    "temperature": "--temperature",
    "retries": "--retries",
    "retry_base": "--retry-base",
}


class ReferenceAdapter(HarnessAdapter):
    name = "reference"
    api = "chat"
    first_request_tokens = 458
    summary = "harnessrl's own stdlib agent CLI (chat completions; compaction, sub-agents)"

    def install_dir(self, cache_dir: Path) -> Path:
        return SCRIPT.parent

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        opts = ctx.options
        script = f"{self.mount_dir()}/{SCRIPT.name}"
        task_file = ctx.in_home(".hrl/instruction.md")
        argv = [opts.get("python", host_python()), script, "--workspace", ctx.workspace]
        argv += ["--task-file", task_file]
        if ctx.max_turns is not None:
            argv += ["--max-turns", str(ctx.max_turns)]
        max_tokens = opts.get("max_tokens", ctx.output_limit())
        compact = opts.get("compact_tokens")
        if compact is None:
            compact = ctx.compaction_limit(max_tokens)
        if compact:
            argv += ["--compact-tokens", str(int(compact))]
        if opts.get("subagent"):
            argv.append("--subagent")
        if max_tokens is not None:
            argv += ["--max-tokens", str(int(max_tokens))]
        for key, flag in _FLAGS.items():
            if opts.get(key) is not None:
                argv += [flag, str(opts[key])]
        env = self.base_env(ctx) | {
            "OPENAI_BASE_URL": ctx.openai_base_url,
            "OPENAI_API_KEY": ctx.token,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        spec = LaunchSpec(
            argv=argv,
            env=env,
            api=self.api,
            files={task_file: ctx.instruction},
            ro_binds=[(SCRIPT, script)],
        )
        return self.finish(ctx, spec)
