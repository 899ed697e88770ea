"""Verifier: score a finished workspace with the task's hidden checker (and a rubric judge).

Contract: ``await verify(task, sandbox, judge=None) -> VerifyResult``. Call it only after the
harness has exited; the sandbox is the rollout's own, holding the final workspace.

Where the hidden reward files go. The sandbox contract's ``copy_in`` can only write inside the
workspace, where a checker that lists the workspace would see them. So the verifier ships them
through ``Sandbox.run`` instead: one sandboxed ``sh`` script (`_STAGE`) reads a tar of the
reward files on stdin, unpacks it into a fresh private directory
``/tmp/hrl-reward-<random>`` (the sandbox's own /tmp, outside the workspace; the name is drawn
now, so nothing the harness left behind can be waiting there), runs the checker with the
workspace as cwd, and marks where each step's output ends with a per-run nonce. Tasks
whose checkers expect their files at a fixed place (ClawGym: ``<input_mount_dir>/reward``)
get them there instead, after whatever the harness left at that path is removed. Either way
the files exist in the sandbox only from the verifier's run on, and every process of the
harness is dead by then (a `Sandbox.run` never outlives its command).

Invariants:

* A checker that crashes, times out, prints no parseable metrics, or reports a value that is
  not a number in [0, 1] gives ``status="verifier_error"`` with a message saying which —
  never a reward of 0 that looks like a real score.
* ``reward`` = weighted mean of the checker's metrics (the code score); with a rubric judge
  and rubric rules, ``code_weight·code + rubric_weight·rubric`` (0.7/0.3 by default),
  renormalised over the sides that produced a number (a failed judge call falls back to
  code alone and is reported in ``judge_error``; a rubric-only task needs the judge).
* The checker runs with a fresh ``$HOME``, no user site-packages and isolated from anything
  the harness can have planted on Python's path.
* A failure of the sandbox itself raises `SandboxError` (the rollout is a ``sandbox_error``).

Checker lint (`lint_task`): start from the reference solution's final workspace; for every
file the solution wrote or the checker's source names, delete it, empty it and truncate it,
each in a fresh sandbox; every metric must drop below 1 under at least one of these, the
reference solution must score 1.0 and the untouched workspace below 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import re
import secrets
import shlex
import shutil
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from actors.sandbox.base import Sandbox, SandboxSpec
from common.config import HrlModel
from common.tasks.model import RUBRIC_SCORES, Task

STAGE_SLACK_S = 10.0
"""Seconds added to the checker's timeout for unpacking the reward files."""


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------


@dataclass
class VerifyResult:
    """The verifier's verdict on one final workspace."""

    status: Literal["ok", "verifier_error"]
    reward: float = 0.0
    """Score in [0, 1]; meaningful only when ``status == "ok"``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The checker's metrics (plus ``rubric`` when a judge scored the task)."""
    error: str = ""
    """Why the verification failed (``verifier_error``)."""
    duration: float = 0.0
    """Seconds spent verifying."""
    code_score: float | None = None
    """Weighted mean of the checker's metrics; None without a code checker."""
    rubric_score: float | None = None
    """Mean of the judge's per-rule scores; None when no judge scored."""
    judge_error: str = ""
    """Why the judge gave no score (the reward then uses the code score alone)."""
    output: str = ""
    """Tail of the checker's stderr, for debugging."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CheckerError(Exception):
    """The checker ran but its verdict is unusable; the message says why."""


# ---------------------------------------------------------------------------------------------
# the in-sandbox driver
# ---------------------------------------------------------------------------------------------

# Runs as ``sh -c _STAGE+steps hrl-verify DIR WORKSPACE NONCE`` inside the sandbox with the tar
# of the files on stdin. Each step's stdout is followed by a line "@@NONCE <exit status>"; the
# nonce is fresh per run, so no step output can fake a boundary by accident.
_STAGE = """\
d="$1"; ws="$2"; m="$3"
rm -rf -- "$d" && mkdir -p -- "$d" && tar -xf - -C "$d" || {
  echo "hrl-verifier: cannot stage files in $d" >&2; exit 97; }
