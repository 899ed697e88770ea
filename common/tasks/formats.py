"""Task formats: load a task folder of any supported format into a `Task`, or import others
into native folders.

Folder formats (recognised by their files, in this order):

* **ClawGym folder** — ``data_entry.json`` (``task_id``, ``user_query``, ``metadata{category,
  grading_type, rule}``, ``input_mount_dir``), ``input_files/`` (the workspace), ``reward/``
  (``reward.sh`` printing one float as its last stdout line, usually via ``check.py
  WORKSPACE`` printing a JSON dict). Its scripts use absolute paths under
  ``input_mount_dir`` and expect the reward files at ``<input_mount_dir>/reward``. Its
  environment is the built-in ``clawgym`` (``python``, pytest, pandas, requests, …).
* **Harbor** — ``instruction.md`` + ``tests/test.sh`` (+ ``task.toml``, ``environment/``,
  ``solution/solve.sh``). The workspace is what ``environment/Dockerfile`` COPYs below its
  WORKDIR (RUN steps cannot be replayed without Docker; they are listed in the task's
  metadata). ``test.sh`` writes ``/logs/verifier/reward.txt`` or ``reward.json``.
* **Native** — ``task.toml`` (see `NativeToml`), ``workspace/``, hidden ``reward/`` with
  ``test.py`` printing a JSON dict of metrics in [0, 1], ``solution/solve.sh`` or
  ``solution/solve.py`` (or ``solution.py``).

Record format: **ClawGym JSONL** — one task per line: ``prompt``, ``input_files[{file_path,
content}]`` where files under ``reward/`` are the hidden checker (``reward/test.py``), or the
checker in a field (``test_code``), ``rule``/``rules`` rubric, ``category``. JSONL is imported
into native folders (`import_jsonl`), not loaded in place; the folders it writes declare the
``clawgym`` environment, as do those imported from ClawGym folders.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from harnessrl.common.config import toml_text
from harnessrl.common.tasks.environments import CLAWGYM_ENV, EnvironmentToml, environment_table
from harnessrl.common.tasks.harbor import (
    HARBOR_MOUNT,
    materialise_harbor_workspace,
    parse_dockerfile,
)
from harnessrl.common.tasks.model import (
    CLAWGYM_MOUNT,
    DEFAULT_MOUNT,
    CheckerKind,
    Task,
    TaskError,
    hash_paths,
    hash_with_env,
    non_negative_weights,
)

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")
DEFAULT_ENTRY: dict[str, str] = {
    "test_py": "test.py",
    "reward_sh": "reward.sh",
    "harbor": "test.sh",
    "none": "",
}


# ---------------------------------------------------------------------------------------------
# native task.toml schema
# ---------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TimeoutsToml(_Strict):
    """``[timeouts]``."""

    agent_s: float = Field(600.0, gt=0, le=86400)
    """Wall-clock limit of the harness run, seconds."""
    verifier_s: float = Field(120.0, gt=0, le=3600)
    """Wall-clock limit of the checker, seconds."""


class ScoreToml(_Strict):
    """``[score]``."""

    weights: dict[str, float] = {}
    """Weight per metric (default 1) in the code score."""
    code_weight: float = Field(0.7, ge=0, le=1)
    """Weight of the code score when a rubric judge also scores the task."""
    rubric_weight: float = Field(0.3, ge=0, le=1)
    """Weight of the rubric score."""

    @field_validator("weights")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        return non_negative_weights(v)


class CheckerToml(_Strict):
    """``[checker]``."""

    kind: CheckerKind = "test_py"
    """``test_py`` (default), ``reward_sh``, ``harbor`` or ``none`` (rubric only)."""
    entry: str = ""
    """Entry file in ``reward/`` (default by kind: test.py, reward.sh, test.sh)."""
    reward_mount: str = ""
    """Path the checker's scripts use for the reward files (rewritten to the private dir outside
    the workspace where they are staged); relative: below ``mount``; empty: none."""


class RubricToml(_Strict):
    """``[rubric]``."""

    rules: list[str] = []
    """Rubric rules, each scored by the judge in {0, .25, .5, .75, 1}."""


class NativeToml(_Strict):
    """The native ``task.toml``."""

    id: str
    """Task identifier (letters, digits, ``_.-``)."""
    instruction: str = ""
    """The instruction; empty reads ``instruction.md`` beside task.toml."""
    category: str = ""
    """Free-form category."""
    difficulty: str | int = ""
    """Free-form difficulty."""
    split: str = "train"
    """``train`` or ``eval``."""
    mount: str = DEFAULT_MOUNT
    """Workspace mount point inside the sandbox."""
    timeouts: TimeoutsToml = TimeoutsToml()
    """Timeouts."""
    score: ScoreToml = ScoreToml()
    """Scoring."""
    checker: CheckerToml = CheckerToml()
    """Checker."""
    rubric: RubricToml = RubricToml()
    """Rubric."""
    environment: EnvironmentToml | None = None
    """What the sandbox provides beyond its base userland (a ``python`` command, pip
    packages; see ``harnessrl.common.tasks.environments``); omitted: the suite's, else none."""
    metadata: dict[str, Any] = {}
    """Free-form metadata."""

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError("must be 1-200 letters, digits, '_', '.' or '-'")
        return v

    @field_validator("mount")
    @classmethod
    def _mount(cls, v: str) -> str:
        return _abs_inside(v)


