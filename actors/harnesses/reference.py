r"""``reference``: harnessrl's own agent CLI (`reference_agent.py`), nothing to install.

Launch (inside the sandbox)::

    /usr/bin/python3 /opt/hrl/harnesses/reference/reference_agent.py \
        --workspace <ws> --task-file <home>/.hrl/instruction.md [--max-turns N] \
        [--compact-tokens N] [--subagent] [--cmd-timeout S] [--max-tokens N] [--temperature T]
    env: OPENAI_BASE_URL=<proxy>/v1  OPENAI_API_KEY=<token>  HRL_MODEL=<model>

The script is stdlib-only and bound read-only as a single file, so it runs with the host's
``/usr/bin/python3`` and needs no venv inside the sandbox.

Options (``ctx.options``): ``compact_tokens`` (int; default: 3/4 of ``ctx.context_window``
when that is set, else off), ``subagent`` (bool), ``subagent_max_turns``, ``cmd_timeout``,
``max_tokens``, ``temperature``, ``python`` (interpreter inside the sandbox).

Call labels: the ``x-hrl-call-label`` header (``compaction``, ``subagent``); none means main.
"""

from __future__ import annotations

from pathlib import Path

from actors.harnesses import reference_agent
from actors.harnesses.base import HarnessAdapter, HarnessContext, LaunchSpec, host_python

SCRIPT = Path(reference_agent.__file__).resolve()
_FLAGS = {
    "subagent_max_turns": "--subagent-max-turns",
    "cmd_timeout": "--cmd-timeout",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "retries": "--retries",
    "retry_base": "--retry-base",
}


class ReferenceAdapter(HarnessAdapter):
    name = "reference"
    api = "chat"
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
        compact = opts.get("compact_tokens")
        if compact is None and ctx.context_window:
            compact = ctx.context_window * 3 // 4
        if compact:
            argv += ["--compact-tokens", str(int(compact))]
        if opts.get("subagent"):
            argv.append("--subagent")
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