HOME=$(mktemp -d) || exit 97
export HOME PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 HRL_WORKSPACE="$ws" HRL_REWARD_DIR="$d"
cd -- "$ws" || exit 97
"""

# Harbor scripts use fixed absolute paths; staged elsewhere, they are rewritten to follow.
_HARBOR_PATHS = ("/logs/verifier", "/tests", "/solution")


def _harbor_rewrite(text: str, stage_dir: str) -> str:
    for p in _HARBOR_PATHS:
        to = f"{stage_dir}/logs/verifier" if p == "/logs/verifier" else stage_dir
        text = re.sub(rf"(?<![\w./-]){re.escape(p)}(?![\w.-])", to, text)
    return text


def _tar_dir(src: Path, rewrite: Callable[[str], str] | None = None) -> bytes:
    """A tar of ``src``'s contents (text files passed through ``rewrite``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for p in sorted(src.rglob("*")):
            if "__pycache__" in p.parts or p.suffix == ".pyc":
                continue
            rel = p.relative_to(src).as_posix()
            if p.is_symlink() or not p.is_file():
                if p.is_dir() and not p.is_symlink():
                    tf.add(p, rel, recursive=False)
                continue
            data = p.read_bytes()
            if rewrite is not None:
                with contextlib.suppress(UnicodeDecodeError):
                    data = rewrite(data.decode()).encode()
            info = tf.gettarinfo(p, rel)
            info.size, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0, "", ""
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass
class _DriverResult:
    steps: list[tuple[int, str]]
    """(exit status, stdout) per step that finished."""
    stderr: str
    timed_out: bool
    error: str = ""


async def _drive(
    sandbox: Sandbox, files: bytes, stage_dir: str, steps: list[str], timeout: float
) -> _DriverResult:
    """Unpack ``files`` into ``stage_dir`` inside ``sandbox``, then run the shell ``steps``
    (which may use ``$d``: the stage dir, ``$ws``: the workspace) with the workspace as cwd."""
    nonce = secrets.token_hex(8)
    script = _STAGE + "".join(
        f'{st} </dev/null; printf "\\n@@%s %d\\n" "$m" "$?"\n' for st in steps
    )
    res = await sandbox.run(
        ["sh", "-c", script, "hrl-verify", stage_dir, sandbox.workdir, nonce],
        stdin=files,
        timeout=timeout + STAGE_SLACK_S,
    )
    stderr = res.stderr.decode(errors="replace")
    if res.timed_out:
        return _DriverResult([], stderr, True)
    if res.returncode == 97 and "hrl-verifier:" in stderr:
        return _DriverResult([], stderr, False, stderr.strip().splitlines()[-1])
    parts = re.split(rb"\n@@" + nonce.encode() + rb" (\d+)\n", res.stdout)
    done = [
        (int(parts[i + 1]), parts[i].decode(errors="replace")) for i in range(0, len(parts) - 1, 2)
    ]
    if len(done) < len(steps):
        why = "its output exceeded the cap" if res.stdout_truncated else f"exit {res.returncode}"
        return _DriverResult(
            done, stderr, False, f"verifier steps did not finish ({why}): {_tail(stderr)}"
        )
    return _DriverResult(done, stderr, False)


def _private_dir(kind: str) -> str:
    return f"/tmp/hrl-{kind}-{secrets.token_hex(8)}"


def _reward_stage_dir(task: Task, sandbox: Sandbox) -> str:
    """Where the reward files go inside ``sandbox`` (a fixed mount follows the workspace)."""
    if not task.reward_mount:
        return _private_dir("reward")
    if task.reward_mount == task.mount or task.reward_mount.startswith(task.mount + "/"):
        return sandbox.workdir + task.reward_mount[len(task.mount) :]
    return task.reward_mount


# ---------------------------------------------------------------------------------------------
# parsing checker output
# ---------------------------------------------------------------------------------------------


def _check_value(name: str, v: Any) -> float:
    if isinstance(v, bool):
        return float(v)
    if not isinstance(v, int | float):
        raise CheckerError(f"metric {name!r} is not a number: {v!r}")
    x = float(v)
    if not math.isfinite(x) or not 0.0 <= x <= 1.0:
        raise CheckerError(f"metric {name!r} = {v!r} is outside [0, 1]")
    return x


