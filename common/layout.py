"""On-disk layouts shared by the processes that write them and the tools that read them.

Weights folders: a broadcast version ``N`` lives in ``<root>/v000000NNN/`` (a Hugging Face
folder: ``config.json`` + ``model.safetensors``), written by the learner's disk publisher and by
each engine's weights-sync, read by engines on restart and by ``harnessrl run``/``demo``.

Learner checkpoints: ``<checkpoint_dir>/latest`` names the newest DeepSpeed checkpoint
(``step-000000012/``, with the learner state in its ``client_state.json``) and
``learner-state.json`` holds the newest learner state (`LearnerState`); written by
``harnessrl.learner.checkpoint.Checkpointer``, read by it and, without torch, by ``harnessrl run``
(``checkpoint_version``).

Metrics lines: ``metrics.jsonl`` holds one JSON object per line; `MetricsLine` and its
subclasses are the typed lines (the learner's ``start``/``step``/``commit``, the supervisor's
``rollup``/``summary``), written with ``encode_line`` and read with ``read_metrics``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import msgspec

WEIGHTS_RE = re.compile(r"v(\d+)")


def weights_folder(root: str | Path, version: int) -> Path:
    """The folder holding weight version ``version`` under ``root``."""
    return Path(root) / f"v{version:09d}"


def weights_version(folder: str | Path) -> int | None:
    """The version a weights folder's name holds (None for any other name)."""
    m = WEIGHTS_RE.fullmatch(Path(folder).name)
    return int(m.group(1)) if m else None


def weights_complete(folder: str | Path) -> bool:
    """Whether a weights folder holds a loadable model (config and weights written)."""
    folder = Path(folder)
    return (folder / "model.safetensors").exists() and (folder / "config.json").exists()


def weights_folders(root: str | Path) -> list[tuple[int, Path]]:
    """``(version, folder)`` of every weights folder under ``root`` (complete or not), oldest
    first."""
    found = ((weights_version(p), p) for p in Path(root).glob("v*"))
    return sorted((v, p) for v, p in found if v is not None)


def latest_weights(root: str | Path, max_version: int | None = None) -> tuple[Path, int] | None:
    """The newest complete weights folder under ``root`` not above ``max_version``."""
    for v, p in reversed(weights_folders(root)):
        if (max_version is None or v <= max_version) and weights_complete(p):
            return p, v
    return None


# ---------------------------------------------------------------------------------------------
# learner checkpoints
# ---------------------------------------------------------------------------------------------

STATE_FILE = "learner-state.json"
"""The learner state of the newest commit, beside ``latest`` in a checkpoint folder."""
LATEST = "latest"
"""Names the newest DeepSpeed checkpoint (``step-000000012``) of a checkpoint folder."""
CLIENT_STATE = "client_state.json"
"""The learner state saved inside a DeepSpeed checkpoint (``{"client_state": {...}}``)."""