def _abs_inside(v: str) -> str:
    p = PurePosixPath(v)
    if not p.is_absolute() or str(p) == "/" or ".." in p.parts:
        raise ValueError(f"must be an absolute path below / (got {v!r})")
    return str(p)


def _validation_error(err: ValidationError, where: Path) -> TaskError:
    msgs = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        msgs.append(f"{where}: field '{loc}': {msg}")
    return TaskError("\n".join(msgs))


# ---------------------------------------------------------------------------------------------
# detection and loading
# ---------------------------------------------------------------------------------------------


def detect_format(path: Path) -> str:
    """``native``, ``clawgym`` or ``harbor``; raises `TaskError` for anything else."""
    if (path / "data_entry.json").is_file():
        return "clawgym"
    if (path / "instruction.md").is_file() and (path / "tests" / "test.sh").is_file():
        return "harbor"
    if (path / "task.toml").is_file():
        return "native"
    if not path.is_dir():
        raise TaskError(f"{path}: not a directory")
    raise TaskError(
        f"{path}: not a task folder (expected task.toml, data_entry.json, "
        "or instruction.md + tests/test.sh)"
    )


def is_task_dir(path: Path) -> bool:
    try:
        detect_format(path)
    except TaskError:
        return False
    return True


def load_folder(path: Path | str, suite: str = "") -> Task:
    """Load a task folder of any supported format."""
    path = Path(path).resolve()
    fmt = detect_format(path)
    loader = {"native": load_native, "clawgym": load_clawgym, "harbor": load_harbor}[fmt]
    return loader(path, suite)