def parse_metrics(text: str) -> dict[str, float]:
    """The checker's JSON dict of metrics (whole output, else its last non-empty line)."""
    text = text.strip()
    if not text:
        raise CheckerError("checker printed nothing (expected a JSON dict of metrics)")
    candidates = [text]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1:
        candidates.append(lines[-1])
    for c in candidates:
        try:
            data = json.loads(c)
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict):
            raise CheckerError(
                f"checker printed {type(data).__name__}, not a JSON dict: {c[:200]!r}"
            )
        if not data:
            raise CheckerError("checker printed an empty dict (no metrics)")
        return {str(k): _check_value(str(k), v) for k, v in data.items()}
    raise CheckerError(f"checker output is not a JSON dict of metrics: {text[-300:]!r}")


def parse_scalar(text: str, what: str) -> float:
    """The last non-empty line of ``text`` as a number in [0, 1]."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise CheckerError(f"{what} printed nothing (expected a number in [0, 1])")
    try:
        x = float(lines[-1])
    except ValueError:
        raise CheckerError(f"{what}: last line is not a number: {lines[-1][:200]!r}") from None
    return _check_value(what, x)


def weighted_score(metrics: dict[str, float], weights: dict[str, float]) -> float:
    """Weighted mean of ``metrics`` (a metric not in ``weights`` weighs 1)."""
    total = sum(weights.get(k, 1.0) for k in metrics)
    if total <= 0:
        return sum(metrics.values()) / len(metrics)
    return sum(v * weights.get(k, 1.0) for k, v in metrics.items()) / total


def _tail(s: str, n: int = 800) -> str:
    s = s.strip()
    return s if len(s) <= n else "…" + s[-n:]


def _crash(rc: int, stderr: str, what: str) -> CheckerError:
    return CheckerError(f"{what} exited with status {rc}: {_tail(stderr, 600)}")


# ---------------------------------------------------------------------------------------------
# running the checker
# ---------------------------------------------------------------------------------------------


def _checker_steps(task: Task) -> list[str]:
    entry = '"$d"/' + shlex.quote(task.checker_entry)
    if task.checker == "test_py":
        return [f'python3 {entry} "$ws"']
    if task.checker == "reward_sh":
        steps = [f"bash {entry}"]
        if task.reward_dir is not None and (task.reward_dir / "check.py").is_file():
            steps.append('python3 "$d/check.py" "$ws" 2>/dev/null')
        return steps
    if task.checker == "harbor":
        return [
            f'mkdir -p "$d/logs/verifier" && bash {entry} >&2',
            'cat "$d/logs/verifier/reward.json" 2>/dev/null',
            'cat "$d/logs/verifier/reward.txt" 2>/dev/null',
        ]
    raise CheckerError(f"task {task.name} has no code checker")


async def run_checker(task: Task, sandbox: Sandbox) -> tuple[float, dict[str, float], str]:
    """``(code_score, metrics, stderr_tail)`` of the task's checker; raises `CheckerError`."""
    if task.reward_dir is None:
        raise CheckerError(f"task {task.name} has no reward directory")
    steps = _checker_steps(task)
    d = _reward_stage_dir(task, sandbox)
    rewrite = (lambda t: _harbor_rewrite(t, d)) if task.checker == "harbor" else None
    files = await asyncio.to_thread(_tar_dir, task.reward_dir, rewrite)
    r = await _drive(sandbox, files, d, steps, task.verifier_timeout_s)
    if r.timed_out:
        raise CheckerError(f"checker timed out after {task.verifier_timeout_s:g} s")
    if r.error:
        raise CheckerError(r.error)
    (rc, out), err_tail = r.steps[0], _tail(r.stderr)
    if task.checker == "harbor":
        return _harbor_verdict(task, r.steps, r.stderr)
    try:
        if task.checker == "test_py":
            metrics = parse_metrics(out)
            return weighted_score(metrics, task.metric_weights), metrics, err_tail
        score = parse_scalar(out, task.checker_entry)
    except CheckerError:
        if rc != 0:  # a crash explains the garbage better than the garbage does
            raise _crash(rc, r.stderr, task.checker_entry) from None
        raise
    metrics = {"reward": score}
    if len(r.steps) > 1 and r.steps[1][0] == 0:
        with contextlib.suppress(CheckerError):  # check.py's sub-scores are informative only
            metrics = parse_metrics(r.steps[1][1])
    return score, metrics, err_tail


