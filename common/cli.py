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


@dataclass(frozen=True)
class Command:
    """One ``harnessrl`` subcommand."""

    help: str
    module: str | None
    """Module providing CONFIG/add_arguments/main; None while its issue has not landed."""
    issue: int


COMMANDS: dict[str, Command] = {
    "nats": Command("run an embedded nats-server with JetStream", "common.natsd_cli", 2),
    "engine": Command(
        "serve a model over SGLang's native HTTP API (CPU/embedded)", "proxy.engine_cmd", 3
    ),
    "proxy": Command(
        "model-API gateway for one rollout (OpenAI/Anthropic APIs)", "proxy.proxy_cmd", 4
    ),
    "actor": Command("run rollouts: sandboxes + harnesses + verifiers", "actors.actor_cmd", 5),
    "assembler": Command(
        "rebuild rollouts' calls into prefix-tree samples", "learner.assembler_cmd", 6
    ),
    "learner": Command(
        "train on tree samples (GRPO/PPO, DeepSpeed) and broadcast weights",
        "learner.learner_cmd",
        7,
    ),
    "run": Command(
        "start a whole training run (all processes) from one config", "common.run_cmd", 8
    ),
    "demo": Command(
        "the built-in end-to-end demo: SFT then RL on the toy suite", "common.demo_cmd", 8
    ),
    "rollout": Command(
        "run a single rollout by hand and print its score and tree", "actors.rollout_cmd", 5
    ),
    "eval": Command("evaluate policies on a task suite across harnesses", "common.eval_cmd", 8),
    "tasks": Command("list, show, import and lint tasks", "actors.tasks_cmd", 5),
    "harness": Command("install and list harness adapters", "actors.harness_cmd", 5),
    "weights-sync": Command(
        "apply broadcast weight versions to an SGLang engine", "learner.weights_sync_cmd", 7
    ),
}

EXIT_NOT_LANDED = 3


def _selected(argv: list[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harnessrl",
        description="RL training of language models through real, unmodified agent harnesses.",
        epilog="Run `harnessrl COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _selected(argv)
    for name, cmd in COMMANDS.items():
        status = "" if cmd.module else f" [not available yet: issue #{cmd.issue}]"
        p = sub.add_parser(name, help=cmd.help + status, description=cmd.help + status)
        if name == chosen and cmd.module:
            mod = importlib.import_module(cmd.module)
            if hasattr(mod, "add_arguments"):
                mod.add_arguments(p)
            if getattr(mod, "CONFIG", None) is not None:
                from common.config import add_config_args

                add_config_args(p, mod.CONFIG)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    cmd = COMMANDS[args.command]
    if cmd.module is None:
        print(
            f"harnessrl {args.command}: not available yet — it lands with issue #{cmd.issue}.",
            file=sys.stderr,
        )
        return EXIT_NOT_LANDED
    mod = importlib.import_module(cmd.module)
    cfg = None
    if getattr(mod, "CONFIG", None) is not None:
        from common.config import ConfigError, config_from_args, dump_toml

        try:
            cfg = config_from_args(mod.CONFIG, args, section=getattr(mod, "SECTION", None))
        except ConfigError as e:
            print(f"harnessrl {args.command}: {e}", file=sys.stderr)
            return 2
        if args.print_config:
            sys.stdout.write(dump_toml(cfg))
            return 0
    try:
        return int(mod.main(cfg, args) or 0)
    except KeyboardInterrupt:
        return 130


def run_module(name: str) -> None:
    """Entry point of ``python -m <a command's module> ARGS``: exactly ``harnessrl NAME ARGS``
    (one parser, config loading and error handling for both ways in)."""
    sys.exit(main([name, *sys.argv[1:]]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
