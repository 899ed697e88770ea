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
whose checkers expect their files at a fixed place (``task.reward_mount``; ClawGym:
``<input_mount_dir>/reward``, inside the workspace) still get the private directory: that
absolute path is rewritten to it in every text file of the reward files, so the judged
workspace never holds a checker file. The files exist in the sandbox only from the
verifier's run on, and every process of the harness is dead by then (a `Sandbox.run` never
outlives its command).

A ``reward.sh`` task's ``check.py`` runs once: reward.sh runs it as it likes, and the staged
check.py is a shim (`_ONCE_SHIM`) that runs the real source in the same process and keeps a
copy of what it printed (its JSON sub-scores become the metrics) and of its traceback.

Scoring semantics (ClawGym's):

* A checker that crashes or exits non-zero without a score scores **0**: ``status="ok"``,
  ``reward=0`` and ``checker_error`` holding its exit status and stderr/traceback tail (for
  reward.sh, check.py's own traceback first). The workspace is the model's output; a checker
  that cannot read it is its failure.
* Only failures that are not the workspace's doing give ``status="verifier_error"`` (the
  rollout is tombstoned) with a ``reason``: ``timeout`` (the checker outlived its limit),
  ``killed`` (killed by a signal or out of memory), ``environment`` (a module or command the
  task's environment should provide is missing: ``ModuleNotFoundError``, ``command not
  found``), or, with no reason, a verifier that could not stage its files or a checker that
  exited 0 yet printed no readable score or a value not in [0, 1] (a checker bug; never a
  reward of 0 that looks like a real score).

Invariants:
* ``reward`` = weighted mean of the checker's metrics (the code score); with a rubric judge
  and rubric rules, ``code_weight·code + rubric_weight·rubric`` (0.7/0.3 by default),
  renormalised over the sides that produced a number (a failed judge call falls back to
  code alone and is reported in ``judge_error``; a rubric-only task needs the judge).
* The checker runs with a fresh ``$HOME``, no user site-packages and isolated from anything
  the harness can have planted on Python's path.
* A failure of the sandbox itself raises `SandboxError` (the rollout is a ``sandbox_error``).

Checker lint (can a checker tell failure from success?) lives in ``actors/lint.py``.
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
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from harnessrl.actors.sandbox.base import Sandbox
from harnessrl.common.config import HrlModel
from harnessrl.common.tasks.model import RUBRIC_SCORES, Task

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
    reason: str = ""
    """Label of a ``verifier_error``'s cause: ``timeout``, ``killed``, ``environment``, or
    empty (staging failed, unreadable score, no judge)."""
    checker_error: str = ""
    """The checker crashed or exited non-zero on this workspace (``status="ok"``, scored 0,
    or a reward.sh's score despite its check.py failing): its exit status and stderr tail."""
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
    """No usable verdict, and not the workspace's doing (a ``verifier_error``); the message
    says why, ``reason`` labels it (see `VerifyResult.reason`)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class CheckerCrash(Exception):
    """The checker crashed or exited non-zero without a score: the workspace scores 0."""


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


def _mount_rewrite(text: str, mount: str, stage_dir: str) -> str:
    """``text`` with the absolute path ``mount`` (and paths below it) pointing at ``stage_dir``."""
    return re.sub(rf"(?<![\w./-]){re.escape(mount)}(?![\w.-])", stage_dir, text)


# The staged check.py of a reward.sh task: runs the real source (@SRC@) in this same process,
# as if it were this file, and keeps a copy of its stdout, stderr and exit status in @CAP@.
_ONCE_SHIM = """\
# harnessrl: the task's check.py, run as itself; what it prints is also kept for the verifier.
def _hrl_once():
    import linecache, os, sys
    src = @SRC@
    path = os.path.abspath(__file__)
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    code = compile(src, path, "exec")
    if __name__ != "__main__":
        return code, None
    cap = @CAP@

    class Tee(object):
        def __init__(self, stream, copy):
            self._hrl_stream, self._hrl_copy = stream, copy

        def write(self, s):
            n = self._hrl_stream.write(s)
            try:
                self._hrl_copy.write(s)
                self._hrl_copy.flush()
            except Exception:
                pass
            return n

        def flush(self):
            self._hrl_stream.flush()

        def __getattr__(self, name):
            return getattr(self._hrl_stream, name)

    try:
        os.makedirs(cap, exist_ok=True)
        for name in ("out", "err", "rc"):
            if os.path.exists(os.path.join(cap, name)):
                os.remove(os.path.join(cap, name))
        out = open(os.path.join(cap, "out"), "w", encoding="utf-8", errors="replace")
        err = open(os.path.join(cap, "err"), "w", encoding="utf-8", errors="replace")
    except OSError:
        return code, None
    sys.stdout, sys.stderr = Tee(sys.stdout, out), Tee(sys.stderr, err)

    def done(rc):
        try:
            with open(os.path.join(cap, "rc"), "w") as f:
                f.write(str(rc))
        except OSError:
            pass

    return code, done


_hrl_code, _hrl_done = _hrl_once()
del _hrl_once
if _hrl_done is None:
    exec(_hrl_code)
else:
    try:
        exec(_hrl_code)
    except SystemExit as _hrl_e:
        _hrl_c = _hrl_e.code
        _hrl_done(0 if _hrl_c is None else _hrl_c if isinstance(_hrl_c, int) else 1)
        raise
    except BaseException as _hrl_e:
        import traceback as _hrl_tb

        _hrl_tb.print_exception(type(_hrl_e), _hrl_e, _hrl_e.__traceback__.tb_next)
        _hrl_done(1)
        raise SystemExit(1)
    else:
        _hrl_done(0)
"""


def _once_shim(capture_dir: str) -> Callable[[bytes], bytes]:
    """Turns a check.py's source into `_ONCE_SHIM` around it (left as is if not UTF-8)."""

    def wrap(data: bytes) -> bytes:
        try:
            src = data.decode()
        except UnicodeDecodeError:
            return data
        shebang = src.splitlines(True)[0] if src.startswith("#!") else ""
        shim = _ONCE_SHIM.replace("@SRC@", ascii(src)).replace("@CAP@", ascii(capture_dir))
        return (shebang + shim).encode()

    return wrap


def _tar_dir(
    src: Path,
    rewrite: Callable[[str], str] | None = None,
    overrides: dict[str, Callable[[bytes], bytes]] | None = None,
) -> bytes:
    """A tar of ``src``'s contents (text files passed through ``rewrite``, then the file at
    each relative path in ``overrides`` through its function)."""
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
            if overrides and rel in overrides:
                data = overrides[rel](data)
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
    returncode: int = 0
    """Exit status of the whole driver script."""


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
        proxy=False,  # the verifier needs no model API
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
            done,
            stderr,
            False,
            f"verifier steps did not finish ({why}): {_tail(stderr)}",
            res.returncode,
        )
    return _DriverResult(done, stderr, False, returncode=res.returncode)


