"""Checker lint: can a task's checker tell a failing workspace from a solved one?

A checker that gives credit to a workspace where nothing useful was done rewards doing nothing.
Lint runs the task's own checker (through `verify`, each time in a fresh real sandbox) on
*probes*: workspaces that must fail. None of them needs a reference solution:

* ``untouched`` — the starting workspace as it is (an agent that did nothing);
* ``empty`` — every output file created empty;
* ``wrong_type`` — plain text where structured data (JSON, YAML, TOML) is expected, a JSON
  object in every other output;
* ``truncated`` — every output cut off mid-write;
* ``empty_value`` — every structured output holding an empty list ``[]`` (only when the task
  has structured outputs);
* ``decoy`` — ``empty`` (``untouched`` when no output is known) plus a copy of the checker's
  own files in the workspace under ``reward/`` (only when the checker's source lists
  directories): the verdict must not change.

With a reference solution, also: the solved workspace (must score 1.0 on every metric), and
for each file the solution wrote or the checker names, that file deleted, emptied or truncated
(every metric must drop below 1 under at least one of these).

Output names come from file-like tokens of the prompt (``save the summary as report.md``) and
string literals of the checker's source (``.py`` parsed with ``ast``, shell scripts tokenised),
minus the task's input files and the checker's own files, plus the files the reference
solution creates.

Rules; each problem is ``{rule, metric, probe, detail}``:

* ``passes_failing_probe`` — one of the first five probes scores at least the threshold
  (0.25 by default): one problem per metric that gave it credit;
* ``crash_on_inputs`` — the checker crashes (or gives no verdict) on the untouched workspace;
* ``reads_verifier_files`` — the ``decoy`` verdict differs from its base probe's;
* ``solution_fails`` / ``solution_below_1`` / ``never_flips`` / ``no_candidates`` — the
  reference solution does not run, does not score 1.0, a metric stays 1 under every
  mutation, or there is nothing to mutate.

A checker that crashes on any other probe is not a problem: a crash scores 0. A task may
declare metrics that reward a failing attempt on purpose (reward shaping, like the toy suites'
``written``) in ``[metadata.lint] shaping = [...]``: the threshold rule scores probes without
them and only warns.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from harnessrl.actors.sandbox.base import Sandbox, SandboxError, SandboxSpec
from harnessrl.actors.verifier import (
    CheckerError,
    VerifyResult,
    run_solution,
    verify,
    weighted_score,
)
from harnessrl.common.config import HrlModel
from harnessrl.common.tasks.model import Task

SandboxFactory = Callable[[Task, Path | None], Awaitable[Sandbox]]
"""Makes a fresh sandbox for ``task`` whose workspace starts as a copy of the given host dir
(``None``: empty), mounted at ``task.mount``. The caller destroys it."""


def backend_factory(backend: Any, **spec_kwargs: Any) -> SandboxFactory:
    """A `SandboxFactory` over a `SandboxBackend` (e.g. ``BwrapBackend``); each sandbox has
    its task's environment (``spec_kwargs`` may override it, ``environment=None``: none)."""

    async def make(task: Task, workspace: Path | None) -> Sandbox:
        kw = {"environment": task.environment, **spec_kwargs}
        spec = SandboxSpec(workspace_src=workspace, workdir=task.mount, **kw)
        return await backend.create(spec)

    return make


class LintConfig(HrlModel):
    """How strict `lint_task` is."""

    threshold: float = Field(0.25, gt=0.0, le=1.0)
    """A failing probe (untouched, empty, wrong_type, truncated, empty_value) scoring at least
    this is a problem."""
    max_outputs: int = Field(24, ge=1, le=1000)
    """At most this many inferred output files per task (prompt names first)."""
    mutations: bool = True
    """Also run the reference solution and mutate its outputs, when the task has one."""


THRESHOLD_PROBES = ("untouched", "empty", "wrong_type", "truncated", "empty_value")
"""The probes the score threshold applies to (every output of theirs is wrong)."""

# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------