def _read_toml(p: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{p}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise TaskError(f"{p}: not UTF-8 text: {e}") from None


def _solution(path: Path) -> Path | None:
    for rel in ("solution/solve.sh", "solution/solve.py", "solution.py", "solution.sh"):
        if (path / rel).is_file():
            return path / rel
    return None


def _opt_dir(p: Path) -> Path | None:
    return p if p.is_dir() else None


def load_native(path: Path, suite: str = "") -> Task:
    """Load a native task folder (``task.toml`` + ``workspace/`` + ``reward/``)."""
    toml_path = path / "task.toml"
    try:
        t = NativeToml.model_validate(_read_toml(toml_path))
    except ValidationError as e:
        raise _validation_error(e, toml_path) from None
    instruction = t.instruction
    if not instruction.strip():
        md = path / "instruction.md"
        if not md.is_file():
            raise TaskError(f"{toml_path}: field 'instruction' is missing (and no instruction.md)")
        instruction = md.read_text()
    reward_dir = _opt_dir(path / "reward")
    entry = t.checker.entry or DEFAULT_ENTRY[t.checker.kind]
    if t.checker.kind != "none":
        if reward_dir is None or not (reward_dir / entry).is_file():
            raise TaskError(
                f"{toml_path}: field 'checker.kind' is {t.checker.kind!r} "
                f"but {path / 'reward' / entry} does not exist"
            )
    elif not t.rubric.rules:
        raise TaskError(f"{toml_path}: field 'checker.kind' is 'none' and there is no rubric")
    reward_mount = _reward_mount(t.checker.reward_mount, t.mount, toml_path)
    env = t.environment.resolve() if t.environment is not None else None
    return Task(
        id=t.id,
        suite=suite,
        instruction=instruction,
        category=t.category,
        difficulty=str(t.difficulty),
        split=t.split,
        format="native",
        path=path,
        workspace_dir=_opt_dir(path / "workspace"),
        mount=t.mount,
        reward_dir=reward_dir,
        checker=t.checker.kind,
        checker_entry=entry,
        reward_mount=reward_mount,
        rubric=t.rubric.rules,
        agent_timeout_s=t.timeouts.agent_s,
        verifier_timeout_s=t.timeouts.verifier_s,
        metric_weights=t.score.weights,
        code_weight=t.score.code_weight,
        rubric_weight=t.score.rubric_weight,
        solution=_solution(path),
        task_hash=hash_with_env(
            hash_paths(
                [
                    ("task.toml", toml_path),
                    ("instruction.md", path / "instruction.md" if not t.instruction else None),
                    ("workspace", path / "workspace"),
                    ("reward", path / "reward"),
                ]
            ),
            env,
        ),
        metadata=t.metadata,
        environment=env,
    )


def _reward_mount(value: str, mount: str, where: Path) -> str:
    """Absolute reward mount; a relative one is taken relative to the workspace mount."""
    if not value:
        return ""
    full = value if value.startswith("/") else f"{mount}/{value}"
    try:
        return _abs_inside(full)
    except ValueError as e:
        raise TaskError(f"{where}: field 'checker.reward_mount': {e}") from None


def _rubric_rules(value: Any, where: str) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return [x for x in value if x.strip()]
    raise TaskError(f"{where}: must be a string or a list of strings")


def load_clawgym(path: Path, suite: str = "") -> Task:
    """Load a ClawGym task folder (``data_entry.json``, ``input_files/``, ``reward/``)."""
    entry_path = path / "data_entry.json"
    try:
        entry = json.loads(entry_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TaskError(f"{entry_path}: not valid JSON: {e}") from None
    if not isinstance(entry, dict):
        raise TaskError(f"{entry_path}: must hold a JSON object")
    query = entry.get("user_query")
    if not isinstance(query, str) or not query.strip():
        raise TaskError(f"{entry_path}: field 'user_query' is missing or not a string")
    task_id = str(entry.get("task_id") or path.name)
    if not _ID_RE.match(task_id):
        raise TaskError(f"{entry_path}: field 'task_id' {task_id!r} is not a valid id")
    meta = entry.get("metadata") or {}
    if not isinstance(meta, dict):
        raise TaskError(f"{entry_path}: field 'metadata' must be an object")
    mount = entry.get("input_mount_dir") or CLAWGYM_MOUNT
    try:
        mount = _abs_inside(str(mount))
    except ValueError as e:
        raise TaskError(f"{entry_path}: field 'input_mount_dir': {e}") from None
    rules = _rubric_rules(
        meta.get("rule", entry.get("rule", entry.get("rules"))), f"{entry_path}: field 'rule'"
    )
    reward_dir = _opt_dir(path / "reward")
    kind: CheckerKind
    if reward_dir is not None and (reward_dir / "reward.sh").is_file():
        kind, checker_entry = "reward_sh", "reward.sh"
    elif reward_dir is not None and (reward_dir / "test.py").is_file():
        kind, checker_entry = "test_py", "test.py"
    elif reward_dir is not None and (reward_dir / "check.py").is_file():
        kind, checker_entry = "test_py", "check.py"
    elif rules:
        kind, checker_entry = "none", ""
    else:
        raise TaskError(f"{path}: no reward/reward.sh, reward/check.py or rubric rule")
    return Task(
        id=task_id,
        suite=suite,
        instruction=query,
        category=str(meta.get("category", "")),
        split=str(entry.get("split", "train")),
        format="clawgym",
        path=path,
        workspace_dir=_opt_dir(path / "input_files"),
        mount=mount,
        reward_dir=reward_dir,
        checker=kind,
        checker_entry=checker_entry,
        reward_mount=f"{mount}/reward",
        rubric=rules,
        solution=_solution(path),
        task_hash=hash_with_env(
            hash_paths(
                [
                    ("data_entry.json", entry_path),
                    ("workspace", path / "input_files"),
                    ("reward", path / "reward"),
                ]
            ),
            CLAWGYM_ENV,
        ),
        metadata={"grading_type": str(meta.get("grading_type", ""))},
        environment=CLAWGYM_ENV,
    )


def _num(value: Any, default: float, where: str) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise TaskError(f"{where}: must be a positive number (got {value!r})")
    return float(value)


def load_harbor(path: Path, suite: str = "") -> Task:
    """Load a Harbor task (``instruction.md``, ``tests/test.sh``, ``task.toml``)."""
    toml_path = path / "task.toml"
    cfg = _read_toml(toml_path) if toml_path.is_file() else {}
    meta = cfg.get("metadata") or {}
    for section in ("metadata", "verifier", "agent"):
        if not isinstance(cfg.get(section, {}), dict):
            raise TaskError(f"{toml_path}: field '{section}' must be a table")
    verifier_s = _num(
        cfg.get("verifier", {}).get("timeout_sec"),
        120.0,
        f"{toml_path}: field 'verifier.timeout_sec'",
    )
    agent_s = _num(
        cfg.get("agent", {}).get("timeout_sec"), 600.0, f"{toml_path}: field 'agent.timeout_sec'"
    )
    env_dir = path / "environment"
    mount, workspace, ignored = HARBOR_MOUNT, None, []
    if (env_dir / "Dockerfile").is_file():
        mount, copies, ignored = parse_dockerfile(env_dir / "Dockerfile")
        workspace = materialise_harbor_workspace(env_dir, mount, copies)
    task_id = path.name if _ID_RE.match(path.name) else re.sub(r"[^A-Za-z0-9_.-]", "_", path.name)
    return Task(
        id=task_id,
        suite=suite,
        instruction=(path / "instruction.md").read_text(),
        category=str(meta.get("category", "")),
        difficulty=str(meta.get("difficulty", "")),
        format="harbor",
        path=path,
        workspace_dir=workspace,
        mount=mount,
        reward_dir=path / "tests",
        checker="harbor",
        checker_entry="test.sh",
        agent_timeout_s=agent_s,
        verifier_timeout_s=verifier_s,
        solution=_solution(path),
        task_hash=hash_paths(
            [
                ("task.toml", toml_path),
                ("instruction.md", path / "instruction.md"),
                ("environment", env_dir),
                ("tests", path / "tests"),
            ]
        ),
        metadata={"harbor_ignored": ignored} if ignored else {},
    )


# ---------------------------------------------------------------------------------------------
# import: anything -> native folders
# ---------------------------------------------------------------------------------------------


def native_toml_text(task: Task) -> str:
    """The native ``task.toml`` that describes ``task`` (its files laid out natively); a None
    metadata value is left out (``harnessrl.common.config.toml_text``'s rule)."""
    meta = dict(task.metadata)
    if task.format != "native":
        meta.setdefault("imported_from", task.format)
    doc = {
        "id": task.id,
        "category": task.category,
        "difficulty": task.difficulty,
        "split": task.split,
        "mount": task.mount,
        "instruction": task.instruction,
        "timeouts": {"agent_s": task.agent_timeout_s, "verifier_s": task.verifier_timeout_s},
        "score": {
            "weights": task.metric_weights,
            "code_weight": task.code_weight,
            "rubric_weight": task.rubric_weight,
        },
        "checker": {
            "kind": task.checker,
            "entry": task.checker_entry,
            "reward_mount": task.reward_mount,
        },
        "rubric": {"rules": task.rubric},
        "environment": environment_table(task.environment) if task.environment else None,
        "metadata": meta,
    }
    return toml_text(doc, multiline_strings=True)


def write_native(task: Task, out: Path) -> Path:
    """Write ``task`` as a native folder ``out`` (created; must not exist)."""
    out.mkdir(parents=True, exist_ok=False)
    if task.workspace_dir is not None:
        shutil.copytree(task.workspace_dir, out / "workspace", symlinks=True)
    if task.reward_dir is not None:
        shutil.copytree(task.reward_dir, out / "reward", symlinks=True)
    if task.solution is not None:
        if task.solution.parent.name == "solution":
            shutil.copytree(task.solution.parent, out / "solution", symlinks=True)
        else:
            (out / "solution").mkdir()
            shutil.copy2(task.solution, out / "solution" / f"solve{task.solution.suffix}")
    (out / "task.toml").write_text(native_toml_text(task))
    load_native(out)  # what we wrote must load
    return out


def _safe_rel(file_path: Any, where: str) -> PurePosixPath:
    if not isinstance(file_path, str) or not file_path.strip():
        raise TaskError(f"{where}: 'file_path' must be a non-empty string")
    p = PurePosixPath(file_path.strip())
    if p.is_absolute():
        # ClawGym records sometimes name files by their absolute path under the mount
        try:
            p = p.relative_to(CLAWGYM_MOUNT)
        except ValueError:
            raise TaskError(f"{where}: 'file_path' {file_path!r} is absolute") from None
    if ".." in p.parts or str(p) in ("", "."):
        raise TaskError(f"{where}: 'file_path' {file_path!r} leaves the workspace")
    return p


def _record_id(rec: dict[str, Any], lineno: int) -> str:
    for key in ("task_id", "id"):
        if isinstance(rec.get(key), str) and _ID_RE.match(rec[key]):
            return rec[key]
    for line in str(rec.get("origin_template") or "").splitlines():
        if line.strip().startswith("id:"):
            cand = line.split(":", 1)[1].strip()
            if _ID_RE.match(cand):
                return cand
    return f"task_{lineno:05d}"


CHECKER_FIELDS = ("test_code", "test_py", "checker", "reward_code")
"""Record fields that may carry the checker source (written as ``reward/test.py``)."""


def _hook_entry(hook: str, where: str) -> str:
    """The reward file a record's ``hook_code`` runs, when the hook is the one way harnessrl
    runs a record's checker: ``python3 reward/<file>.py [<workspace>]``; raises `TaskError`."""
    try:
        argv = shlex.split(hook.strip())
    except ValueError:
        argv = []
    ws_args = ([], [CLAWGYM_MOUNT], [CLAWGYM_MOUNT + "/"], ["."], ["./"])
    if len(argv) >= 2 and argv[0] in ("python", "python3") and argv[2:] in ws_args:
        script = argv[1].removeprefix(CLAWGYM_MOUNT + "/").removeprefix("./")
        name = script.removeprefix("reward/")
        if name != script and re.fullmatch(r"[\w.-]+\.py", name):
            return name
    raise TaskError(
        f"{where}: field 'hook_code' {hook.strip()[:200]!r} is not supported: a record's checker "
        "runs as `python3 reward/<file>.py <workspace>` and printing a JSON dict of metrics; "
        "another hook cannot be carried, so the task is not imported"
    )


def record_to_native(
    rec: Any, out_root: Path, where: str, lineno: int, split: str | None = None
) -> Path:
    """Write one ClawGym JSONL record as a native task folder under ``out_root``.

    A ``hook_code`` that runs one of the record's reward files the way harnessrl runs a
    checker makes that file the checker (and is kept in the metadata); any other hook is
    refused (`TaskError`)."""
    if not isinstance(rec, dict):
        raise TaskError(f"{where}: a record must be a JSON object")
    prompt = rec.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskError(f"{where}: field 'prompt' is missing or not a string")
    files = rec.get("input_files") or []
    if not isinstance(files, list):
        raise TaskError(f"{where}: field 'input_files' must be a list")
    hook = rec.get("hook_code")
    if hook is not None and not isinstance(hook, str):
        raise TaskError(f"{where}: field 'hook_code' must be a string")
    hook_entry = _hook_entry(hook, where) if hook and hook.strip() else ""
    task_id = _record_id(rec, lineno)
    rules = _rubric_rules(rec.get("rules", rec.get("rule")), f"{where}: field 'rules'")
    out = out_root / task_id
    if out.exists():
        raise TaskError(f"{where}: {out} already exists (duplicate task id {task_id!r}?)")
    staged = Path(tempfile.mkdtemp(prefix=f".{task_id}-", dir=out_root))
    try:
        has_checker = False
        for i, f in enumerate(files):
            fw = f"{where}: input_files[{i}]"
            if not isinstance(f, dict) or not isinstance(f.get("content", ""), str):
                raise TaskError(f"{fw}: must be an object with string 'file_path' and 'content'")
            rel = _safe_rel(f.get("file_path"), fw)
            top = "reward" if rel.parts[0] == "reward" and len(rel.parts) > 1 else "workspace"
            sub = PurePosixPath(*rel.parts[1:]) if top == "reward" else rel
            has_checker |= top == "reward" and str(sub) in ("test.py", "check.py")
            target = staged / top / sub
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(f.get("content", ""))
        for key in CHECKER_FIELDS:
            if isinstance(rec.get(key), str) and rec[key].strip():
                (staged / "reward").mkdir(exist_ok=True)
                (staged / "reward" / "test.py").write_text(rec[key])
                has_checker = True
                break
        reward = staged / "reward"
        entry = "test.py" if (reward / "test.py").is_file() else "check.py"
        if not has_checker and not rules and not (reward / hook_entry).is_file():
            raise TaskError(f"{where}: no checker (reward/test.py) and no rubric 'rules'")
        if hook_entry:
            if not (reward / hook_entry).is_file():
                raise TaskError(
                    f"{where}: field 'hook_code' runs reward/{hook_entry}, "
                    "which the record does not ship"
                )
            entry, has_checker = hook_entry, True
        meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
        category = rec.get("category") or meta.get("category") or ""
        extra: dict[str, Any] = {"imported_from": "clawgym-jsonl"}
        if hook_entry:
            extra["hook_code"] = hook.strip()
        task = Task(
            id=task_id,
            instruction=prompt,
            category=str(category),
            split=split or "train",
            path=staged,
            mount=CLAWGYM_MOUNT,
            checker="test_py" if has_checker else "none",
            checker_entry=entry if has_checker else "",
            reward_mount=f"{CLAWGYM_MOUNT}/reward" if has_checker else "",
            rubric=rules,
            metadata=extra,
            environment=CLAWGYM_ENV,
        )
        (staged / "task.toml").write_text(native_toml_text(task))
        load_native(staged)
        os.rename(staged, out)
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)
    return out


@dataclass
class ImportReport:
    """What `import_any` did."""

    out: Path
    """The ``--out`` directory."""
    written: list[Path] = field(default_factory=list)
    """Native task folders written (under ``out``)."""
    failed: list[tuple[str, str]] = field(default_factory=list)
    """``(source, why)`` of each task that could not be imported (``FILE:LINE`` or folder)."""
    not_tasks: list[tuple[str, str]] = field(default_factory=list)
    """``(folder, why)`` of each folder of the source that is no task folder."""

    @property
    def skipped(self) -> list[tuple[str, str]]:
        return self.failed + self.not_tasks


def _check_out(src: Path, out_root: Path, force: bool) -> None:
    src_r, out_r = src.resolve(), out_root.resolve()
    if out_r == src_r or out_r in src_r.parents:
        raise TaskError(f"--out {out_root}: must not be the source {src} or a folder holding it")
    if out_root.exists() and not out_root.is_dir():
        raise TaskError(f"--out {out_root}: exists and is not a directory")
    if out_root.is_dir() and any(out_root.iterdir()) and not force:
        raise TaskError(
            f"--out {out_root}: is not empty; use --force to replace what it holds "
            "(or choose another directory)"
        )


def _check_split(split: str | None) -> None:
    if split is not None and not _ID_RE.match(split):
        raise TaskError(f"--split {split!r}: must be a name such as 'train' or 'eval'")


def _duplicates(ids: list[tuple[str, str]], what: str) -> None:
    """Raise one `TaskError` naming every id that ``(id, source)`` pairs hold more than once."""
    by_id: dict[str, list[str]] = {}
    for task_id, source in ids:
        by_id.setdefault(task_id, []).append(source)
    dups = {k: v for k, v in by_id.items() if len(v) > 1}
    if dups:
        lines = [f"  {k}: {', '.join(v)}" for k, v in sorted(dups.items())]
        raise TaskError(
            f"duplicate task ids among the {what} (nothing was imported):\n" + "\n".join(lines)
        )


def _publish(staging: Path, out_root: Path) -> None:
    """Move the finished ``staging`` dir into place as ``out_root`` (replacing what is there)."""
    if out_root.exists():
        shutil.rmtree(out_root)
    os.rename(staging, out_root)


def _staged(out_root: Path) -> Path:
    out_root.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_root.name}.import-", dir=out_root.parent))