def _harbor_verdict(
    task: Task, steps: list[tuple[int, str]], stderr: str
) -> tuple[float, dict[str, float], str]:
    (rc, _), (json_rc, json_text), (txt_rc, txt) = steps
    if json_rc == 0:
        try:
            data = json.loads(json_text)
        except json.JSONDecodeError:
            raise CheckerError("test.sh wrote a reward.json that is not JSON") from None
        if isinstance(data, int | float) and not isinstance(data, bool):
            metrics = {"reward": _check_value("reward", data)}
        else:
            metrics = parse_metrics(json.dumps(data))
        return weighted_score(metrics, task.metric_weights), metrics, _tail(stderr)
    if txt_rc == 0:
        score = parse_scalar(txt, "reward.txt")
        return score, {"reward": score}, _tail(stderr)
    raise CheckerError(
        f"test.sh wrote neither reward.txt nor reward.json (exit {rc}): {_tail(stderr, 600)}"
    )


async def run_solution(task: Task, sandbox: Sandbox, timeout: float | None = None) -> str:
    """Run the task's reference solution in ``sandbox`` (cwd = workspace).

    Returns its stderr tail; raises `CheckerError` when it fails, times out or is missing.
    """
    if task.solution is None:
        raise CheckerError(f"task {task.name} has no reference solution")
    d = _private_dir("solution")
    if task.solution.parent.name == "solution":
        rewrite = (lambda t: _harbor_rewrite(t, d)) if task.format == "harbor" else None
        files = await asyncio.to_thread(_tar_dir, task.solution.parent, rewrite)
    else:
        files = await asyncio.to_thread(_tar_file, task.solution)
    run = "bash" if task.solution.suffix == ".sh" else "python3"
    step = f'{run} "$d"/{shlex.quote(task.solution.name)} >&2'
    limit = timeout or task.agent_timeout_s
    r = await _drive(sandbox, files, d, [step], limit)
    if r.timed_out:
        raise CheckerError(f"reference solution timed out after {limit:g} s")
    if r.error:
        raise CheckerError(r.error)
    if r.steps[0][0] != 0:
        raise _crash(r.steps[0][0], r.stderr, f"reference solution {task.solution.name}")
    return _tail(r.stderr)