@dataclass
class Problem:
    """One reason a task fails lint."""

    rule: str
    metric: str
    """The metric at fault; empty when the rule is about the whole checker."""
    probe: str
    """The probe that shows it (``untouched``, ``empty``, ``delete out.txt``, …)."""
    detail: str

    def __str__(self) -> str:
        where = f" {self.metric!r}" if self.metric else ""
        return f"[{self.rule}]{where} on {self.probe}: {self.detail}"


@dataclass
class ProbeResult:
    """The checker's verdict on one probe workspace."""

    probe: str
    score: float
    """The reward (0 when the checker crashed or gave no verdict)."""
    passed: list[str] = field(default_factory=list)
    """Metrics that gave the probe credit (value above 0)."""
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    """The checker's crash or verifier error, when there was one."""


@dataclass
class LintReport:
    """What `lint_task` found."""

    task: str
    problems: list[Problem] = field(default_factory=list)
    """Failures: the task does not pass lint when this is non-empty."""
    warnings: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    """The output files the probes wrote (inferred; see the module docstring)."""
    probes: list[ProbeResult] = field(default_factory=list)
    solution_metrics: dict[str, float] = field(default_factory=dict)
    flips: dict[str, list[str]] = field(default_factory=dict)
    """Metric → the mutations (``delete out.txt``…) under which it dropped below 1."""
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def score(self, probe: str) -> float | None:
        """The score of ``probe``; None when it did not run."""
        return next((p.score for p in self.probes if p.probe == probe), None)

    @property
    def untouched_reward(self) -> float | None:
        return self.score("untouched")

    @property
    def mutations(self) -> int:
        """How many reference-solution mutations ran (probes named ``HOW FILE``)."""
        return sum(" " in p.probe and p.probe.split(" ", 1)[0] in MUTATIONS for p in self.probes)

    def add(self, rule: str, probe: str, detail: str, metric: str = "") -> None:
        self.problems.append(Problem(rule, metric, probe, detail))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {
            "task": self.task,
            "ok": self.ok,
            "problems": d.pop("problems"),
            "scores": {p.probe: p.score for p in self.probes},
            **{k: v for k, v in d.items() if k != "task"},
        }


# ---------------------------------------------------------------------------------------------
# output names
# ---------------------------------------------------------------------------------------------

_EXTENSIONS = """txt text md markdown rst csv tsv json jsonl ndjson yaml yml toml ini cfg conf env
    properties py sh bash zsh js mjs cjs ts tsx jsx html htm css scss xml log sql ipynb tex ics
    vcf svg png jpg jpeg gif pdf xlsx xls docx pptx zip tar gz tgz r rb go rs java kt c h cc cpp
    hpp cs php pl lua swift diff patch lock mk dockerfile out dat bak eml srt vtt"""
FILE_EXTENSIONS = frozenset(_EXTENSIONS.split())
"""Extensions that make a prompt token a file name (others need the checker to name it too)."""

STRUCTURED = frozenset({"json", "jsonl", "ndjson", "yaml", "yml", "toml", "ipynb"})
"""Extensions of structured outputs (the wrong type for them is plain text)."""

_SPLIT = re.compile(r"[\s`'\"()\[\]{}<>,;|=]+")
_FILE = re.compile(r"(?:[\w.-]+/)*[\w-][\w.-]*\.([A-Za-z][A-Za-z0-9]{0,9})")
_SHELL_VAR = re.compile(r"^\$\{?\w+\}?/")
_LISTS_DIRS = re.compile(r"\b(glob|rglob|walk|listdir|scandir|iterdir)\b|\bfind\s|\bls\s")