def _private_dir(kind: str) -> str:
    return f"/tmp/hrl-{kind}-{secrets.token_hex(8)}"


def _reward_rewrite(task: Task, stage_dir: str) -> Callable[[str], str] | None:
    """How the reward files' text is rewritten for files staged at ``stage_dir`` (always a
    private dir outside the workspace): Harbor's fixed paths, and ``task.reward_mount``."""
    if task.checker == "harbor":
        return lambda t: _harbor_rewrite(t, stage_dir)
    if task.reward_mount:
        return lambda t: _mount_rewrite(t, task.reward_mount, stage_dir)
    return None


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


CRASH_TAIL = 1500
"""Characters of a crashed checker's stderr (each part) kept in ``checker_error``."""
KILLED_EXITS = frozenset({137, 152, 153})
"""Exit statuses of a process killed by SIGKILL (OOM killer, memory limit), SIGXCPU, SIGXFSZ."""

_NO_MODULE = re.compile(
    r"\b(?:ModuleNotFoundError|ImportError): No module named '?([A-Za-z_][\w.]*)"
)
# bash: "…: [line N: ]CMD: command not found"; dash: "…: N: CMD: not found"
_NO_COMMAND = re.compile(
    r"^(?:[^\n]*?: )?([^\s/:'\"]+): command not found[ \t]*$"
    r"|^[^\n:]+: \d+: ([^\s/:'\"]+): not found[ \t]*$",
    re.M,
)
_NO_INTERPRETER = re.compile(r"\benv: [‘'\"]?([^\s/:'\"‘’]+)[’'\"]?: No such file or directory")
_SCRIPT_SUFFIXES = (".sh", ".bash", ".py", ".js", ".pl", ".rb")


def _workspace_module(task: Task, module: str) -> bool:
    """Whether a missing module is the agent's to write: the instruction names ``module.py`` or
    ``module/``, or the starting workspace holds it."""
    top = module.split(".")[0]
    if re.search(rf"(?<![\w.]){re.escape(top)}(?:\.py\b|/)", task.instruction):
        return True
    ws = task.workspace_dir
    return ws is not None and ((ws / f"{top}.py").exists() or (ws / top).is_dir())


