"""``harnessrl tasks``: list, show, import and lint tasks.

Wherever a task is named, ``SUITE/ID`` and a task folder path both work; wherever a suite is
named, a suite name and a directory of task folders both work. Exit status: 0 ok, 1 a task
failed lint, 2 bad arguments or a task that does not load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

CONFIG = None

EPILOG = """\
examples:
  harnessrl tasks list --suite toy --json
  harnessrl tasks show workspace/expense_report
  harnessrl tasks import syn_task.jsonl --out my-suite/
  harnessrl tasks lint workspace ./my-suite/task_0042
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    sub = parser.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)

    p = sub.add_parser("list", help="list tasks (all suites, or one)", description="List tasks.")
    p.add_argument(
        "--suite",
        action="append",
        metavar="S",
        help="suite name or directory (repeatable; default: every known suite)",
    )
    p.add_argument("--split", metavar="SPLIT", help="only tasks of this split (train, eval)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of objects (suite, id, category, split, task_hash, …)",
    )

    p = sub.add_parser("suites", help="list known suites", description="List known suites.")
    p.add_argument("--json", action="store_true", help="print a JSON object name -> directory")

    p = sub.add_parser("show", help="show one task", description="Show one task's definition.")
    p.add_argument("task", metavar="SUITE/ID|PATH", help="the task")
    p.add_argument("--json", action="store_true", help="print the task as one JSON object")

    p = sub.add_parser(
        "import",
        help="import ClawGym JSONL / ClawGym folders / Harbor tasks as native folders",
        description="Convert a ClawGym JSONL file, a task folder (ClawGym, Harbor, native) or a "
        "folder of task folders into native task folders under --out (one per task).",
    )
    p.add_argument("source", metavar="FILE.jsonl|DIR", type=Path, help="what to import")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="directory to write task folders into (usable as a suite path)",
    )

    p = sub.add_parser(
        "lint",
        help="check that each task's checker flips on failing workspaces",
        description="For each task: the reference solution must score 1.0, the untouched workspace "
        "below 1, and every metric must drop below 1 when a file the solution wrote or the checker "
        "reads is deleted, emptied or truncated. Runs in real sandboxes.",
    )
    p.add_argument(
        "targets",
        nargs="*",
        metavar="SUITE|SUITE/ID|PATH",
        help="what to lint (default: every known suite)",
    )
    p.add_argument(
        "--jobs", type=int, default=4, metavar="N", help="sandboxes verified at once (default 4)"
    )
    p.add_argument("--sandbox", default="bwrap", choices=["bwrap"], help="sandbox backend")
    p.add_argument("--json", action="store_true", help="print a JSON list of lint reports")


def main(cfg: Any, args: argparse.Namespace) -> int:
    from common.tasks import TaskError

    try:
        return _ACTIONS[args.tasks_command](args)
    except TaskError as e:
        print(f"harnessrl tasks: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    from common.tasks import list_suites, list_tasks

    suites = args.suite or list(list_suites())
    tasks = [t for s in suites for t in list_tasks(s, split=args.split)]
    if args.json:
        print(json.dumps([t.summary() for t in tasks], indent=1))
        return 0
    for t in tasks:
        print(
            f"{t.suite + '/' + t.id:<44} {t.category:<12} {t.difficulty:<7} {t.split:<6} {t.checker}"
        )
    print(f"{len(tasks)} tasks", file=sys.stderr)
    return 0


def _suites(args: argparse.Namespace) -> int:
    from common.tasks import list_suites, list_tasks

    suites = list_suites()
    if args.json:
        print(json.dumps({k: str(v) for k, v in suites.items()}, indent=1))
        return 0
    for name, d in suites.items():
        print(f"{name:<16} {len(list_tasks(name)):>4} tasks  {d}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from common.tasks import resolve_task

    t = resolve_task(args.task)
    if args.json:
        print(json.dumps(json.loads(t.model_dump_json()), indent=1))
        return 0
    rows = [
        ("task", t.name),
        ("format", t.format),
        ("category", t.category),
        ("difficulty", t.difficulty),
        ("split", t.split),
        ("hash", t.task_hash),
        ("workspace", f"{t.workspace_dir} -> {t.mount}"),
        ("checker", f"{t.checker} ({t.reward_dir}/{t.checker_entry})"),
        ("timeouts", f"agent {t.agent_timeout_s:g} s, verifier {t.verifier_timeout_s:g} s"),
        ("solution", str(t.solution or "none")),
    ]
    for k, v in rows:
        print(f"{k:<11} {v}")
    print("\ninstruction:\n  " + t.instruction.strip().replace("\n", "\n  "))
    if t.rubric:
        print("\nrubric:")
        for r in t.rubric:
            print(f"  - {r}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from common.tasks import import_any

    written = import_any(args.source, args.out)
    for p in written:
        print(p)
    print(f"imported {len(written)} task(s) into {args.out}", file=sys.stderr)
    return 0


def _lint(args: argparse.Namespace) -> int:
    from common.aio import run
    from common.tasks import list_suites, resolve_tasks

    targets = args.targets or list(list_suites())
    tasks = [t for spec in targets for t in resolve_tasks(spec)]
    reports = run(_lint_all(tasks, args.jobs, args.sandbox))
    if reports is None:
        return 2
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        for r in reports:
            print(
                f"{'ok  ' if r.ok else 'FAIL'} {r.task}  ({r.mutations} mutations, {r.duration:.1f} s)"
            )
            for p in r.problems:
                print(f"     problem: {p}")
            for w in r.warnings:
                print(f"     warning: {w}")
    bad = sum(not r.ok for r in reports)
    print(f"{len(reports) - bad}/{len(reports)} tasks pass lint", file=sys.stderr)
    return 1 if bad else 0


async def _lint_all(tasks: list, jobs: int, sandbox: str) -> list | None:
    from actors.sandbox import SandboxError, make_backend
    from actors.verifier import backend_factory, lint_task

    backend = make_backend(sandbox)
    try:
        await backend.start()
    except SandboxError as e:
        print(f"harnessrl tasks lint: {e}", file=sys.stderr)
        return None
    sem = asyncio.Semaphore(max(1, jobs))
    factory = backend_factory(backend, owner="lint")

    async def one(t):
        async with sem:
            return await lint_task(t, factory, jobs=2)

    try:
        return await asyncio.gather(*(one(t) for t in tasks))
    finally:
        await backend.close()


_ACTIONS = {"list": _list, "suites": _suites, "show": _show, "import": _import, "lint": _lint}