def _file_tokens(text: str, mount: str) -> list[tuple[str, bool]]:
    """``(relative path, known extension)`` of every file-like token in ``text``."""
    out = []
    for raw in _SPLIT.split(text):
        tok = _SHELL_VAR.sub("", raw.rstrip(".:!?*").lstrip("*"))
        if "://" in tok or "$" in tok or tok.startswith("www."):
            continue
        if tok.startswith(mount.rstrip("/") + "/"):
            tok = tok[len(mount.rstrip("/")) + 1 :]
        elif tok.startswith("/"):  # "/out.md" is the tail of f"{ws}/out.md"; "/etc/x.txt" is not
            if tok.count("/") > 1:
                continue
            tok = tok[1:]
        while tok.startswith("./"):
            tok = tok[2:]
        m = _FILE.fullmatch(tok)
        if m is None or ".." in tok.split("/") or tok.startswith(("e.g", "i.e")):
            continue
        out.append((tok, m.group(1).lower() in FILE_EXTENSIONS))
    return out


def _checker_strings(reward_dir: Path | None) -> list[str]:
    """String literals of the checker's ``.py`` files, and its shell scripts' text."""
    out: list[str] = []
    for p in sorted(_files(reward_dir).values()):
        if p.suffix not in (".py", ".sh", "") or p.stat().st_size > 1_000_000:
            continue
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if p.suffix != ".py":
            out.append(text)
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            out.append(text)
            continue
        consts = [n for n in ast.walk(tree) if isinstance(n, ast.Constant)]
        consts.sort(key=lambda n: (n.lineno, n.col_offset))  # source order
        out += [n.value for n in consts if isinstance(n.value, str)]
    return out


def infer_outputs(task: Task, extra: Sequence[str] = ()) -> list[str]:
    """Output files of ``task``: named in its prompt or its checker, not inputs, plus ``extra``.

    A prompt token counts when its extension is a common file extension (or the checker names
    it too); a checker literal counts when its extension is; the checker's own files (``reward/``
    and the names of the files beside it) never count.
    """
    inputs = set(_files(task.workspace_dir))
    in_base = {r.rsplit("/", 1)[-1] for r in inputs}
    reward_names = {r.rsplit("/", 1)[-1] for r in _files(task.reward_dir)}
    prompt = _file_tokens(task.instruction, task.mount)
    checker = [t for s in _checker_strings(task.reward_dir) for t in _file_tokens(s, task.mount)]
    named_by_checker = {t for t, _ in checker}
    in_prompt = {t for t, _ in prompt}
    out: list[str] = []
    for tok, known in [*prompt, *checker]:
        from_prompt = tok in in_prompt
        if not known and not (from_prompt and tok in named_by_checker):
            continue
        if tok in inputs or ("/" not in tok and tok in in_base) or tok.startswith("reward/"):
            continue
        if not from_prompt and tok.rsplit("/", 1)[-1] in reward_names:
            continue
        if tok not in out:
            out.append(tok)
    out += [r for r in extra if r not in out and r not in inputs]
    return out


# ---------------------------------------------------------------------------------------------
# probe workspaces
# ---------------------------------------------------------------------------------------------


def _files(root: Path | None) -> dict[str, Path]:
    if root is None or not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts
    }


def _text_of(d: Path | None) -> str:
    out = []
    for p in _files(d).values():
        with contextlib.suppress(UnicodeDecodeError, OSError):
            out.append(p.read_text())
    return "\n".join(out)


def _structured(rel: str) -> bool:
    return rel.rsplit(".", 1)[-1].lower() in STRUCTURED


def _content(probe: str, rel: str) -> bytes:
    """What output ``rel`` holds in ``probe``."""
    s = _structured(rel)
    if probe == "wrong_type":
        return b"This is plain text, not the expected data.\n" if s else b'{"lint": "wrong type"}\n'
    if probe == "truncated":
        return b'{"items": [{"na' if s else b"Lorem ipsum dolor sit am"
    if probe == "empty_value":
        return b"[]\n" if s else b""
    return b""


