"""``harnessrl`` — one console script, one subcommand per process or tool.

Each subcommand lives in its own module, named in ``COMMANDS``, which provides:

* ``CONFIG``: the pydantic config model (flags are generated from it), and/or
  ``add_arguments(parser)`` for extra positional arguments and sub-subcommands;
* ``main(cfg, args) -> int``: the thin entry point (parse → wire → run loop).

Only the selected subcommand's module is imported, and heavy libraries (torch, deepspeed,
transformers) are imported inside ``main``, so ``harnessrl --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel


@dataclass(frozen=True)
class Command:
    """One ``harnessrl`` subcommand."""

    help: str
    module: str
    """Module providing CONFIG/add_arguments/main (imported by name when selected)."""


COMMANDS: dict[str, Command] = {
    "nats": Command(
        "run an embedded nats-server with JetStream (one server, or a node of a cluster)",
        "harnessrl.common.natsd_cli",
    ),
    "engine": Command(
        "serve a model over SGLang's native HTTP API (CPU/embedded)", "harnessrl.proxy.engine_cmd"
    ),
    "proxy": Command(
        "model-API gateway for one rollout (OpenAI/Anthropic APIs)", "harnessrl.proxy.proxy_cmd"
    ),
    "actor": Command(
        "run rollouts: sandboxes + harnesses + verifiers", "harnessrl.actors.actor_cmd"
    ),
    "assembler": Command(
        "rebuild rollouts' calls into prefix-tree samples", "harnessrl.learner.assembler_cmd"
    ),
    "learner": Command(
        "train on tree samples (GRPO/PPO, DeepSpeed) and broadcast weights",
        "harnessrl.learner.learner_cmd",
    ),
    "run": Command(
        "start a whole training run (all processes) from one config", "harnessrl.common.run.run"
    ),
    "demo": Command(
        "the built-in end-to-end demo: RL on the toy suite from the shipped tiny-agent, "
        "held-out success before and after (--from-scratch: cold-start SFT first)",
        "harnessrl.common.run.demo",
    ),
    "rollout": Command(
        "run a single rollout by hand and print its score and tree", "harnessrl.actors.rollout_cmd"
    ),
    "eval": Command(
        "evaluate policies on a task suite across harnesses", "harnessrl.actors.eval_cmd"
    ),
    "tasks": Command("list, show, import and lint tasks", "harnessrl.actors.tasks_cmd"),
    "teacher-data": Command(
        "offline toy-teacher trajectories through the reference agent (SFT data)",
        "harnessrl.actors.teacher_data",
    ),
    "pretrain": Command(
        "the warm-start recipe: language warm-up + SFT on teacher data -> tiny-agent",
        "harnessrl.learner.pretrain_cmd",
    ),
    "harness": Command("install and list harness adapters", "harnessrl.actors.harness_cmd"),
    "weights-sync": Command(
        "apply broadcast weight versions to an SGLang engine", "harnessrl.proxy.weights_sync_cmd"
    ),
}


def _selected(argv: list[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="harnessrl",
        description="RL training of language models through real, unmodified agent harnesses.",
        epilog="Run `harnessrl COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _selected(argv)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, allow_abbrev=False)
        if name == chosen:
            mod = importlib.import_module(cmd.module)
            if hasattr(mod, "add_arguments"):
                mod.add_arguments(p)
            if getattr(mod, "CONFIG", None) is not None:
                from harnessrl.common.config import add_config_args

                add_config_args(p, mod.CONFIG)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    mod = importlib.import_module(COMMANDS[args.command].module)
    cfg = None
    if getattr(mod, "CONFIG", None) is not None:
        from harnessrl.common.config import ConfigError, config_from_args, dump_toml

        try:
            cfg = config_from_args(mod.CONFIG, args, section=getattr(mod, "SECTION", None))
        except ConfigError as e:
            print(f"harnessrl {args.command}: {e}", file=sys.stderr)
            return 2
        if args.print_config:
            sys.stdout.write(dump_toml(cfg))
            return 0
    from harnessrl.common.aio import StartupError

    try:
        return int(mod.main(cfg, args) or 0)
    except KeyboardInterrupt:
        return 130
    except StartupError as e:  # a message may already name the command (a bus client's name)
        prefix = f"harnessrl {args.command}:"
        text = str(e)
        print(text if text.startswith(prefix) else f"{prefix} {text}", file=sys.stderr)
        return 1


def command_config(name: str) -> type[BaseModel]:
    """The config model of command ``name`` (its module's ``CONFIG``), resolved by name: how
    ``common`` (e.g. ``harnessrl demo``) validates another process's config section without
    importing its package. Raises ``KeyError`` for a command that has no config model."""
    config = getattr(importlib.import_module(COMMANDS[name].module), "CONFIG", None)
    if config is None:
        raise KeyError(f"harnessrl {name} has no config model")
    return config


def run_module(name: str) -> None:
    """Entry point of ``python -m <a command's module> ARGS``: exactly ``harnessrl NAME ARGS``
    (one parser, config loading and error handling for both ways in)."""
    sys.exit(main([name, *sys.argv[1:]]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