def import_jsonl(
    src: Path, out_root: Path, *, split: str | None = None, force: bool = False
) -> ImportReport:
    """Import every record of a ClawGym JSONL file as native folders under ``out_root``.

    A bad record is reported in `ImportReport.failed` and the rest imported; duplicate task
    ids, an ``out_root`` that is not empty (without ``force``, which replaces it) or a bad
    ``split`` raise `TaskError` before anything is written. The folders appear in
    ``out_root`` together, once all are written."""
    _check_split(split)
    _check_out(src, out_root, force)
    records: list[tuple[str, int, Any]] = []
    rep = ImportReport(out_root)
    try:
        with src.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{src}:{lineno}"
                try:
                    records.append((where, lineno, json.loads(line)))
                except json.JSONDecodeError as e:
                    rep.failed.append((where, f"not valid JSON: {e}"))
    except UnicodeDecodeError as e:
        raise TaskError(f"{src}: not UTF-8 text: {e}") from None
    _duplicates(
        [(_record_id(r, n), w) for w, n, r in records if isinstance(r, dict)], f"records of {src}"
    )
    return _write_staged(
        src,
        rep,
        [
            (where, lambda st, w=where, n=lineno, r=rec: record_to_native(r, st, w, n, split))
            for where, lineno, rec in records
        ],
    )


