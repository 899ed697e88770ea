"""Suites: named folders of task folders.

A suite is a directory whose subdirectories are task folders (any format; names starting with
``_`` or ``.`` are skipped). Suites are found by name in, first, the built-in suites shipped
under ``common/tasks/suites/`` and then every directory listed in ``$HRL_SUITE_PATH``
(``:``-separated, each holding suites as subdirectories); a path to a suite directory works
wherever a suite name does, and a path to a task folder wherever a task is named.

A suite may hold a ``suite.toml`` (`SuiteToml`) beside its task folders: its
``[environment]`` table is the environment of every task that declares none of its own (see
``harnessrl.common.tasks.environments``; it applies to a task loaded by path too, when the folder above
it holds the file).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from harnessrl.common.tasks.environments import EnvironmentToml
from harnessrl.common.tasks.formats import _read_toml, _validation_error, is_task_dir, load_folder
from harnessrl.common.tasks.model import Task, TaskEnv, TaskError, hash_with_env

BUILTIN_SUITES = Path(__file__).resolve().parent / "suites"
SUITE_PATH_ENV = "HRL_SUITE_PATH"
SUITE_TOML = "suite.toml"


class SuiteToml(BaseModel):
    """A suite's ``suite.toml``: defaults for the suite's tasks."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    environment: EnvironmentToml | None = None
    """Environment of each task of the suite that declares none itself (by its own
    ``[environment]`` or by its format)."""


def suite_environment(suite_dir: Path) -> TaskEnv | None:
    """The environment ``suite_dir/suite.toml`` declares; None without one. Raises
    `TaskError` naming the field of a bad file."""
    path = suite_dir / SUITE_TOML
    if not path.is_file():
        return None
    try:
        cfg = SuiteToml.model_validate(_read_toml(path))
    except ValidationError as e:
        raise _validation_error(e, path) from None
    return cfg.environment.resolve() if cfg.environment is not None else None


def _with_suite_env(task: Task, env: TaskEnv | None) -> Task:
    if env is None or task.environment is not None:
        return task
    return task.model_copy(
        update={"environment": env, "task_hash": hash_with_env(task.task_hash, env)}
    )


def suite_roots() -> list[Path]:
    """Directories holding suites: the built-ins, then ``$HRL_SUITE_PATH`` entries."""
    extra = [Path(p) for p in os.environ.get(SUITE_PATH_ENV, "").split(":") if p]
    return [BUILTIN_SUITES, *extra]


def list_suites() -> dict[str, Path]:
    """Suite name → directory (earlier roots win on name clashes)."""
    out: dict[str, Path] = {}
    for root in suite_roots():
        if not root.is_dir():
            continue
        for d in sorted(root.iterdir()):
            if d.is_dir() and not d.name.startswith(("_", ".")) and d.name not in out:
                out[d.name] = d
    return out


def _looks_like_path(name: str) -> bool:
    return "/" in name or name.startswith(".") or os.sep in name


def suite_dir(suite: str) -> Path:
    """The directory of a suite given by name or path; `TaskError` names what was tried."""
    suites = list_suites()
    if suite in suites:
        return suites[suite]
    p = Path(suite).expanduser()
    if p.is_dir():
        return p.resolve()
    known = ", ".join(suites) or "none"
    raise TaskError(f"unknown suite {suite!r} (known: {known}; or give a directory path)")


def _suite_name(suite: str, d: Path) -> str:
    return suite if suite in list_suites() else d.name


def _task_folders(d: Path) -> list[Path]:
    return [
        p
        for p in sorted(d.iterdir())
        if p.is_dir() and not p.name.startswith(("_", ".")) and is_task_dir(p)
    ]


def list_tasks(suite: str, *, split: str | None = None) -> list[Task]:
    """Every task of a suite (name or directory), sorted by id; ``split`` filters."""
    d = suite_dir(suite)
    name = _suite_name(suite, d)
    env = suite_environment(d)
    tasks = [_with_suite_env(load_folder(p, suite=name), env) for p in _task_folders(d)]
    seen: dict[str, Path] = {}
    for t in tasks:
        if t.id in seen:
            raise TaskError(f"suite {name!r}: task id {t.id!r} used by {seen[t.id]} and {t.path}")
        seen[t.id] = t.path
    tasks.sort(key=lambda t: t.id)
    return [t for t in tasks if split is None or t.split == split]


def load_task_path(path: Path | str, suite: str = "") -> Task:
    """A task folder of any format, loaded in place."""
    p = Path(path).expanduser()
    if not p.exists():
        raise TaskError(f"{p}: no such task folder")
    task = load_folder(p, suite=suite)
    return _with_suite_env(task, suite_environment(task.path.parent))


def load_task(suite: str, task_id: str) -> Task:
    """Task ``task_id`` of ``suite``; a ``task_id`` that is a folder path loads that folder."""
    if _looks_like_path(task_id) and Path(task_id).expanduser().is_dir():
        return load_task_path(task_id)
    d = suite_dir(suite)
    name = _suite_name(suite, d)
    direct = d / task_id
    if direct.is_dir() and is_task_dir(direct):
        task = load_folder(direct, suite=name)
        if task.id == task_id:
            return _with_suite_env(task, suite_environment(d))
    for task in list_tasks(suite):
        if task.id == task_id:
            return task
    raise TaskError(f"suite {name!r} ({d}) has no task {task_id!r}")


def resolve_tasks(spec: str) -> list[Task]:
    """Tasks named by ``SUITE``, ``SUITE/ID``, a task folder path or a suite directory path."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if is_task_dir(p):
            return [load_task_path(p)]
        return list_tasks(str(p))
    if spec in list_suites():
        return list_tasks(spec)
    suite, sep, task_id = spec.rpartition("/")
    if sep and suite and task_id:
        return [load_task(suite, task_id)]
    raise TaskError(f"{spec!r} is neither a suite, SUITE/ID, nor a task or suite folder")


def resolve_task(spec: str) -> Task:
    """Exactly one task named by ``SUITE/ID`` or a task folder path."""
    tasks = resolve_tasks(spec)
    if len(tasks) != 1:
        raise TaskError(f"{spec!r} names {len(tasks)} tasks, not one (use SUITE/ID or a path)")
    return tasks[0]
