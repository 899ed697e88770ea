"""``harnessrl teacher-data``: toy-teacher trajectories through a harness, for warm-start SFT.

    harnessrl teacher-data --out teacher.jsonl --per-family 1000 [--seed 0] [--family copy ...]
    harnessrl teacher-data --harness mini-swe-agent --out teacher.jsonl [--concurrency 4] ...

With ``--harness reference`` (the default) and without ``--live``, trajectories come from the
reference harness's own loop run in this process (below). With any other harness — or
``--live`` — every trajectory is a live rollout of the unmodified harness in a sandbox, behind
its proxy, with the scripted teacher as the model, recorded as the token tree the assembler
builds (`harnessrl.actors.teacher_live`); the teacher speaks the tools that harness declares.

Warm-start SFT data for the ``tiny-agent`` recipe (``harnessrl pretrain``). Each trajectory is
the reference harness's own agent loop (``actors/harnesses/reference_agent.py``: its system
prompt, tool schema, message echoing and tool implementations on a real workspace folder)
with the scripted toy teacher (``harnessrl.common.tasks.teacher.teacher_step``) in place of the model's
HTTP endpoint. So the messages are exactly those the harness sends through the proxy in a
sandbox, with the workspace shown at the sandbox's mount (``/workspace``), and the policy
trained on them sees the prompts and stop tokens it will see in RL — without a proxy, an
engine or a sandbox per trajectory (~1 ms each instead of ~1 s).

Tasks are fresh draws of the toy generator (``harnessrl.common.tasks.toy.train_tasks``): never equal to a
held-out ``toy-eval`` task. With ``--split eval`` it writes the held-out tasks' trajectories
instead (for a teacher-forced held-out loss; never trained on).

Output: one JSON object per line: ``task``, ``family``, ``level``, ``split``, ``style``, ``solved`` (False for a near miss that got it wrong),
``messages`` (the whole conversation: system, user, assistant/tool turns, ending with the teacher's ``finish``
call) and ``tools`` (the schema the harness sent). Written atomically. A live recording
writes the token tree (``nodes``) instead of ``messages``; `harnessrl.learner.pretrain`
reads both.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from harnessrl.common.config import HrlModel
from harnessrl.common.files import atomic_write
from harnessrl.common.tasks.model import DEFAULT_MOUNT, Task
from harnessrl.common.tasks.teacher import teacher_step
from harnessrl.common.tasks.toy import (
    FAMILY,
    ToyTask,
    generate,
    toy_metadata,
    train_tasks,
    vary_names,
)


class TeacherDataConfig(HrlModel):
    """``harnessrl teacher-data``: offline teacher trajectories through the reference agent."""

    out: Path = Path("teacher.jsonl")
    """JSONL file to write (atomically)."""
    per_family: int = Field(100, ge=1, le=1_000_000)
    """Training tasks per toy family (``--split train``)."""
    seed: int = 0
    """Toy generator seed (the held-out split of the same seed is excluded)."""
    split: str = Field("train", pattern="^(train|eval)$")
    """``train``: fresh training tasks; ``eval``: the held-out ``toy-eval`` tasks."""
    families: list[str] = []
    """Toy families to include (``--family``, repeat); empty: all."""
    vary_names: float = Field(0.5, ge=0.0, le=1.0)
    """Share of training tasks whose input, output and folder names are redrawn from the toy
    word list (``harnessrl.common.tasks.toy.vary_names``), so a policy must copy names from the
    instruction rather than guess among the six built-in ones (``--split eval``: never)."""
    style: Literal["edit", "shell"] = "shell"
    """Teacher style (``harnessrl.common.tasks.teacher.STYLES``): ``shell`` runs the family's one-line
    shell solution and finishes (what the ``tiny-agent`` recipe trains on); ``edit`` reads the
    inputs and writes the answer with ``write_file``."""
    near_miss: float = Field(0.0, ge=0.0, le=1.0)
    """Share of training trajectories (``style`` ``shell`` only) in the ``near_miss`` style: the
    teacher runs its family's plausible wrong one-liner instead (``Family.near_miss``) and
    finishes as if it were right — demonstrations with mistakes, which RL then corrects."""
    max_turns: int = Field(12, ge=1, le=100)
    """Model turns per trajectory (the teacher needs at most 7)."""
    harness: str = "reference"
    """Harness the trajectories go through (``harnessrl harness list``): ``reference`` runs its
    loop in this process (unless ``live``); any other is run live, unmodified, in a sandbox."""
    live: bool = False
    """Record the ``reference`` harness live too (sandbox, proxy, tokens as sampled)."""
    engine: str = ""
    """Live: record through this engine (a URL, e.g. ``harnessrl engine --model tiny-agent``)
    instead of the scripted teacher: the served policy's own attempts, every scored one kept
    whether it solved its task or not (``style`` ``policy`` in the record) — the other side
    of a GRPO group whose teacher side is recorded without it. ``model`` must be the model
    the engine serves (its tokenizer)."""
    model: str = "tiny-1m"
    """Live: the tokenizer and chat template of the recorded tokens (the model the data
    trains must use the same tokenizer)."""
    concurrency: int = Field(4, ge=1, le=256)
    """Live: rollouts at once."""
    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    """Live: output limit of each call (told to the harness as its ``max_tokens``): the one
    the trained policy will run with (``tiny-agent``: 128)."""
    harness_timeout_s: float = Field(180.0, gt=0, le=86_400)
    """Live: wall-clock limit of one harness run."""
    sandbox_root: Path | None = None
    """Live: host folder for sandbox state (empty: the backend's default)."""
    harness_preload: bool = True
    """Live: start a Python harness preloaded where it can (see the actor's
    ``harness_preload``); off: every rollout starts it cold."""
    nats: str = ""
    """Live: NATS URL for the CallRecords; empty: an in-memory bus."""
    progress_s: float = Field(30.0, gt=0)
    """Live: seconds between progress lines."""


CONFIG = TeacherDataConfig
SECTION = "teacher_data"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family", dest="cfg__families", action="append", metavar="F", help="family; repeat"
    )