def _tar_file(p: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(p, p.name)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# rubric judge (an OpenAI-compatible chat endpoint)
# ---------------------------------------------------------------------------------------------


class JudgeConfig(HrlModel):
    """An LLM judge that scores rubric rules through an OpenAI-compatible chat API."""

    url: str
    """Base URL of the API, e.g. ``http://127.0.0.1:30000/v1`` (``/chat/completions`` is added)."""
    model: str = "judge"
    """Model name sent in the request."""
    api_key: str = ""
    """Bearer token; empty sends none."""
    timeout_s: float = Field(120.0, gt=0, le=3600)
    """Per-request timeout."""
    retries: int = Field(2, ge=0, le=10)
    """Extra attempts after a connection error or HTTP 5xx."""
    retry_backoff_s: float = Field(1.0, ge=0, le=60)
    """Wait before the first retry; doubles on each further one."""
    max_workspace_chars: int = Field(40_000, ge=1000, le=2_000_000)
    """Workspace text shown to the judge (files beyond are listed by name only)."""
    max_tokens: int = Field(512, ge=16, le=32768)
    """Reply length limit."""


class JudgeError(Exception):
    """The judge gave no usable score."""


JUDGE_SYSTEM = (
    "You are a strict grader. You score an AI agent's finished work against rubric rules. "
    "For each rule give exactly one score from {0, 0.25, 0.5, 0.75, 1} (1 = fully satisfied, "
    "0 = not at all). Reply with only a JSON object: "
    '{"scores": [one number per rule, in order], "reason": "one short sentence"}.'
)


def workspace_text(root: Path, limit: int) -> str:
    """The workspace's text files as markdown sections, at most ``limit`` characters."""
    parts, used, skipped = [], 0, []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.is_symlink():
            continue
        rel = p.relative_to(root).as_posix()
        try:
            text = p.read_bytes()[: limit + 1].decode()
        except UnicodeDecodeError:
            skipped.append(f"{rel} (binary)")
            continue
        block = f"### {rel}\n```\n{text}\n```\n"
        if used + len(block) > limit:
            skipped.append(rel)
            continue
        parts.append(block)
        used += len(block)
    if skipped:
        parts.append("Not shown: " + ", ".join(skipped) + "\n")
    return "".join(parts) or "(the workspace is empty)\n"


def parse_judge_reply(text: str, n_rules: int) -> float:
    """Mean of the per-rule scores in the judge's JSON reply; raises `JudgeError`."""
    found: dict[str, Any] | None = None
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = dec.raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and ("scores" in obj or "score" in obj):
            found = obj
    if found is None:
        raise JudgeError(f"judge reply has no JSON scores: {text[:200]!r}")
    scores = found.get("scores", [found.get("score")])
    if not isinstance(scores, list) or len(scores) != n_rules:
        raise JudgeError(f"judge gave {scores!r}, expected {n_rules} score(s)")
    out = []
    for s in scores:
        if isinstance(s, str):
            with contextlib.suppress(ValueError):
                s = float(s)
        if isinstance(s, bool) or not isinstance(s, int | float):
            raise JudgeError(f"judge score {s!r} is not a number")
        if not any(abs(float(s) - a) < 1e-6 for a in RUBRIC_SCORES):
            raise JudgeError(f"judge score {s!r} is not one of {RUBRIC_SCORES}")
        out.append(float(s))
    return sum(out) / len(out)


class RubricJudge:
    """Scores a task's rubric rules on a workspace copy; one chat request per verification."""

    def __init__(self, cfg: JudgeConfig, session: Any = None) -> None:
        self.cfg = cfg
        self._session = session
        self._own_session = session is None

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def messages(self, task: Task, workspace: Path) -> list[dict[str, str]]:
        rules = "\n".join(f"{i}. {r}" for i, r in enumerate(task.rubric, 1))
        user = (
            f"## Task given to the agent\n{task.instruction.strip()}\n\n## Rubric rules\n{rules}"
            f"\n\n## Final workspace files\n{workspace_text(workspace, self.cfg.max_workspace_chars)}"
        )
        return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]

    async def score(self, task: Task, workspace: Path) -> float:
        """The rubric score in [0, 1]; raises `JudgeError`."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {
            "model": self.cfg.model,
            "messages": self.messages(task, workspace),
            "temperature": 0.0,
            "max_tokens": self.cfg.max_tokens,
        }
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        url = self.cfg.url.rstrip("/") + "/chat/completions"
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
            try:
                timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
                async with self._session.post(
                    url, json=body, headers=headers, timeout=timeout
                ) as resp:
                    if resp.status >= 500:
                        last = f"judge HTTP {resp.status}"
                        continue
                    if resp.status != 200:
                        raise JudgeError(f"judge HTTP {resp.status}: {(await resp.text())[:200]}")
                    data = await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError) as e:
                last = f"judge request failed: {e!r}"
                continue
            try:
                content = data["choices"][0]["message"]["content"] or ""
            except (KeyError, IndexError, TypeError):
                raise JudgeError(
                    f"judge reply is not a chat completion: {str(data)[:200]}"
                ) from None
            return parse_judge_reply(content, len(task.rubric))
        raise JudgeError(last)


# ---------------------------------------------------------------------------------------------
# verify
# ---------------------------------------------------------------------------------------------


def combine(
    code: float | None, rubric: float | None, code_weight: float, rubric_weight: float
) -> float | None:
    """``code_weight·code + rubric_weight·rubric`` over the sides that are not None."""
    sides = [(v, w) for v, w in ((code, code_weight), (rubric, rubric_weight)) if v is not None]
    if not sides:
        return None
    total = sum(w for _, w in sides)
    if total <= 0:
        return sum(v for v, _ in sides) / len(sides)
    return sum(v * w for v, w in sides) / total


async def verify(task: Task, sandbox: Sandbox, judge: RubricJudge | None = None) -> VerifyResult:
    """Score the final workspace in ``sandbox``; see the module docstring for the rules."""
    t0 = time.monotonic()
    use_judge = judge is not None and bool(task.rubric)
    if task.checker == "none" and not use_judge:
        why = f"task {task.name} has only a rubric and no rubric judge is configured"
        return VerifyResult("verifier_error", error=why)
    with tempfile.TemporaryDirectory(prefix="hrl-judge-") as tmp:
        judged = None
        if use_judge:
            assert judge is not None
            # the judge sees the workspace as the harness left it, before any reward file lands
            await sandbox.copy_out(Path(tmp) / "ws")
            judged = asyncio.create_task(judge.score(task, Path(tmp) / "ws"))
        try:
            res = await _score(task, sandbox, judged)
        finally:
            if judged is not None and not judged.done():
                judged.cancel()
                with contextlib.suppress(BaseException):
                    await judged
    res.duration = time.monotonic() - t0
    return res


async def _score(task: Task, sandbox: Sandbox, judged: asyncio.Task | None) -> VerifyResult:
    res = VerifyResult(status="ok")
    if task.checker != "none":
        try:
            res.code_score, res.metrics, res.output = await run_checker(task, sandbox)
        except CheckerError as e:
            return VerifyResult("verifier_error", error=str(e))
    if judged is not None:
        try:
            res.rubric_score = await judged
            res.metrics["rubric" if "rubric" not in res.metrics else "rubric_judge"] = (
                res.rubric_score
            )
        except JudgeError as e:
            res.judge_error = str(e)
    reward = combine(res.code_score, res.rubric_score, task.code_weight, task.rubric_weight)
    if reward is None:
        why = f"no score: the rubric judge failed ({res.judge_error})"
        return VerifyResult("verifier_error", error=why, judge_error=res.judge_error)
    res.reward = reward
    return res


# ---------------------------------------------------------------------------------------------
# checker lint
# ---------------------------------------------------------------------------------------------

SandboxFactory = Callable[[Task, Path | None], Awaitable[Sandbox]]
"""Makes a fresh sandbox for ``task`` whose workspace starts as a copy of the given host dir
(``None``: empty), mounted at ``task.mount``. The caller destroys it."""


def backend_factory(backend: Any, **spec_kwargs: Any) -> SandboxFactory:
    """A `SandboxFactory` over a `SandboxBackend` (e.g. ``BwrapBackend``)."""

    async def make(task: Task, workspace: Path | None) -> Sandbox:
        spec = SandboxSpec(workspace_src=workspace, workdir=task.mount, **spec_kwargs)
        return await backend.create(spec)

    return make


@dataclass
class LintReport:
    """What `lint_task` found."""

    task: str
    problems: list[str] = field(default_factory=list)
    """Failures: the task does not pass lint when this is non-empty."""
    warnings: list[str] = field(default_factory=list)
    solution_metrics: dict[str, float] = field(default_factory=dict)
    untouched_reward: float | None = None
    flips: dict[str, list[str]] = field(default_factory=dict)
    """Metric → the mutations (``delete out.txt``…) under which it dropped below 1."""
    mutations: int = 0
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _text_of(d: Path | None) -> str:
    if d is None:
        return ""
    out = []
    for p in d.rglob("*"):
        if p.is_file():
            with contextlib.suppress(UnicodeDecodeError, OSError):
                out.append(p.read_text())
    return "\n".join(out)


def _files(root: Path | None) -> dict[str, Path]:
    if root is None or not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts
    }


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


def _mutate(src: Path, dst: Path, rel: str, how: str) -> bool:
    """Copy ``src`` to ``dst`` with file ``rel`` deleted/emptied/truncated; False if a no-op."""
    data = (src / rel).read_bytes()
    if how == "empty" and not data:
        return False
    if how == "truncate" and len(data) < 2:
        return False
    shutil.copytree(src, dst, symlinks=True)
    target = dst / rel
    if how == "delete":
        target.unlink()
    elif how == "empty":
        target.write_bytes(b"")
    else:
        target.write_bytes(data[: len(data) // 2])
    return True


async def _verify_in(factory: SandboxFactory, task: Task, workspace: Path | None) -> VerifyResult:
    sb = await factory(task, workspace)
    try:
        return await verify(task, sb)
    finally:
        await sb.destroy()


async def lint_task(task: Task, sandbox_factory: SandboxFactory, *, jobs: int = 4) -> LintReport:
    """Check that the task's checker can tell failure from success (see module docstring)."""
    t0 = time.monotonic()
    rep = LintReport(task=task.name)
    if task.checker == "none":
        rep.warnings.append("no code checker (rubric only): nothing to lint")
        return rep
    untouched = await _verify_in(sandbox_factory, task, task.workspace_dir)
    if untouched.status != "ok":
        rep.problems.append(f"checker fails on the untouched workspace: {untouched.error}")
    else:
        rep.untouched_reward = untouched.reward
        if untouched.reward >= 1.0:
            rep.problems.append("the untouched workspace already scores 1.0")
    if task.solution is None:
        rep.warnings.append("no reference solution: metric flips not checked")
        rep.duration = time.monotonic() - t0
        return rep
    with tempfile.TemporaryDirectory(prefix="hrl-lint-") as tmp:
        solved = Path(tmp) / "solved"
        sb = await sandbox_factory(task, task.workspace_dir)
        try:
            try:
                await run_solution(task, sb)
            except CheckerError as e:
                rep.problems.append(str(e))
                return rep
            sol = await verify(task, sb)
            await sb.copy_out(solved)
        finally:
            await sb.destroy()
        if sol.status != "ok":
            rep.problems.append(f"checker fails on the reference solution: {sol.error}")
            return rep
        rep.solution_metrics = sol.metrics
        below = {k: v for k, v in sol.metrics.items() if v < 1.0}
        if below or sol.reward < 1.0:
            rep.problems.append(
                f"reference solution scores {sol.reward:.3f} (metrics below 1: {below})"
            )
            return rep
        await _lint_mutations(task, sandbox_factory, solved, Path(tmp), rep, jobs)
    rep.duration = time.monotonic() - t0
    return rep