def _write_staged(
    src: Path, rep: ImportReport, writes: list[tuple[str, Callable[[Path], Path]]]
) -> ImportReport:
    """Run each ``(where, write(staging) -> task folder)`` into a staging folder, record the
    failures (a TaskError, or a file a task cannot hold) and publish the staging folder as
    ``rep.out`` at the end; nothing is published when no task could be written."""
    staging = _staged(rep.out)
    try:
        written = []
        for where, write in writes:
            try:
                written.append(write(staging).name)
            except (ValueError, OSError) as e:
                rep.failed.append((where, str(e).removeprefix(f"{where}: ")))
        if not written:
            raise TaskError(f"{src}: no task could be imported" + _reasons(rep))
        _publish(staging, rep.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    rep.written = [rep.out / name for name in written]
    return rep


def _reasons(rep: ImportReport) -> str:
    return "".join(f"\n  {where}: {why}" for where, why in rep.skipped)


def import_any(
    src: Path, out_root: Path, *, split: str | None = None, force: bool = False
) -> ImportReport:
    """Import a JSONL file, a task folder, or a folder of task folders into ``out_root``.

    A folder that does not load is reported in `ImportReport.failed`, one that is no task
    folder in `ImportReport.not_tasks` (hidden entries and plain files are passed over), and
    the rest imported. Raises `TaskError` before writing anything for duplicate task ids, an
    ``out_root`` that is not empty (without ``force``, which replaces it), a bad ``split``,
    a bad ``suite.toml`` or a source with no task to import. ``split`` overrides each task's
    split; a task without an environment of its own gets the source suite's (``suite.toml``),
    written into its task.toml."""
    src = Path(src)
    if src.is_file():
        return import_jsonl(src, out_root, split=split, force=force)
    if not src.is_dir():
        raise TaskError(f"{src}: no such file or directory")
    _check_split(split)
    _check_out(src, out_root, force)
    rep = ImportReport(out_root)
    if is_task_dir(src):
        folders = [src]
    else:
        folders = []
        for p in sorted(src.iterdir()):
            if p.name.startswith(".") or not p.is_dir():
                continue
            if is_task_dir(p):
                folders.append(p)
            else:
                rep.not_tasks.append((str(p), _not_task_reason(p)))
    from harnessrl.common.tasks.registry import suite_environment  # registry imports this module

    suite_env = suite_environment(src) if folders != [src] else None
    tasks: list[Task] = []
    for f in folders:  # all load before anything is written
        try:
            t = load_folder(f)
        except (ValueError, OSError) as e:
            rep.failed.append((str(f), str(e)))
            continue
        if t.environment is None and suite_env is not None:  # written into its task.toml
            t = t.model_copy(update={"environment": suite_env})
        tasks.append(t.model_copy(update={"split": split}) if split else t)
    _duplicates([(t.id, str(t.path)) for t in tasks], f"task folders of {src}")
    if not tasks:
        raise TaskError(f"{src}: holds no task folder that can be imported" + _reasons(rep))
    return _write_staged(
        src, rep, [(str(t.path), lambda st, t=t: _write_task(t, st / t.id)) for t in tasks]
    )


def _write_task(t: Task, folder: Path) -> Path:
    """`write_native`, leaving no half-written folder behind when it fails."""
    try:
        return write_native(t, folder)
    except (ValueError, OSError):
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _not_task_reason(path: Path) -> str:
    try:
        detect_format(path)
    except TaskError as e:
        return str(e).removeprefix(f"{path}: ")
    return "not a task folder"
