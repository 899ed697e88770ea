"""The `Task` model (what every format loads into) and its content hash.

A task is data: an instruction, a starting workspace, hidden reward files and a way to run them.
Actors run and verify tasks; the learner's feeder lists them and ships ``(suite, task_id,
task_hash)`` in each TaskRequest. Invariants:

* The workspace never contains the hidden reward files; they reach the sandbox only after the
  harness has exited (see ``actors/verifier.py``).
* ``task_hash`` depends only on the content the rollout sees and is scored by (the task's
  definition file, workspace and reward files), never on where the folder lies, mtimes or the
  reference solution: two actors holding the same task agree on its hash, and any edit that can
  change a score changes it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
    """Content hash (see `hash_paths`)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Format-specific extras (toy family parameters, ClawGym grading type, …)."""

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
