r"""``mini-swe-agent``: the SWE-agent team's minimal bash-only agent, via litellm.

Install: a venv made from the host's ``/usr/bin/python3`` at ``<cache>/mini-swe-agent/venv``
with ``pip install mini-swe-agent`` (litellm brings a lot, ~750 MiB).

Files: ``<home>/.config/mini-swe-agent/hrl.yaml`` (JSON, which YAML reads) holding the model
endpoint and key, the step limit and the working directory — so the token never appears on a
command line::

    {"model": {"model_kwargs": {"api_base": "<proxy>/v1", "api_key": "<token>",
                                "max_tokens": O}},
     "agent": {"step_limit": N, "cost_limit": 0},
     "environment": {"cwd": "<ws>", "timeout": S}}

Launch::

    <mount>/venv/bin/python -m minisweagent.run.mini -y --exit-immediately \
        -m openai/<model> -t <instruction> -c mini.yaml -c <home>/.config/mini-swe-agent/hrl.yaml \
        -o <home>/mini-traj.json
    env: HOME=<home> MSWEA_CONFIGURED=true MSWEA_COST_TRACKING=ignore_errors
         MSWEA_GLOBAL_CONFIG_DIR=<home>/.config/mini-swe-agent LITELLM_LOCAL_MODEL_COST_MAP=True
         OPENAI_API_KEY=<token> OPENAI_BASE_URL=<proxy>/v1

One ``bash`` tool; the run ends when the model runs ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``.
``LITELLM_LOCAL_MODEL_COST_MAP`` stops litellm fetching its price list from the internet.

Context window and output limit: ``max_tokens`` is ``ctx.output_limit()`` (left out when
unknown), sent with every request. mini-swe-agent keeps no count of its context and never
compacts, so ``ctx.context_window`` is not told to it: a prompt past the window gets the
proxy's 400 ``context_length_exceeded``, which ends the run.

Options: ``command_timeout`` (seconds per bash command), ``max_output_tokens`` (overrides
``ctx.max_output_tokens``), ``config`` (extra ``-c`` entries).

API: OpenAI chat completions, never streaming. No sub-agents, no compaction: every call is main.

Preloaded start (``harnessrl.actors.harnesses.preload``): the actor may start it from an
interpreter that has imported litellm and the CLI's libraries once (~0.4 s of CPU a start
instead of 3.5-4.3 s); the argv and environment above are unchanged.
"""

from __future__ import annotations

import json

from harnessrl.actors.harnesses.base import HarnessContext, LaunchSpec
from harnessrl.actors.harnesses.install import PipVenvAdapter


class MiniSweAgentAdapter(PipVenvAdapter):
    name = "mini-swe-agent"
    api = "chat"
    first_request_tokens = 1201
    measured_version = "2.4.6"
    summary = "mini-swe-agent (pip, own venv), bash-only, chat completions"
    packages = ("mini-swe-agent",)
    dist_name = "mini-swe-agent"
    entry = "minisweagent.run.mini"
    # what a cold start imports before its first request, less mini-swe-agent itself (its
    # import reads the rollout's $HOME config); none keeps per-rollout state from its import
    preload_modules = (
        "litellm",
        "litellm.proxy._types",
        "litellm.llms.litellm_proxy.chat.transformation",
        "httpcore",
        "h11",
        "prompt_toolkit",
        "rich.console",
        "typer",
        "yaml",
        "platformdirs",
        "dotenv",
    )
    preload_env = (("LITELLM_LOCAL_MODEL_COST_MAP", "True"), ("NO_COLOR", "1"))

    def prepare(self, ctx: HarnessContext) -> LaunchSpec:
        python = self.locate(ctx.cache_dir, "venv/bin/python")
        cfg_dir = ctx.in_home(".config/mini-swe-agent")
        cfg_file = f"{cfg_dir}/hrl.yaml"
        agent: dict = {"cost_limit": 0}
        if ctx.max_turns is not None:
            agent["step_limit"] = ctx.max_turns
        environment: dict = {"cwd": ctx.workspace}
        if ctx.options.get("command_timeout") is not None:
            environment["timeout"] = int(ctx.options["command_timeout"])
        model_kwargs: dict = {"api_base": ctx.openai_base_url, "api_key": ctx.token}
        if (out := ctx.output_limit()) is not None:
            model_kwargs["max_tokens"] = out
        config = {
            "model": {"model_kwargs": model_kwargs},
            "agent": agent,
            "environment": environment,
        }
        argv = [python, "-m", self.entry, "-y", "--exit-immediately"]
        argv += ["-m", f"openai/{ctx.model}", "-t", ctx.instruction]
        argv += ["-c", "mini.yaml", "-c", cfg_file]
        for extra in ctx.options.get("config", []):
            argv += ["-c", extra]
        argv += ["-o", ctx.in_home("mini-traj.json")]
        env = self.base_env(ctx) | {
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_CONFIG_DIR": cfg_dir,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "OPENAI_API_KEY": ctx.token,
            "OPENAI_BASE_URL": ctx.openai_base_url,
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        spec = LaunchSpec(
            argv=argv,
            env=env,
            api=self.api,
            files={cfg_file: json.dumps(config, indent=2) + "\n"},
            ro_binds=self.binds(ctx.cache_dir),
            preload=self.preload(ctx.cache_dir, self.entry),
        )
        return self.finish(ctx, spec)
