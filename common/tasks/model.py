"""The `Task` model (what every format loads into) and its content hash.

A task is data: an instruction, a starting workspace, hidden reward files and a way to run them.
Actors run and verify tasks; the learner's feeder lists them and ships ``(suite, task_id,
task_hash)`` in each TaskRequest. Invariants:

* The workspace never contains the hidden reward files; they reach the sandbox only after the
  harness has exited (see ``actors/verifier.py``).
* ``task_hash`` depends only on the content the rollout sees and is scored by (the task's
  definition file, workspace and reward files, and its environment when it has one), never on
  where the folder lies, mtimes or the reference solution: two actors holding the same task
  agree on its hash, and any edit that can change a score changes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

CheckerKind = Literal["test_py", "reward_sh", "harbor", "none"]
"""How the hidden reward files are run:

* ``test_py`` (native, ClawGym JSONL): ``python3 <reward>/<entry> <workspace>`` prints a JSON
  dict of metrics in [0, 1];
* ``reward_sh`` (ClawGym folders): ``bash <reward>/<entry>`` prints one float in [0, 1] as its
  last stdout line; a ``check.py`` beside it prints the named sub-scores;
* ``harbor``: ``bash <reward>/<entry>`` (``tests/test.sh``) writes ``reward.txt`` or
  ``reward.json`` under ``/logs/verifier``;
* ``none``: no code checker (rubric only).
"""

TaskFormat = Literal["native", "clawgym", "harbor"]

DEFAULT_MOUNT = "/workspace"
CLAWGYM_MOUNT = "/root/.openclaw/workspace"
RUBRIC_SCORES = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The only scores a rubric judge may give."""

HASH_SKIP = frozenset({"__pycache__", ".DS_Store", ".pytest_cache", ".git"})
"""Names ignored when hashing a tree (caches and VCS litter, not task content)."""


class TaskError(ValueError):
    """A task or suite cannot be loaded; the message names the file and field at fault."""


# ---------------------------------------------------------------------------------------------
# task environments
# ---------------------------------------------------------------------------------------------

ENV_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_REQ_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REQ_VERSION = r"(?:===|==|!=|~=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
_REQUIREMENT = re.compile(
    rf"^({_REQ_NAME})\s*(?:\[\s*{_REQ_NAME}(?:\s*,\s*{_REQ_NAME})*\s*\])?"
    rf"\s*(?:{_REQ_VERSION}(?:\s*,\s*{_REQ_VERSION})*)?$"
)


def requirement_project(req: str) -> str:
    """The normalised project name of a pip requirement (``Foo_Bar[x]==1`` -> ``foo-bar``);
    raises ValueError for anything but ``name[extras] <version specifiers>``."""
    m = _REQUIREMENT.match(req.strip()) if isinstance(req, str) else None
    if m is None:
        raise ValueError(
            f"{req!r} is not a pip requirement of the form name[extras]==version (URLs, paths, "
            "options and environment markers are not accepted)"
        )
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def pip_requirements(reqs: list[str]) -> list[str]:
    """``reqs`` checked (each a `requirement_project`, no project twice) and stripped; raises
    ValueError naming the bad one."""
    seen: set[str] = set()
    for req in reqs:
        project = requirement_project(req)
        if project in seen:
            raise ValueError(f"{project!r} is required twice")
        seen.add(project)
    return [r.strip() for r in reqs]


def non_negative_weights(weights: dict[str, float]) -> dict[str, float]:
    """Metric weights, refusing a negative one (ValueError naming the metric)."""
    for k, w in weights.items():
        if w < 0:
            raise ValueError(f"weight of metric {k!r} is negative")
    return weights


