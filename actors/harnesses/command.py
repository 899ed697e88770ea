"""``command``: any command line the user gives (``--harness-cmd '…'``), for harnesses we have
no adapter for, and for tasks' scripted reference solutions.

Launch: ``/bin/sh -c '<command>'`` (or the argv list as given) in the workspace, with the
proxy's URLs and the rollout's token in the variables every SDK and most CLIs read::

    OPENAI_BASE_URL=<proxy>/v1   OPENAI_API_KEY=<token>   OPENAI_MODEL=<model>
    ANTHROPIC_BASE_URL=<proxy>   ANTHROPIC_API_KEY=<token>
    HRL_MODEL=<model>  HRL_WORKSPACE=<ws>  HRL_PROXY_URL=<proxy>  [HRL_MAX_TURNS=N]
    [HRL_CONTEXT_WINDOW=W]  [HRL_MAX_OUTPUT_TOKENS=O]   (the engine's window, the run's limit)
    HRL_INSTRUCTION=<the task text>  HRL_INSTRUCTION_FILE=<home>/.hrl/instruction.md
    HOME=<home>

Options: ``command`` (str, run by ``sh -c``; or a list, run as argv) — required;
``ro_binds`` (list of ``[host_path, inside_path]`` the command needs, e.g. a solution script);
``stdin_instruction`` (bool: also feed the task on stdin).

API: whatever the command calls (``any``); every call is labelled main.
"""

from __future__ import annotations

from pathlib import Path

from harnessrl.actors.harnesses.base import HarnessAdapter, HarnessContext, LaunchSpec


class CommandAdapter(HarnessAdapter):
    name = "command"
    api = "any"
    summary = "any command line (--harness-cmd), proxy URLs + token in OPENAI_*/ANTHROPIC_*"

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        cmd = ctx.options.get("command")
        if not cmd:
            raise ValueError("the command harness needs a command line (--harness-cmd '…')")
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        task_file = ctx.in_home(".hrl/instruction.md")
        env = self.base_env(ctx) | {
            "OPENAI_BASE_URL": ctx.openai_base_url,
            "OPENAI_API_KEY": ctx.token,
            "OPENAI_MODEL": ctx.model,
            "ANTHROPIC_BASE_URL": ctx.proxy_url.rstrip("/"),
            "ANTHROPIC_API_KEY": ctx.token,
            "HRL_INSTRUCTION": ctx.instruction,
            "HRL_INSTRUCTION_FILE": task_file,
        }
        binds = [(Path(h), str(i)) for h, i in ctx.options.get("ro_binds", [])]
        spec = LaunchSpec(
            argv=argv,
            env=env,
            api=self.api,
            files={task_file: ctx.instruction},
            ro_binds=binds,
            stdin=ctx.instruction.encode() if ctx.options.get("stdin_instruction") else None,
        )
        return self.finish(ctx, spec)