def _infra_failure(task: Task, rcs: list[int | None], text: str) -> tuple[str, str] | None:
    """``(reason, detail)`` when a failed checker's exit statuses and stderr show a failure
    that is not the workspace's doing (killed, out of memory, missing environment)."""
    if any(rc in KILLED_EXITS for rc in rcs) or re.search(r"^MemoryError\b", text, re.M):
        return "killed", "the checker was killed (out of memory or a resource limit)"
    for m in _NO_MODULE.finditer(text):
        if not _workspace_module(task, m.group(1)):
            return "environment", (
                f"the task's environment lacks the Python module {m.group(1)!r} the checker needs"
            )
    for m in [*_NO_COMMAND.finditer(text), *_NO_INTERPRETER.finditer(text)]:
        cmd = next(g for g in m.groups() if g)
        if not cmd.endswith(_SCRIPT_SUFFIXES):
            return "environment", (
                f"the task's environment lacks the command {cmd!r} the checker needs"
            )
    return None


def _sub_failure(sub: tuple[str, int | None, str]) -> str:
    name, rc, stderr = sub
    status = "did not exit normally" if rc is None else f"exited with status {rc}"
    return f"{name} {status}:\n{_tail(stderr, CRASH_TAIL)}"


def _failure(
    task: Task, rc: int, stderr: str, sub: tuple[str, int | None, str] | None = None
) -> CheckerCrash | CheckerError:
    """The checker failed without a score: `CheckerCrash` (the workspace scores 0, message =
    its traceback), or `CheckerError` for an infrastructure or environment failure.

    ``sub``: ``(name, exit status or None, stderr)`` of a failed check.py that reward.sh ran;
    its traceback leads the message (reward.sh may have hidden it or shown only what its
    averaging step made of the empty output)."""
    parts, rcs, text = [], [rc], stderr
    if sub is not None:
        name, sub_rc, sub_err = sub
        parts.append(_sub_failure(sub))
        if sub_err.strip():
            stderr = stderr.replace(sub_err.strip(), f"[{name}'s stderr, above]")
        rcs.append(sub_rc)
        text = f"{sub_err}\n{text}"
    parts.append(f"{task.checker_entry} exited with status {rc}:\n{_tail(stderr, CRASH_TAIL)}")
    message = "\n".join(parts)
    infra = _infra_failure(task, rcs, text)
    if infra is not None:
        return CheckerError(f"{infra[1]}; {message}", infra[0])
    return CheckerCrash(message)


# ---------------------------------------------------------------------------------------------
# running the checker
# ---------------------------------------------------------------------------------------------


def _checker_steps(task: Task, capture: str) -> list[str]:
    entry = '"$d"/' + shlex.quote(task.checker_entry)
    if task.checker == "test_py":
        return [f'python3 {entry} "$ws"']
    if task.checker == "reward_sh":
        steps = [f"bash {entry}"]
        if capture:  # what check.py's shim kept (see _ONCE_SHIM)
            c = shlex.quote(capture)
            steps += [
                f"cat {c}/rc 2>/dev/null",
                f"tail -c 65536 {c}/out 2>/dev/null",
                f"tail -c 16384 {c}/err 2>/dev/null",
            ]
        return steps
    if task.checker == "harbor":
        return [
            f'mkdir -p "$d/logs/verifier" && bash {entry} >&2',
            'cat "$d/logs/verifier/reward.json" 2>/dev/null',
            'cat "$d/logs/verifier/reward.txt" 2>/dev/null',
        ]
    raise CheckerError(f"task {task.name} has no code checker")


async def run_checker(task: Task, sandbox: Sandbox) -> tuple[float, dict[str, float], str, str]:
    """``(code_score, metrics, stderr_tail, checker_error)`` of the task's checker.

    Raises `CheckerCrash` when the checker failed without a score (the workspace scores 0)
    and `CheckerError` when there is no verdict for reasons not the workspace's."""
    if task.reward_dir is None:
        raise CheckerError(f"task {task.name} has no reward directory")
    d = _private_dir("reward")
    once = task.checker == "reward_sh" and (task.reward_dir / "check.py").is_file()
    capture = _private_dir("check") if once else ""
    steps = _checker_steps(task, capture)
    overrides = {"check.py": _once_shim(capture)} if once else None
    files = await asyncio.to_thread(_tar_dir, task.reward_dir, _reward_rewrite(task, d), overrides)
    r = await _drive(sandbox, files, d, steps, task.verifier_timeout_s)
    if r.timed_out:
        raise CheckerError(f"checker timed out after {task.verifier_timeout_s:g} s", "timeout")
    if r.error:
        killed = r.returncode in KILLED_EXITS or r.returncode < 0
        raise CheckerError(r.error, "killed" if killed else "")
    if task.checker == "harbor":
        return _harbor_verdict(task, r.steps, r.stderr)
    (rc, out), err_tail = r.steps[0], _tail(r.stderr)
    if task.checker == "test_py":
        try:
            metrics = parse_metrics(out)
        except CheckerError:
            if rc != 0:  # a crash explains the garbage better than the garbage does
                raise _failure(task, rc, r.stderr) from None
            raise
        return weighted_score(metrics, task.metric_weights), metrics, err_tail, ""
    return _reward_sh_verdict(task, r, once)