def _build(
    base: Path | None, dst: Path, writes: dict[str, bytes | None], tree: tuple[Path, str] | None
) -> None:
    """``dst`` := a copy of ``base`` with ``writes`` applied (None deletes) and ``tree`` copied
    in at a relative path."""
    if base is not None and base.is_dir():
        shutil.copytree(base, dst, symlinks=True)
    else:
        dst.mkdir(parents=True)
    for rel, data in writes.items():
        target = dst / rel
        if data is None:
            target.unlink(missing_ok=True)
            continue
        with contextlib.suppress(OSError):  # a name that clashes with a directory: skip it
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():
                target.unlink()
            target.write_bytes(data)
    if tree is not None:
        shutil.copytree(tree[0], dst / tree[1], symlinks=True, dirs_exist_ok=True)


MUTATIONS = ("delete", "empty", "truncate")


def _mutation(solved: Path, rel: str, how: str) -> bytes | None | bool:
    """The new content of ``rel`` (None: deleted); False when the mutation changes nothing."""
    data = (solved / rel).read_bytes()
    if how == "delete":
        return None
    if how == "empty":
        return b"" if data else False
    return data[: len(data) // 2] if len(data) >= 2 else False


def lint_candidates(task: Task, solved: Path) -> list[str]:
    """Files (relative) the solution wrote or changed, or that the checker's source names."""
    before = _files(task.workspace_dir)
    source = _text_of(task.reward_dir)
    out = []
    for rel, p in sorted(_files(solved).items()):
        changed = rel not in before or before[rel].read_bytes() != p.read_bytes()
        base = rel.rsplit("/", 1)[-1]
        named = rel in source or (len(base) >= 3 and base in source)
        if changed or named:
            out.append(rel)
    return out


# ---------------------------------------------------------------------------------------------
# running probes
# ---------------------------------------------------------------------------------------------


def _gist(error: str) -> str:
    """The first line of a crash report and its first exception line."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    exc = next((ln for ln in lines[1:] if _EXC_LINE.match(ln)), "")
    return " ".join(x for x in (lines[0] if lines else "", exc) if x)[:400]


_EXC_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b")


def _crash_of(res: VerifyResult) -> str:
    """Why ``res`` holds no real verdict of the checker ("" when it does)."""
    if res.status != "ok":
        return res.error or res.status
    return getattr(res, "checker_error", None) or ""


class _Runner:
    def __init__(self, task: Task, factory: SandboxFactory, sem: asyncio.Semaphore, tmp: Path):
        self.task, self.factory, self.sem, self.tmp = task, factory, sem, tmp
        self.n = 0

    async def verify_in(self, workspace: Path | None) -> VerifyResult:
        async with self.sem:
            sb = await self.factory(self.task, workspace)
            try:
                return await verify(self.task, sb)
            finally:
                await sb.destroy()

    async def probe(
        self,
        name: str,
        base: Path | None,
        writes: dict[str, bytes | None],
        tree: tuple[Path, str] | None = None,
    ) -> ProbeResult:
        if not writes and tree is None:
            res = await self.verify_in(base)
        else:
            self.n += 1
            dst = self.tmp / f"p{self.n}"
            await asyncio.to_thread(_build, base, dst, writes, tree)
            try:
                res = await self.verify_in(dst)
            finally:
                await asyncio.to_thread(shutil.rmtree, dst, True)
        err = _crash_of(res)
        metrics = dict(res.metrics) if res.status == "ok" else {}
        score = res.reward if res.status == "ok" else 0.0
        return ProbeResult(name, score, [k for k, v in metrics.items() if v > 0], metrics, err)


async def lint_task(
    task: Task,
    sandbox_factory: SandboxFactory,
    *,
    jobs: int = 4,
    cfg: LintConfig | None = None,
    sem: asyncio.Semaphore | None = None,
) -> LintReport:
    """Check that the task's checker can tell failure from success (see module docstring).

    At most ``jobs`` sandboxes run at once (``sem``, when given, is shared across tasks)."""
    cfg = cfg or LintConfig()
    t0 = time.monotonic()
    rep = LintReport(task=task.name)
    if task.checker == "none":
        rep.warnings.append("no code checker (rubric only): nothing to lint")
        return rep
    with tempfile.TemporaryDirectory(prefix="hrl-lint-") as tmp:
        run = _Runner(task, sandbox_factory, sem or asyncio.Semaphore(max(1, jobs)), Path(tmp))
        solved = Path(tmp) / "solved"
        made: list[str] = []
        if cfg.mutations and task.solution is not None:
            if await _solve(run, solved, rep):
                before = _files(task.workspace_dir)
                made = [r for r in _files(solved) if r not in before]
        elif task.solution is None:
            rep.warnings.append("no reference solution: metric flips not checked")
        rep.outputs = infer_outputs(task, made)[: cfg.max_outputs]
        if not rep.outputs:
            rep.warnings.append("no output file named by the prompt or the checker")
        work = [_synthetic(run, rep, cfg)]
        if rep.solution_metrics:
            work.append(_lint_mutations(run, solved, rep))
        await asyncio.gather(*work)
    rep.probes.sort(key=_probe_order)
    rep.problems.sort(key=lambda p: (p.rule, p.metric, _probe_order(p)))
    rep.duration = time.monotonic() - t0
    return rep


def _probe_order(p: ProbeResult | Problem) -> tuple[int, str]:
    order = (*THRESHOLD_PROBES, "decoy", "solution")
    return (order.index(p.probe) if p.probe in order else len(order), p.probe)


async def _solve(run: _Runner, solved: Path, rep: LintReport) -> bool:
    """Run the reference solution; its metrics go to ``rep`` when it scores 1.0."""
    task = run.task
    async with run.sem:
        sb = await run.factory(task, task.workspace_dir)
        try:
            try:
                await run_solution(task, sb)
            except CheckerError as e:
                rep.add("solution_fails", "solution", str(e))
                return False
            sol = await verify(task, sb)
            await sb.copy_out(solved)
        finally:
            await sb.destroy()
    err = _crash_of(sol)
    passed = [k for k, v in sol.metrics.items() if v > 0]
    rep.probes.append(ProbeResult("solution", sol.reward, passed, dict(sol.metrics), err))
    if err:
        rep.add("solution_fails", "solution", f"checker fails on the reference solution: {err}")
        return False
    below = {k: v for k, v in sol.metrics.items() if v < 1.0}
    if below or sol.reward < 1.0:
        detail = f"reference solution scores {sol.reward:.3f} (metrics below 1: {below})"
        rep.add("solution_below_1", "solution", detail)
        return False
    rep.solution_metrics = dict(sol.metrics)
    return True


async def _synthetic(run: _Runner, rep: LintReport, cfg: LintConfig) -> None:
    task, outs = run.task, rep.outputs
    names = ["empty", "wrong_type", "truncated"] if outs else []
    if any(_structured(r) for r in outs):
        names.append("empty_value")
    jobs = [run.probe("untouched", task.workspace_dir, {})]
    jobs += [run.probe(n, task.workspace_dir, {r: _content(n, r) for r in outs}) for n in names]
    base = "empty" if outs else "untouched"
    if task.reward_dir is not None and _LISTS_DIRS.search(_text_of(task.reward_dir)):
        taken = task.workspace_dir is not None and (task.workspace_dir / "reward").exists()
        tree = (task.reward_dir, "reward_files" if taken else "reward")
        writes = {r: _content(base, r) for r in outs}
        jobs.append(run.probe("decoy", task.workspace_dir, writes, tree))
    got = {p.probe: p for p in await asyncio.gather(*jobs)}
    rep.probes += got.values()
    untouched = got["untouched"]
    if untouched.error:
        rep.add(
            "crash_on_inputs",
            "untouched",
            f"checker crashes on the untouched workspace: {_gist(untouched.error)}",
        )
    _threshold_rule(task, rep, [got[n] for n in THRESHOLD_PROBES if n in got], cfg.threshold)
    if "decoy" in got:
        b, d = got[base], got["decoy"]
        if (d.score, d.metrics, bool(d.error)) != (b.score, b.metrics, bool(b.error)):
            new = [m for m in d.passed if m not in b.passed]
            rep.add(
                "reads_verifier_files",
                "decoy",
                f"the verdict on {base} changes ({b.score:.2f} -> {d.score:.2f}) when a copy of "
                "the checker's own files lies in the workspace: the checker reads them",
                ", ".join(new),
            )


def shaping_metrics(task: Task) -> set[str]:
    """Metrics the task declares as reward shaping (``[metadata.lint] shaping = [...]``)."""
    lint = task.metadata.get("lint")
    names = lint.get("shaping") if isinstance(lint, dict) else None
    return {str(n) for n in names} if isinstance(names, list) else set()


def _threshold_rule(
    task: Task, rep: LintReport, probes: list[ProbeResult], threshold: float
) -> None:
    """One ``passes_failing_probe`` problem per metric that lifts a probe to ``threshold``."""
    shaping = shaping_metrics(task)
    flagged: dict[str, list[tuple[ProbeResult, float]]] = {}
    shaped: dict[str, list[str]] = {}
    for p in probes:
        score = p.score
        if shaping & set(p.metrics) and set(p.metrics) - shaping:
            rest = {k: v for k, v in p.metrics.items() if k not in shaping}
            score = weighted_score(rest, task.metric_weights)
            for m in sorted(shaping & set(p.passed)):
                shaped.setdefault(m, []).append(p.probe)
        if score < threshold:
            continue
        passed = [m for m in p.passed if m not in shaping]
        for m in passed or [""]:
            flagged.setdefault(m, []).append((p, score))
    for m, ps in flagged.items():
        where = ", ".join(f"{p.probe} {score:.2f}" for p, score in ps)
        what = "passes" if m else "the checker gives credit"
        detail = f"{what} on failing workspaces scoring at least {threshold:g}: {where}"
        rep.add("passes_failing_probe", ps[0][0].probe, detail, m)
    for m, names in shaped.items():
        rep.warnings.append(f"shaping metric {m!r} gives credit on {', '.join(names)}")


async def _lint_mutations(run: _Runner, solved: Path, rep: LintReport) -> None:
    metrics = list(rep.solution_metrics)
    rep.flips = {m: [] for m in metrics}
    cands = lint_candidates(run.task, solved)
    if not cands:
        rep.add(
            "no_candidates",
            "solution",
            "the reference solution changes no file and the checker names none",
        )
        return

    async def one(rel: str, how: str) -> None:
        data = await asyncio.to_thread(_mutation, solved, rel, how)
        if data is False:
            return
        assert not isinstance(data, bool)
        p = await run.probe(f"{how} {rel}", solved, {rel: data})
        rep.probes.append(p)
        for m in metrics:
            if p.error or p.metrics.get(m, 0.0) < 1.0:
                rep.flips[m].append(p.probe)

    await asyncio.gather(*(one(rel, how) for rel in cands for how in MUTATIONS))
    for m in metrics:
        if not rep.flips[m]:
            rep.add(
                "never_flips",
                "solution mutations",
                f"metric {m!r} never drops below 1 when any of {', '.join(cands)} is "
                "deleted, emptied or truncated (it passes on a failing workspace)",
                m,
            )


async def lint_tasks(
    tasks: list[Task],
    sandbox_factory: SandboxFactory,
    *,
    jobs: int = 4,
    cfg: LintConfig | None = None,
) -> list[LintReport]:
    """`lint_task` over ``tasks``, at most ``jobs`` sandboxes at once across all of them.

    A sandbox failure fails that task's lint (rule ``sandbox_error``), not the whole run."""
    sem = asyncio.Semaphore(max(1, jobs))
    staged = asyncio.Semaphore(max(2, 2 * jobs))  # bounds the probe folders on disk at once

    async def one(t: Task) -> LintReport:
        async with staged:
            try:
                return await lint_task(t, sandbox_factory, cfg=cfg, sem=sem)
            except SandboxError as e:
                rep = LintReport(task=t.name)
                rep.add("sandbox_error", "", str(e))
                return rep

    return list(await asyncio.gather(*(one(t) for t in tasks)))