class _TeacherClient:
    """Stands where the reference agent's HTTP client stands: replies with the teacher."""

    def __init__(self, task: Task, style: str) -> None:
        self.task, self.style = task, style
        self.calls = 0
        self.last: list[dict[str, Any]] = []

    def chat(self, messages: list, tools: list | None, label: str | None = None) -> dict:
        self.calls += 1
        msg = teacher_step(self.task, messages, self.style)
        self.last = [*messages, msg]
        return {"choices": [{"message": msg}], "usage": {}}


def as_task(t: ToyTask) -> Task:
    """The `Task` the teacher needs (instruction and ``metadata.toy``) for a generated task."""
    return Task(
        id=t.id,
        suite="toy-generated",
        instruction=t.instruction,
        split=t.split,
        path=Path("."),
        metadata={"toy": toy_metadata(t)},
    )


def trajectory(t: ToyTask, max_turns: int = 12, style: str = "shell") -> dict[str, Any]:
    """One teacher trajectory for ``t`` through the reference agent's loop and tools."""
    from harnessrl.actors.harnesses import reference_agent as ra

    with tempfile.TemporaryDirectory(prefix="hrl-teacher-") as tmp:
        for rel, text in t.files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_text(text)
        args = ra.parse_args(["--max-turns", str(max_turns)])
        client = _TeacherClient(as_task(t), style)
        agent = ra.Agent(client, ra.Workspace(tmp, 10.0, args.max_output), args)  # type: ignore[arg-type]
        # the sandbox shows the workspace at its mount; the prompt must say so
        agent.system = {
            "role": "system",
            "content": ra.SYSTEM_PROMPT.format(workspace=DEFAULT_MOUNT),
        }
        with contextlib.redirect_stderr(io.StringIO()):  # the agent logs every turn
            status, _ = agent.run(t.instruction)
        got = (Path(tmp) / t.params["output"]).read_text() if status == "finished" else None
    if style == "near_miss":  # a demonstration of a mistake: it must end, not solve
        if status != "finished":
            raise RuntimeError(f"near-miss teacher did not finish {t.id}: status {status}")
    elif got is None or got != t.expected:
        raise RuntimeError(f"teacher did not solve {t.id} ({t.family.name}): status {status}")
    return {
        "task": t.id,
        "family": t.family.name,
        "level": t.family.level,
        "split": t.split,
        "style": style,
        "solved": got == t.expected,
        "messages": client.last,
        "tools": agent.tools,
    }