def _reward_sh_verdict(
    task: Task, r: _DriverResult, once: bool
) -> tuple[float, dict[str, float], str, str]:
    (rc, out), err_tail = r.steps[0], _tail(r.stderr)
    sub: tuple[str, int | None, str] | None = None  # check.py, when it ran and failed
    sub_out = ""
    if once and r.steps[2][0] == 0:  # check.py ran (its shim made the capture files)
        (rc_status, rc_text), (_, sub_out), (_, sub_err) = r.steps[1:4]
        text = rc_text.strip()
        sub_rc = int(text) if rc_status == 0 and re.fullmatch(r"-?\d+", text) else None
        if sub_rc != 0:
            sub = ("check.py", sub_rc, sub_err)
    try:
        score = parse_scalar(out, task.checker_entry)
    except CheckerError:
        if rc != 0 or sub is not None:
            raise _failure(task, rc, r.stderr, sub) from None
        raise
    checker_error = ""
    if sub is not None:  # reward.sh scored despite check.py failing
        checker_error = _sub_failure(sub)
        infra = _infra_failure(task, [sub[1]], sub[2])
        if infra is not None:  # e.g. a missing module: that score is not the workspace's
            raise CheckerError(f"{infra[1]}; {checker_error}", infra[0])
    metrics = {"reward": score}
    if sub_out.strip():
        with contextlib.suppress(CheckerError):  # check.py's sub-scores are informative only
            metrics = parse_metrics(sub_out)
    return score, metrics, err_tail, checker_error


def _harbor_verdict(
    task: Task, steps: list[tuple[int, str]], stderr: str
) -> tuple[float, dict[str, float], str, str]:
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
        return weighted_score(metrics, task.metric_weights), metrics, _tail(stderr), ""
    if txt_rc == 0:
        score = parse_scalar(txt, "reward.txt")
        return score, {"reward": score}, _tail(stderr), ""
    if rc != 0:
        raise _failure(task, rc, stderr)
    raise CheckerError(
        f"test.sh wrote neither reward.txt nor reward.json (exit 0): {_tail(stderr, 600)}"
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
        """The rubric score in [0, 1]; raises `JudgeError`. A connection error, a timeout or an
        HTTP 5xx is retried ``retries`` times, ``retry_backoff_s`` later and then twice as late
        each time."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {
            "model": self.cfg.model,
            "messages": self.messages(task, workspace),
            "temperature": 0.0,
            "max_tokens": self.cfg.max_tokens,
        }
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.cfg.retries + 1),
            wait=wait_exponential(multiplier=self.cfg.retry_backoff_s),
            retry=retry_if_exception_type(_JudgeUnavailable),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    data = await self._ask(body)
        except _JudgeUnavailable as e:
            raise JudgeError(str(e)) from None
        try:
            content = data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"judge reply is not a chat completion: {str(data)[:200]}") from None
        return parse_judge_reply(content, len(task.rubric))

    async def _ask(self, body: dict[str, Any]) -> Any:
        """One request; its JSON reply. `_JudgeUnavailable` for what a retry may cure."""
        import aiohttp

        assert self._session is not None
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        url = self.cfg.url.rstrip("/") + "/chat/completions"
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        try:
            async with self._session.post(url, json=body, headers=headers, timeout=timeout) as r:
                if r.status >= 500:
                    raise _JudgeUnavailable(f"judge HTTP {r.status}")
                if r.status != 200:
                    raise JudgeError(f"judge HTTP {r.status}: {(await r.text())[:200]}")
                return await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _JudgeUnavailable(f"judge request failed: {e!r}") from None


class _JudgeUnavailable(Exception):
    """The judge could not answer now (unreachable, timed out, HTTP 5xx): worth a retry."""


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
            (
                res.code_score,
                res.metrics,
                res.output,
                res.checker_error,
            ) = await run_checker(task, sandbox)
        except CheckerCrash as e:  # ClawGym semantics: the workspace scores 0
            res.code_score, res.checker_error = 0.0, str(e)
        except CheckerError as e:
            return VerifyResult("verifier_error", error=str(e), reason=e.reason)
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