async def _lint_mutations(
    task: Task, factory: SandboxFactory, solved: Path, tmp: Path, rep: LintReport, jobs: int
) -> None:
    sem = asyncio.Semaphore(max(1, jobs))
    metrics = list(rep.solution_metrics)
    rep.flips = {m: [] for m in metrics}

    async def one(i: int, rel: str, how: str) -> None:
        dst = tmp / f"m{i}"
        if not await asyncio.to_thread(_mutate, solved, dst, rel, how):
            return
        label = f"{how} {rel}"
        async with sem:
            res = await _verify_in(factory, task, dst)
        rep.mutations += 1
        await asyncio.to_thread(shutil.rmtree, dst, True)
        if res.status != "ok":
            rep.problems.append(f"checker errors when it should score 0 ({label}): {res.error}")
            return
        for m in metrics:
            if res.metrics.get(m, 0.0) < 1.0:
                rep.flips[m].append(label)

    cands = lint_candidates(task, solved)
    if not cands:
        rep.problems.append("the reference solution changes no file and the checker names none")
        return
    work = [(rel, how) for rel in cands for how in ("delete", "empty", "truncate")]
    await asyncio.gather(*(one(i, rel, how) for i, (rel, how) in enumerate(work)))
    for m in metrics:
        if not rep.flips[m]:
            rep.problems.append(
                f"metric {m!r} never drops below 1 when any of {', '.join(cands)} is "
                "deleted, emptied or truncated (it passes on a failing workspace)"
            )
    rep.problems.sort()