@dataclass
class LearnerState:
    """Everything besides weights and optimiser that a restarted learner needs."""

    version: int = 0
    """Policy version (optimiser steps taken by this lineage)."""
    seq: int = 0
    """Commit sequence number (increases with every commit, full or state-only)."""
    ds_tag: str = ""
    """DeepSpeed checkpoint this state belongs to."""
    ledger: dict[str, Any] = field(default_factory=dict)
    """``batching.Ledger.state()``."""
    feeder: dict[str, Any] = field(default_factory=dict)
    """``feeder.Feeder.state()``."""
    broadcast: dict[str, Any] = field(default_factory=dict)
    """Weight publisher state (versions whose data may still be stored)."""
    totals: dict[str, float] = field(default_factory=dict)
    """Cumulative counters carried across restarts (wall/idle seconds, samples, tokens)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LearnerState:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def latest_checkpoint(root: str | Path) -> str | None:
    """The tag of the newest DeepSpeed checkpoint under ``root`` (None without one)."""
    p = Path(root) / LATEST
    return p.read_text().strip() if p.exists() else None


def pick_learner_state(root: str | Path, client: dict[str, Any], tag: str) -> LearnerState:
    """The committed learner state for checkpoint ``tag``: its client state, or the state
    file when that names the same checkpoint with a commit sequence at least as new."""
    state = LearnerState.from_json(client)
    state.ds_tag = tag
    f = Path(root) / STATE_FILE
    if f.exists():
        newer = LearnerState.from_json(json.loads(f.read_text()))
        if newer.ds_tag == tag and newer.seq >= state.seq:
            return newer
    return state


def read_learner_state(root: str | Path) -> LearnerState | None:
    """The learner state of the latest checkpoint, without loading weights (no torch)."""
    tag = latest_checkpoint(root)
    if tag is None:
        return None
    meta = json.loads((Path(root) / tag / CLIENT_STATE).read_text())
    return pick_learner_state(root, meta["client_state"], tag)


def checkpoint_version(root: str | Path) -> int | None:
    """The version the learner resumes at from ``root`` (None without a checkpoint); reads
    JSON only. An unreadable client state counts as version 0 (the state file may still name
    the checkpoint), an unreadable state file is ignored."""
    tag = latest_checkpoint(root)
    if tag is None:
        return None
    client: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        client = dict(json.loads((Path(root) / tag / CLIENT_STATE).read_text())["client_state"])
    try:
        return int(pick_learner_state(root, client, tag).version)
    except (OSError, ValueError, TypeError):
        return int(LearnerState.from_json(client).version)


# ---------------------------------------------------------------------------------------------
# metrics.jsonl lines
# ---------------------------------------------------------------------------------------------


class MetricsLine(msgspec.Struct, kw_only=True):
    """One line of a ``metrics.jsonl``: a JSON object with its wall ``time`` and ``event``.

    The learner writes ``start``/``step``/``commit`` lines to its run dir; ``harnessrl run``
    copies them verbatim into the run's ``metrics.jsonl`` beside its own lines, which carry
    ``"source": "run"`` (`RunLine`: ``rollup``, ``summary``). Readers get the typed record of
    each known event, a bare `MetricsLine` for any other; every field has a default, so older
    or partial lines still read. ``encode_line`` writes the keys in field order with
    ``json.dumps`` (the layout of the lines is unchanged)."""

    time: float = 0.0
    """Wall time (``time.time()``) the line was written."""
    event: str = ""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ()
    """Fields left out of the line while None."""


class StartLine(MetricsLine, kw_only=True):
    """The learner (re)started: a ``start`` line at version ``v`` rolls back every earlier step
    line above ``v`` (steps lost with a crash)."""

    event: str = "start"
    resumed: bool = False
    version: int = 0
    algo: str = ""
    epoch: str = ""
    """The feeder's epoch id (group ids are ``<epoch>_<n>``)."""


class StepLine(MetricsLine, kw_only=True):
    """One optimiser step of the learner (written before the checkpoint that makes it
    durable)."""

    event: str = "step"
    version: int = 0
    step: int = 0
    samples: int = 0
    groups: int = 0
    reward_mean: float = 0.0
    wait_s: float = 0.0
    busy_s: float = 0.0
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    idle_frac: float = 0.0
    committed: bool = False
    staleness: dict[str, int] = {}
    dropped: dict[str, int] = {}
    in_flight: int = 0
    batcher: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    rollouts: list[str] = []
    eval: dict[str, dict[str, float]] | None = None
    """Mean reward per ``suite/harness`` of the eval rollouts seen in the step (absent
    when none)."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("eval",)


class CommitLine(MetricsLine, kw_only=True):
    """A learner commit: full (``checkpoint_s``) or state-only (``dropped``)."""

    event: str = "commit"
    version: int = 0
    checkpoint_s: float | None = None
    dropped: dict[str, int] | None = None
    broadcast_s: float | None = None
    """Seconds the broadcast of the committed version took (it follows the commit: engines
    only ever get committed weights); absent when the commit broadcast nothing."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("checkpoint_s", "dropped", "broadcast_s")


class RunLine(MetricsLine, kw_only=True):
    """A line ``harnessrl run`` writes itself (``"source": "run"``)."""

    source: str = "run"


RUN_SOURCE = '"source": "run"'
"""How a supervisor line reads on disk (``encode_line`` of a `RunLine`)."""


class RollupLine(RunLine, kw_only=True):
    """The supervisor's periodic snapshot of the run (rates, counts, reward deltas)."""

    event: str = "rollup"
    elapsed_s: float = 0.0
    version: int = 0
    engine_versions: dict[str, str] = {}
    rollouts_per_s: float = 0.0
    gen_tokens_per_s: float = 0.0
    train_tokens_per_s: float = 0.0
    samples_trained: int = 0
    samples_per_min: float = 0.0
    learner_idle: float = 0.0
    staleness_mean: float = 0.0
    issued: int = 0
    in_flight: int = 0
    results: dict[str, int] = {}
    outcomes: dict[str, float] = {}
    failures: dict[str, float] = {}
    dropped: dict[str, float] = {}
    queues: dict[str, int] = {}
    rewards: dict[str, dict[str, list[float]]] = {}
    """Results since the previous rollup: ``{"train/HARNESS": {version: [sum, n]}}``."""
    restarts: dict[str, int] = {}


