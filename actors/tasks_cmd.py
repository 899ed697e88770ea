"""``harnessrl tasks``: list, show, import and lint tasks.

Wherever a task is named, ``SUITE/ID`` and a task folder path both work; wherever a suite is
named, a suite name and a directory of task folders both work. Exit status: 0 ok, 1 a task
failed lint, 2 bad arguments or a task that does not load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harnessrl.actors.lint import LintConfig

CONFIG = None

EPILOG = """\
examples:
  harnessrl tasks list --suite toy --json
  harnessrl tasks show workspace/expense_report
  harnessrl tasks import syn_task.jsonl --out my-suite/
  harnessrl tasks import clawgym-bench/ --out bench/ --split eval --force
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
        "folder of task folders into native task folders under --out (one per task). A task "
        "that does not load (a bad folder or JSONL line) is skipped with its reason and the rest "
        "imported, as are folders that are no task folder; a summary says what was imported and "
        "skipped. Duplicate task ids, or a non-empty --out without --force, stop the import "
        "before anything is written. A JSONL record's hook_code must run one of its reward "
        "files as `python3 reward/<file>.py <workspace>` (that file becomes the checker); a "
        "record with another hook is skipped. Tasks imported from ClawGym JSONL or folders "
        'declare the clawgym environment ([environment] name = "clawgym": a python command, '
        "pytest, pandas, requests, flask, PyYAML). Exit status: 0 all imported, 2 a task was "
        "skipped for an error or nothing was imported.",
    )
    p.add_argument("source", metavar="FILE.jsonl|DIR", type=Path, help="what to import")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="directory to write task folders into (usable as a suite path); must be empty or "
        "absent unless --force",
    )
    p.add_argument(
        "--split",
        metavar="SPLIT",
        help="split of every imported task (train, eval; default: the source's own, else train)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace what --out holds (all of it) once the import has succeeded",
    )

    p = sub.add_parser(
        "lint",
        help="check that each task's checker gives no credit to failing workspaces",
        description="Run each task's checker in real sandboxes on workspaces that must fail: "
        "untouched, every output file empty, of the wrong type (text for JSON, JSON for text), "
        "truncated, JSON outputs holding [], and (when the checker lists directories) a copy of "
        "the checker's files in the workspace. Output names come from the prompt and the "
        "checker's string literals, minus the inputs. Problems: a probe scoring at or above "
        "--threshold, a checker that crashes on the untouched workspace or reads its own files "
        "from the workspace; with a reference solution, it must score 1.0 and every metric must "
        "drop below 1 when a file it wrote or the checker names is deleted, emptied or truncated. "
        "Metrics a task declares as reward shaping ([metadata.lint] shaping = [...]) only warn. "
        "Each sandbox has its task's environment (built on first use and cached).",
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
    p.add_argument(
        "--threshold",
        type=float,
        default=0.25,
        metavar="X",
        help="a failing probe scoring at least X is a problem (0 < X <= 1, default 0.25)",
    )
    p.add_argument(
        "--mutations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="for a task with a reference solution, also run it (it must score 1.0) and delete, "
        "empty and truncate each file it wrote or the checker names (every metric must drop "
        "below 1 under one of these); --no-mutations skips all of that, keeping only the probes "
        "that need no solution (default: on)",
    )
    p.add_argument(
        "--max-outputs",
        type=int,
        default=None,
        metavar="N",
        help="probe at most N inferred output files per task, names from the prompt first, then "
        "the checker's, then the solution's (1 <= N <= 1000, default 24)",
    )
    p.add_argument("--sandbox", default="bwrap", choices=["bwrap"], help="sandbox backend")
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list, per task: task, ok, problems (rule, metric, probe, detail), "
        "scores (probe -> score), probes (score, metrics passed, error), outputs, warnings",
    )


def main(cfg: None, args: argparse.Namespace) -> int:
    from harnessrl.common.tasks import TaskError

    try:
        return _ACTIONS[args.tasks_command](args)
    except TaskError as e:
        print(f"harnessrl tasks: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    from harnessrl.common.tasks import list_suites, list_tasks

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
    from harnessrl.common.tasks import list_suites, list_tasks

    suites = list_suites()
    if args.json:
        print(json.dumps({k: str(v) for k, v in suites.items()}, indent=1))
        return 0
    for name, d in suites.items():
        print(f"{name:<16} {len(list_tasks(name)):>4} tasks  {d}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from harnessrl.common.tasks import resolve_task

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
        ("environment", _env_line(t.environment)),
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


def _env_line(env: Any) -> str:
    if env is None or env.empty:
        return "base (nothing added)"
    alias = "python alias, " if env.python_alias else ""
    return f"{env.name} ({alias}{len(env.pip)} pip packages: {' '.join(env.pip)})"


def _import(args: argparse.Namespace) -> int:
    from harnessrl.common.tasks import import_any

    try:
        rep = import_any(args.source, args.out, split=args.split, force=args.force)
    except OSError as e:
        print(f"harnessrl tasks import: {e}", file=sys.stderr)
        return 2
    for p in rep.written:
        print(p)
    for where, why in rep.skipped:
        print(f"skipped {where}: {why}", file=sys.stderr)
    print(
        f"imported {len(rep.written)} task(s) into {args.out}, skipped {len(rep.skipped)} "
        f"({len(rep.failed)} with errors, {len(rep.not_tasks)} not task folders)",
        file=sys.stderr,
    )
    return 2 if rep.failed else 0


def _lint(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from harnessrl.actors.lint import LintConfig
    from harnessrl.common.aio import run
    from harnessrl.common.tasks import list_suites, resolve_tasks

    given = {"threshold": args.threshold, "mutations": args.mutations}
    given["max_outputs"] = args.max_outputs
    try:
        cfg = LintConfig(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "lint"
        print(f"harnessrl tasks lint: {flag}: {err['msg']}", file=sys.stderr)
        return 2
    targets = args.targets or list(list_suites())
    tasks = [t for spec in targets for t in resolve_tasks(spec)]
    reports = run(_lint_all(tasks, args.jobs, args.sandbox, cfg), subprocesses=True)
    if reports is None:
        return 2
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=1))
    else:
        for r in reports:
            scores = " ".join(f"{p.probe}={p.score:.2f}" for p in r.probes if " " not in p.probe)
            print(f"{'ok  ' if r.ok else 'FAIL'} {r.task}  ({r.duration:.1f} s)  {scores}")
            for p in r.problems:
                print(f"     problem: {p}")
            for w in r.warnings:
                print(f"     warning: {w}")
    bad = sum(not r.ok for r in reports)
    print(f"{len(reports) - bad}/{len(reports)} tasks pass lint", file=sys.stderr)
    return 1 if bad else 0


async def _lint_all(tasks: list, jobs: int, sandbox: str, cfg: LintConfig) -> list | None:
    from harnessrl.actors.lint import backend_factory, lint_tasks
    from harnessrl.actors.sandbox import SandboxError, make_backend

    backend = make_backend(sandbox)
    try:
        await backend.start()
    except SandboxError as e:
        print(f"harnessrl tasks lint: {e}", file=sys.stderr)
        return None
    try:
        return await lint_tasks(tasks, backend_factory(backend, owner="lint"), jobs=jobs, cfg=cfg)
    finally:
        await backend.close()


_ACTIONS = {"list": _list, "suites": _suites, "show": _show, "import": _import, "lint": _lint}