class TaskEnv(BaseModel):
    """The software a task's prompt and checker assume beyond the sandbox's base userland
    (``python3``, ``sh``, coreutils): a ``python`` command and pip packages.

    Declared by a task (``[environment]`` in task.toml), by its suite (``suite.toml``) or by
    its format (ClawGym tasks use the built-in ``clawgym``; see `harnessrl.common.tasks.environments`).
    The sandbox backend builds it once per content (`key`) into a cache and shows it read-only
    at ``/opt/hrl/env`` inside, first on ``PATH``, for the harness and the checker alike
    (``actors/sandbox/envs.py``). An environment that adds nothing (`empty`) is no build."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = "base"
    """Name, for reports and image tags (the named environment it was made from)."""
    python_alias: bool = False
    """Provide a ``python`` command (the environment's ``python3``)."""
    pip: list[str] = Field(default_factory=list)
    """pip requirements installed into the environment (binary wheels only), one project
    each; pin every package (``name==version``), dependencies included, for builds that do
    not change with the day they were made."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not ENV_NAME_RE.match(v):
            raise ValueError(f"{v!r} must be 1-64 lowercase letters, digits, '_', '.' or '-'")
        return v

    @field_validator("pip")
    @classmethod
    def _pip(cls, v: list[str]) -> list[str]:
        return pip_requirements(v)

    @property
    def empty(self) -> bool:
        """Whether it adds nothing to the base userland (no build, nothing mounted)."""
        return not self.python_alias and not self.pip

    def key(self) -> str:
        """Content hash (16 hex digits) of what gets built: the same for two environments
        that install the same things, whatever their names."""
        blob = json.dumps({"python_alias": self.python_alias, "pip": sorted(self.pip)})
        return hashlib.blake2b(blob.encode(), digest_size=8, person=b"hrl-env-v1").hexdigest()


def hash_with_env(task_hash: str, env: TaskEnv | None) -> str:
    """A task's content hash extended by its environment (which can change its scores); the
    hash itself when the task declares none."""
    if env is None:
        return task_hash
    blob = f"{task_hash}\0{env.name}\0{env.key()}".encode()
    return hashlib.blake2b(blob, digest_size=16, person=b"hrl-task-env-v1").hexdigest()


class Task(BaseModel):
    """One task, whatever format it was loaded from. Paths are on the host."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    id: str
    """Identifier, unique within its suite."""
    suite: str = ""
    """Suite the task was loaded from; empty for a task loaded by path."""
    instruction: str
    """What the harness is asked to do (its first user message)."""
    category: str = ""
    """Free-form category (e.g. ``analysis``, ``systems``); used for reporting."""
    difficulty: str = ""
    """Free-form difficulty level (e.g. ``1``..``3`` for toy, ``easy``/``hard``)."""
    split: str = "train"
    """``train`` or ``eval`` (held-out; never trained on)."""
    format: TaskFormat = "native"
    """Format the task was loaded from."""
    path: Path
    """The task folder."""
    workspace_dir: Path | None = None
    """Host directory copied into the fresh sandbox workspace; ``None`` starts empty."""
    mount: str = DEFAULT_MOUNT
    """Where the workspace appears inside the sandbox (ClawGym: its ``input_mount_dir``)."""
    reward_dir: Path | None = None
    """Host directory of the hidden reward files (checker, rubric data, expected outputs)."""
    checker: CheckerKind = "test_py"
    """How the reward files are run; see `CheckerKind`."""
    checker_entry: str = "test.py"
    """Entry file of the checker, relative to ``reward_dir``."""
    reward_mount: str = ""
    """The absolute path the checker's scripts use for the reward files (ClawGym:
    ``<mount>/reward``); empty: none. The files are always staged in a fresh private directory
    outside the workspace, and this path is rewritten to it in their text."""
    rubric: list[str] = Field(default_factory=list)
    """Rubric rules for the LLM judge (each scored in {0, .25, .5, .75, 1})."""
    agent_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock limit of the harness run."""
    verifier_timeout_s: float = Field(120.0, gt=0)
    """Wall-clock limit of the checker run."""
    metric_weights: dict[str, float] = Field(default_factory=dict)
    """Weight per metric in the code score (weighted mean); metrics not named weigh 1."""
    code_weight: float = Field(0.7, ge=0)
    """Weight of the code score in the hybrid score."""
    rubric_weight: float = Field(0.3, ge=0)
    """Weight of the rubric score in the hybrid score."""
    solution: Path | None = None
    """Reference solution script (``solve.sh`` or ``*.py``), run with the workspace as cwd."""
    task_hash: str = ""
    """Content hash (see `hash_paths`), extended by the environment (`hash_with_env`)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Format-specific extras (toy family parameters, ClawGym grading type, …)."""
    environment: TaskEnv | None = None
    """What the sandbox provides beyond its base userland (a ``python`` command, pip packages);
    None: declared neither by the task, its suite nor its format (the base userland)."""

    @property
    def name(self) -> str:
        """``suite/id`` for a suite task, else the folder path."""
        return f"{self.suite}/{self.id}" if self.suite else str(self.path)

    def summary(self) -> dict[str, Any]:
        """The JSON object ``tasks list --json`` prints for this task."""
        return {
            "suite": self.suite,
            "id": self.id,
            "category": self.category,
            "difficulty": self.difficulty,
            "split": self.split,
            "format": self.format,
            "checker": self.checker,
            "rubric": bool(self.rubric),
            "solution": self.solution is not None,
            "task_hash": self.task_hash,
            "environment": self.environment.name if self.environment else "",
            "path": str(self.path),
        }


# ---------------------------------------------------------------------------------------------
# hashing
# ---------------------------------------------------------------------------------------------


def _walk_files(root: Path) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every file and symlink below ``root``, sorted."""
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in HASH_SKIP)
        for f in filenames:
            if f in HASH_SKIP or f.endswith(".pyc"):
                continue
            p = Path(dirpath) / f
            out.append((p.relative_to(root).as_posix(), p))
    return sorted(out)


def hash_paths(parts: list[tuple[str, Path | None]]) -> str:
    """A stable 128-bit hex digest of labelled files and trees.

    ``parts`` are ``(label, path)``: a file is hashed by content, a directory by every file's
    relative path and content (symlinks by target), a missing path or ``None`` as absent. Labels
    keep ``workspace/a`` and ``reward/a`` apart; lengths are framed, so no two different inputs
    share a byte stream.
    """
    h = hashlib.blake2b(digest_size=16, person=b"hrl-task-v1")

    def frame(tag: bytes, data: bytes) -> None:
        h.update(tag + len(data).to_bytes(8, "little") + data)

    for label, path in parts:
        frame(b"L", label.encode())
        if path is None or not os.path.lexists(path):
            frame(b"-", b"")
            continue
        items = [("", path)] if not path.is_dir() or path.is_symlink() else _walk_files(path)
        for rel, p in items:
            frame(b"P", rel.encode())
            if p.is_symlink():
                frame(b"S", os.readlink(p).encode())
            else:
                frame(b"F", p.read_bytes())
    return h.hexdigest()
