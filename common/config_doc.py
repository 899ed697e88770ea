"""``python -m harnessrl.common.config_doc``: write ``docs/configuration.md`` from the config
models themselves, so the reference cannot drift from the code.

    python -m harnessrl.common.config_doc            # (re)write docs/configuration.md
    python -m harnessrl.common.config_doc --check    # exit 1 when the file is stale

Run it from the checkout root (``--out`` names another file). One section per ``harnessrl``
command that has a config model (in the order of ``harnessrl --help``), then the task files'
schemas; each section is a table of every leaf field: its TOML key (dotted below its table),
type, default, bounds and docstring. Models are found by command name through the CLI face
(`harnessrl.common.cli.command_config`), never imported by package, so ``common`` keeps
importing nothing above it. The output depends only on the models: no dates, no paths of
this machine.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from harnessrl.common.config import field_bounds, iter_fields

DEFAULT_OUT = Path("docs/configuration.md")
COMMAND = "python -m harnessrl.common.config_doc"


@dataclass(frozen=True)
class Section:
    """One model's table in the reference."""

    title: str
    model: type[BaseModel]
    where: str
    """Where its keys are written (a TOML file's table, a run file's table...)."""
    intro: str = ""


RUN_TABLES = ("engine", "actor", "assembler", "learner", "weights_sync")
"""The tables of a run file each read by the process of that name (``harnessrl run``)."""


def _where(name: str, section: str | None) -> str:
    own = f"the `[{section}]` table or the top level" if section else "the top level"
    where = f"In its `--config` file: {own}"
    table = name.replace("-", "_")
    if table in RUN_TABLES:
        where += f"; in a run file: `[{table}]`"
    return where + "."


def _models() -> list[Section]:
    from harnessrl.common.cli import COMMANDS, command_config
    from harnessrl.common.run.config import RunConfig
    from harnessrl.common.tasks.formats import NativeToml

    sections = []
    for name, cmd in COMMANDS.items():
        try:
            model = RunConfig if name == "run" else command_config(name)
        except KeyError:
            continue  # tasks, harness: positional arguments only
        section = getattr(importlib.import_module(cmd.module), "SECTION", None)
        where = "In a run file: `[run]`." if name == "run" else _where(name, section)
        intro = cmd.help[0].upper() + cmd.help[1:] + "."
        sections.append(Section(f"`harnessrl {name}`", model, where, intro))
    # the judge is no command: found by name through the actor's config module, like the rest
    judge = getattr(sys.modules[command_config("actor").__module__], "JudgeConfig", None)
    if judge is not None:
        sections.append(
            Section(
                "Rubric judge",
                judge,
                "In the actor's config: the `[actor.judge]` table (`--judge` takes it as JSON).",
                "The ``judge`` table of ``harnessrl actor``, ``rollout`` and ``eval``: the LLM "
                "that scores tasks' rubric rules.",
            )
        )
    sections.append(
        Section(
            "Task files: `task.toml`",
            NativeToml,
            "The top level of a task folder's `task.toml`.",
            "The native task format ([tasks.md](tasks.md)). A `suite.toml` beside a suite's "
            "task folders may hold an `[environment]` table (the keys `environment.*` below): "
            "the default of every task in it that declares none.",
        )
    )
    return sections


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A field's annotation as a reader writes it: ``int``, ``list[str]``, ``"a" | "b"``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def default_text(info: Any) -> str:
    """A field's default as it would be written in TOML (``—`` when required or unset)."""
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, Path):
        value = str(value)
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_section(s: Section) -> str:
    doc = " ".join((s.model.__doc__ or "").split())
    lines = [f"## {s.title}", ""]
    if s.intro:
        lines += [_cell(s.intro), ""]
    if doc and doc != s.intro:
        lines += [doc, ""]
    lines += [f"{s.where} A dotted key `a.b` is key `b` of sub-table `a`.", ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for dotted, info, tp in iter_fields(s.model):
        bounds = field_bounds(info)
        desc = _cell(info.description or "")
        if bounds:
            desc += f" *({', '.join(bounds)})*"
        lines.append(f"| `{dotted}` | {type_name(tp)} | {default_text(info)} | {desc} |")
    return "\n".join(lines) + "\n"


def _anchor(title: str) -> str:
    text = re.sub(r"[^\w\- ]", "", title.lower())
    return text.strip().replace(" ", "-")


def render() -> str:
    """The whole reference, as committed in ``docs/configuration.md``."""
    sections = _models()
    head = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `{COMMAND}` from the config models; do not edit by hand. "
        "`--check` says whether it is current (a test does too). -->",
        "",
        "Every process has one typed config (pydantic). A field is set, in rising order of "
        "precedence, by its default, by a TOML file (`--config FILE`; a run file's table for "
        "that process) and by a flag: key `metrics_port` is `--metrics-port`, nested key "
        "`ds.lr_warmup_versions` is `--ds.lr-warmup-versions`; booleans take `--flag` / "
        "`--no-flag`, lists repeat the flag, dicts take JSON. Unknown or ill-typed keys are "
        "errors that name the key. `--print-config` prints the resolved config as TOML, which "
        "`--config` reads back; `harnessrl CMD --help` lists the same fields.",
        "",
        "A run file (`harnessrl run FILE`) holds `[run]` and one table per process kind: "
        "`[engine]`, `[actor]`, `[assembler]`, `[learner]`, `[weights_sync]`, each read by "
        "that process with the fields of its section below.",
        "",
    ]
    head += [f"- [{s.title}](#{_anchor(s.title)})" for s in sections]
    return "\n".join(head) + "\n\n" + "\n".join(render_section(s) for s in sections)


def stale(path: Path) -> str:
    """Empty when ``path`` holds what `render` writes, else a short diff saying what changed."""
    want = render()
    have = path.read_text() if path.exists() else ""
    if have == want:
        return ""
    diff = difflib.unified_diff(
        have.splitlines(), want.splitlines(), str(path), "generated", lineterm="", n=0
    )
    return "\n".join(list(diff)[:40])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="file to write or check")
    p.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = p.parse_args(argv)
    if args.check:
        diff = stale(args.out)
        if diff:
            print(f"{args.out} is stale: run `{COMMAND}`\n{diff}", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