class SummaryLine(RunLine, kw_only=True):
    """The last line of a run: how it ended and what it did."""

    event: str = "summary"
    outcome: str = ""
    """``done``, ``fatal``, ``signal`` or ``error``."""
    time_limited: bool = False
    message: str = ""
    elapsed_s: float = 0.0
    version: int = 0
    """The learner's committed version (a step logged after it was rolled back by a crash)."""
    steps: int = 0
    engine_versions: dict[str, str] = {}
    samples_trained: int = 0
    """Rollouts trained in the committed lineage (the ledger's count)."""
    issued: int = 0
    results: dict[str, int] = {}
    members_with_result: int = 0
    """Issued rollouts (members) with a RolloutResult stored, from the run's final audit of
    the stream (the monitor's follower's count when no audit ran)."""
    samples: int = 0
    """Assembled rollouts that became a sample, each once (from the committed ledger and the
    samples still stored; the assembler's counters when those could not be read)."""
    tombstones: dict[str, int] = {}
    """Assembled rollouts that became a tombstone, by reason (counted like ``samples``)."""
    assembled: int = 0
    """RolloutResults the assembler settled (from its durable consumer on ROLLOUTS)."""
    unaccounted: int = 0
    """Issued rollouts (TaskRequests) that are neither pending, nor settled with a result for
    their member, nor dead-lettered: lost. Counted from the streams alone
    (``harnessrl.common.run.audit``), so process restarts never make it non-zero; 0 when the streams
    could not be read (``accounting`` says so)."""
    pending: int = 0
    """TaskRequests still stored at the end: queued, or running on an actor."""
    dead_lettered_tasks: int = 0
    """TaskRequests dead-lettered without a result for their member."""
    accounting: str = "exact"
    """``exact``; ``incomplete`` (not every result could be read: ``unaccounted`` may be too
    high); ``unavailable`` (the streams could not be read at the end)."""
    failures: dict[str, float] = {}
    dropped: dict[str, float] = {}
    reward_first: float | None = None
    reward_last: float | None = None
    rewards: dict[str, dict[str, float]] = {}
    restarts: dict[str, int] = {}
    leftover_pids: list[int] = []


LINE_TYPES: dict[str, type[MetricsLine]] = {
    "start": StartLine,
    "step": StepLine,
    "commit": CommitLine,
    "rollup": RollupLine,
    "summary": SummaryLine,
}


def line_object(line: MetricsLine) -> dict[str, Any]:
    """A line as the JSON object written for it: ``time`` first (stamped now when unset),
    ``source`` next on supervisor lines, then ``event`` and the fields in order."""
    d = msgspec.structs.asdict(line)
    for k in line.OMIT_NONE:
        if d[k] is None:
            del d[k]
    head = {"time": d.pop("time") or time.time()}
    if "source" in d:
        head["source"] = d.pop("source")
    return {**head, **d}


def encode_line(line: MetricsLine) -> str:
    """The JSON text of one line (no newline)."""
    return json.dumps(line_object(line))


def decode_line(raw: str | bytes) -> MetricsLine | None:
    """The typed record of one line; None for a line that is not a JSON object (e.g. one cut
    short by a crash). A line whose fields do not fit its type reads as a bare `MetricsLine`
    (its ``time`` and ``event`` kept where they fit), never as an error."""
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(d, dict):
        return None
    try:
        return msgspec.convert(d, LINE_TYPES.get(d.get("event"), MetricsLine))
    except msgspec.ValidationError:
        t, ev = d.get("time"), d.get("event")
        return MetricsLine(
            time=float(t) if isinstance(t, int | float) and not isinstance(t, bool) else 0.0,
            event=ev if isinstance(ev, str) else "",
        )


def read_metrics(path: str | Path) -> list[MetricsLine]:
    """Every readable line of a ``metrics.jsonl`` as its typed record ([] when missing)."""
    p = Path(path)
    if not p.exists():
        return []
    return [ln for ln in map(decode_line, p.read_text().splitlines()) if ln is not None]


def effective_steps(lines: list[MetricsLine]) -> list[StepLine]:
    """The step lines that survived learner restarts: a ``start`` line at version ``v`` drops
    the earlier step lines above ``v`` (those steps were rolled back)."""
    out: list[StepLine] = []
    for ln in lines:
        if isinstance(ln, StartLine):
            out = [s for s in out if s.version <= ln.version]
        elif isinstance(ln, StepLine):
            out.append(ln)
    return out