def tasks_for(cfg: TeacherDataConfig) -> list[ToyTask]:
    unknown = [f for f in cfg.families if f not in FAMILY]
    if unknown:
        raise ValueError(f"unknown toy families {unknown}; choose from {sorted(FAMILY)}")
    if cfg.split == "eval":
        tasks = [t for t in generate(cfg.seed) if t.split == "eval"]
    else:
        rng = random.Random(f"vary-names:{cfg.seed}")
        tasks = [
            vary_names(t, rng) if rng.random() < cfg.vary_names else t
            for t in train_tasks(cfg.per_family, cfg.seed)
        ]
    return [t for t in tasks if not cfg.families or t.family.name in cfg.families]


def bad_config(cfg: TeacherDataConfig) -> str:
    """Why the configuration cannot record anything ("" when it can)."""
    from harnessrl.actors.harnesses import ADAPTERS, unknown_harness

    if cfg.harness not in ADAPTERS or cfg.harness == "command":
        return (
            unknown_harness(cfg.harness)
            if cfg.harness not in ADAPTERS
            else ("--harness command runs a fixed command line, not a model: choose a harness")
        )
    if cfg.engine and not cfg.engine.startswith(("http://", "https://")):
        return f"--engine must be an http(s) URL of an engine, not {cfg.engine!r}"
    if cfg.engine and cfg.harness == "reference" and not cfg.live:
        return "--engine records live: add --live for the reference harness"
    if cfg.style == "edit" and cfg.harness != "reference":
        return (
            f"--style edit needs the reference harness's read_file/list_dir tools; "
            f"{cfg.harness} is recorded with --style shell"
        )
    return ""


def main_live(cfg: TeacherDataConfig, tasks: list[ToyTask]) -> int:
    """Record ``tasks`` live through ``cfg.harness`` (`harnessrl.actors.teacher_live`)."""
    import os

    from harnessrl.actors.teacher_live import record_live
    from harnessrl.common.aio import run
    from harnessrl.common.files import atomic_write_json
    from harnessrl.common.tasks.teacher import style_for

    near = cfg.near_miss if cfg.split == "train" and cfg.style == "shell" else 0.0
    styles = [style_for(t.instruction, cfg.style, near, cfg.seed) for t in tasks]
    if cfg.engine:
        styles = ["policy"] * len(tasks)
    try:
        stats = run(record_live(cfg, tasks, styles, near), subprocesses=True)
    except (OSError, RuntimeError, ValueError) as e:  # no sandbox, no bus, no tokenizer...
        print(
            f"harnessrl teacher-data: live recording through {cfg.harness} failed: {e}",
            file=sys.stderr,
        )
        return 1
    part = Path(f"{cfg.out}.part")
    print(f"teacher-data: {stats.line()}", file=sys.stderr)
    atomic_write_json(Path(f"{cfg.out}.stats.json"), stats.as_dict())
    n_done = stats.skipped + stats.scored + sum(stats.dropped.values())
    if n_done < len(tasks):  # interrupted: the partial file stays for the next run
        print(
            f"teacher-data: {n_done}/{len(tasks)} tasks done; run again to resume", file=sys.stderr
        )
        return 1
    if part.exists():
        os.replace(part, cfg.out)
    print(f"teacher-data: {cfg.out} ({len(tasks)} tasks)", file=sys.stderr)
    return 0


def main(cfg: TeacherDataConfig, args: argparse.Namespace | None = None) -> int:
    t0 = time.monotonic()
    bad = bad_config(cfg)
    try:
        if bad:
            raise ValueError(bad)
        tasks = tasks_for(cfg)
    except ValueError as e:
        print(f"harnessrl teacher-data: {e}", file=sys.stderr)
        return 2
    if cfg.harness != "reference" or cfg.live:
        return main_live(cfg, tasks)
    rng = random.Random(f"near-miss:{cfg.seed}")
    styles = [
        "near_miss"
        if cfg.split == "train" and cfg.style == "shell" and rng.random() < cfg.near_miss
        else cfg.style
        for _ in tasks
    ]
    lines = [
        json.dumps(trajectory(t, cfg.max_turns, s)) for t, s in zip(tasks, styles, strict=True)
    ]
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(cfg.out, "".join(line + "\n" for line in lines))
    print(
        f"teacher-data: {len(lines)} trajectories ({cfg.split}) -> {cfg.out} "
        f"in {time.monotonic() - t0:.1f}s",
        file=sys.stderr,
    )
    return 0
