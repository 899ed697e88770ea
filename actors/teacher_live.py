"""Teacher trajectories recorded live through a real, unmodified harness.

``harnessrl teacher-data --harness NAME`` (any harness but the offline ``reference`` loop, or
``--live`` for that one too) runs every task as a rollout exactly as an actor does
(`harnessrl.actors.rollout.run_rollout`): a fresh sandbox with the task's workspace, the
harness launched inside it, its own proxy (TITO, CallRecords), the verifier after it exits.
The model behind the proxy is the scripted toy teacher (`harnessrl.proxy.engine.teacher`,
started in this process), which reads the harness's tool vocabulary from each request and
answers in it. Each rollout's CallRecords are then assembled into its prefix tree
(`harnessrl.common.tree.assemble`, as the assembler does), and the tree's tokens are the
record: SFT trains on exactly the token layout RL samples in — the harness's system prompt,
tool schema, tool-result wrapping, retries and forks — not on a re-rendering of it.

Tasks are written as a native task suite in a temporary folder (so the sandbox, verifier and
teacher see ordinary task folders); CallRecords go to an in-memory bus unless ``--nats`` is
given, and each rollout's records are dropped once assembled.

Record (one JSON line per kept rollout): ``task``, ``family``, ``level``, ``split``,
``style``, ``solved`` (reward 1.0), ``reward``, ``harness``, ``harness_version``,
``tokenizer`` (name and `tokenizer_fingerprint`), ``n_calls``, ``tito_misses``,
``false_forks``, ``unique_tokens``, ``model_tokens``, ``seconds``, and ``nodes``: the tree,
each node ``{"parent": index or -1, "ids": [token ids], "mask": "0011..."}`` (``1``: a token
the model generated). Kept: scored rollouts whose tree has nodes and, for the ``shell`` style,
that solved their task (a ``near_miss`` demonstration is kept when it ran; it is not meant to
solve). Every other outcome is counted by reason and left out. With ``engine`` set, the model is
that engine, not the teacher, and every scored rollout is kept (``style`` ``policy``).

Resumable: records are appended to ``<out>.part`` as rollouts finish; a second run with the
same ``--out`` skips the tasks already there and renames the file to ``<out>`` when every
task is done. Figures of the recording (rollouts/s, CPU seconds per rollout — the harness's
and this process's —, the load average, success, tokens) go to stderr
and to ``<out>.stats.json``; the harness's CPU is what its launcher inside the sandbox
measured (`ExecResult.cpu_s`), which the host's own accounting cannot see.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import secrets
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from harnessrl.actors.teacher_data import TeacherDataConfig
    from harnessrl.common.tasks.toy import ToyTask

RETRIES = 2
"""More attempts of a rollout that ended in an infrastructure failure (sandbox, harness,
engine or verifier error; a timeout) before it is counted as failed."""


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its reaped children."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return []


def tree_nodes(sample: Any) -> list[dict[str, Any]]:
    """A TreeSample's nodes as JSON: parent, token ids, loss mask as a 0/1 string."""
    out = []
    for n in sample.nodes:
        ids = np.frombuffer(n.token_ids, dtype="<i4")
        mask = np.frombuffer(n.loss_mask, dtype=np.uint8) if n.loss_mask else np.zeros(len(ids))
        out.append(
            {
                "parent": int(n.parent),
                "ids": [int(i) for i in ids],
                "mask": "".join("1" if m else "0" for m in mask),
            }
        )
    return out


@dataclass
class Stats:
    """What a live recording measured."""

    harness: str
    tasks: int = 0
    skipped: int = 0
    """Tasks already in ``<out>.part`` (a resumed recording)."""
    rollouts: int = 0
    """Rollouts run (retries of infrastructure failures included)."""
    kept: int = 0
    solved: int = 0
    scored: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    cpu_harness_s: float = 0.0
    """The harnesses' CPU, measured inside their sandboxes (``durations["harness_cpu"]``)."""
    cpu_self_s: float = 0.0
    """This process: the proxies, the teacher engine, sandbox and rollout management."""
    cpu_children_s: float = 0.0
    """Host-side children (bwrap's own share; the sandboxes' insides are not seen here)."""
    load: list[float] = field(default_factory=list)
    tokens: int = 0
    model_tokens: int = 0
    calls: int = 0
    tito_misses: int = 0
    false_forks: int = 0
    harness_version: str = ""
    concurrency: int = 0
    teacher: bool = True
    """The scripted teacher is the model, in this process (not an engine elsewhere)."""

    def as_dict(self) -> dict[str, Any]:
        n = max(self.rollouts, 1)
        return {
            "harness": self.harness,
            "harness_version": self.harness_version,
            "tasks": self.tasks,
            "skipped": self.skipped,
            "rollouts": self.rollouts,
            "kept": self.kept,
            "scored": self.scored,
            "success_rate": round(self.solved / self.scored, 4) if self.scored else None,
            "dropped": dict(self.dropped),
            "concurrency": self.concurrency,
            "wall_s": round(self.wall_s, 1),
            "rollouts_per_s": round(self.rollouts / self.wall_s, 3) if self.wall_s else None,
            "cpu_s_per_rollout": round(
                (self.cpu_harness_s + self.cpu_self_s + self.cpu_children_s) / n, 3
            ),
            "cpu_s_per_rollout_harness": round(self.cpu_harness_s / n, 3),
            "cpu_s_per_rollout_this_process": round(self.cpu_self_s / n, 3),
            "cpu_s_per_rollout_host_children": round(self.cpu_children_s / n, 3),
            "loadavg_at_end": self.load,
            "cpus": os.cpu_count(),
            "tokens_per_conversation": round(self.tokens / self.kept, 1) if self.kept else None,
            "model_tokens_per_conversation": (
                round(self.model_tokens / self.kept, 1) if self.kept else None
            ),
            "calls_per_conversation": round(self.calls / self.kept, 2) if self.kept else None,
            "tito_misses": self.tito_misses,
            "false_forks": self.false_forks,
        }

    def line(self) -> str:
        d = self.as_dict()
        drop = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items())) or "none"
        here = "proxy, teacher, sandboxes" if self.teacher else "proxy, sandboxes; model: an engine"
        return (
            f"{d['rollouts']} rollouts through {self.harness} {self.harness_version} in "
            f"{d['wall_s']}s ({d['rollouts_per_s']} rollouts/s at concurrency {self.concurrency}), "
            f"{d['cpu_s_per_rollout']} CPU s per rollout ({d['cpu_s_per_rollout_harness']} in "
            f"the harness, {d['cpu_s_per_rollout_this_process']} in this process: "
            f"{here}), "
            f"success {d['success_rate']}, kept "
            f"{self.kept}, {d['tokens_per_conversation']} tokens per conversation, "
            f"{self.tito_misses} TITO misses, {self.false_forks} false forks; dropped: {drop}; "
            f"load average {' '.join(map(str, self.load))} on {d['cpus']} CPUs"
        )


def done_tasks(part: Path) -> set[str]:
    """Task ids already recorded in a partial output (a torn last line is ignored)."""
    done: set[str] = set()
    if not part.exists():
        return done
    good = 0
    with open(part, "rb") as f:
        for raw in f:
            try:
                done.add(json.loads(raw)["task"])
                good += len(raw)
            except (ValueError, KeyError, TypeError):
                break
    with open(part, "r+b") as f:  # drop a line torn by a crash, so appends stay valid JSONL
        f.truncate(good)
    return done


async def record_live(
    cfg: TeacherDataConfig, tasks: list[ToyTask], styles: list[str], near_miss: float
) -> Stats:
    """Record ``tasks`` (ToyTasks) through ``cfg.harness`` with the teacher in ``styles`` (what
    `harnessrl.common.tasks.teacher.style_for` gives with ``cfg.style``, ``near_miss`` and
    ``cfg.seed``: the engine chooses the same); append the kept records to ``<cfg.out>.part``
    and return the figures (the caller renames the file when complete)."""
    from harnessrl.actors.config import RolloutSettings
    from harnessrl.actors.rollout import RolloutDeps, run_rollout
    from harnessrl.common.bus import connect
    from harnessrl.common.models import load_tokenizer, resolve_model, tokenizer_fingerprint
    from harnessrl.common.records import CallRecord, TaskRequest
    from harnessrl.common.tasks.toy import write_task
    from harnessrl.common.tree import assemble
    from harnessrl.proxy.engine.teacher import make_teacher_engine

    stats = Stats(
        cfg.harness, tasks=len(tasks), concurrency=cfg.concurrency, teacher=not cfg.engine
    )
    part = Path(f"{cfg.out}.part")
    part.parent.mkdir(parents=True, exist_ok=True)
    done = done_tasks(part)
    todo = [(t, s) for t, s in zip(tasks, styles, strict=True) if t.id not in done]
    stats.skipped = len(tasks) - len(todo)
    tok = await asyncio.to_thread(load_tokenizer, resolve_model(cfg.model))
    tokenizer = {"name": cfg.model, "fingerprint": tokenizer_fingerprint(tok)}
    if not todo:
        return stats
    with tempfile.TemporaryDirectory(prefix="hrl-teacher-live-") as tmp:
        suite = Path(tmp) / "teacher-tasks"
        suite.mkdir()
        for t, _ in todo:
            write_task(t, suite)
        run = "teach" + secrets.token_hex(4)
        stack = contextlib.AsyncExitStack()
        engine_url = cfg.engine
        if not engine_url:
            engine = make_teacher_engine(
                [str(suite)], cfg.model, style=cfg.style, near_miss=near_miss, seed=cfg.seed
            )
            await engine.start()
            stack.push_async_callback(engine.stop)
            engine_url = engine.url
        try:
            bus = await connect(cfg.nats or f"memory://{run}", run, name="harnessrl teacher-data")
        except BaseException:
            await stack.aclose()
            raise
        stack.push_async_callback(bus.close)
        settings = RolloutSettings(
            engines=[engine_url],
            model=cfg.model,
            max_new_tokens=cfg.max_new_tokens,
            max_turns=cfg.max_turns,
            harness_timeout_s=cfg.harness_timeout_s,
            sandbox_root=cfg.sandbox_root,
            harness_preload=cfg.harness_preload,
        )
        sem = asyncio.Semaphore(cfg.concurrency)
        out = open(part, "a", encoding="utf-8")  # noqa: SIM115 - appended to as rollouts end
        t0, (c0_self, c0_child) = time.monotonic(), cpu_seconds()
        last = [t0]

        async def one(i: int, t: Any, style: str, deps: Any) -> None:
            async with sem:
                req = TaskRequest(
                    group_id=f"t{i}",
                    k=0,
                    group_size=1,
                    issued_version=0,
                    task_id=t.id,
                    suite=str(suite),
                    harness=cfg.harness,
                    timeout_s=cfg.harness_timeout_s,
                )
                for attempt in range(1, RETRIES + 2):
                    t_start = time.monotonic()
                    res = await run_rollout(req, attempt, deps)
                    stats.rollouts += 1
                    stats.cpu_harness_s += res.durations.get("harness_cpu", 0.0)
                    subject = bus.subjects.calls(res.rollout_id)
                    calls = await bus.read_subject(subject, CallRecord)
                    await bus.purge("CALLS", subject)
                    if res.status == "ok" or attempt > RETRIES:
                        break
            stats.harness_version = stats.harness_version or res.harness_version
            if res.status != "ok":
                stats.dropped[f"{res.status}:{res.reason}"] += 1
                return
            stats.scored += 1
            stats.solved += res.reward >= 1.0
            sample = assemble(calls, res)
            c = sample.counters
            why = ""
            if not sample.nodes:
                why = f"no_sample:{sample.dropped_reason}"
            elif style not in ("near_miss", "policy") and res.reward < 1.0:
                why = "not_solved"
            if why:
                stats.dropped[why] += 1
                return
            rec = {
                "task": t.id,
                "family": t.family.name,
                "level": t.family.level,
                "split": t.split,
                "style": style,
                "solved": res.reward >= 1.0,
                "reward": res.reward,
                "harness": res.harness,
                "harness_version": res.harness_version,
                "tokenizer": tokenizer,
                "n_calls": c.n_calls,
                "tito_misses": c.tito_misses,
                "false_forks": c.false_forks,
                "unique_tokens": c.unique_tokens,
                "model_tokens": c.model_tokens,
                "seconds": round(time.monotonic() - t_start, 2),
                "instruction": t.instruction,
                "nodes": tree_nodes(sample),
            }
            out.write(json.dumps(rec) + "\n")
            out.flush()
            stats.kept += 1
            stats.tokens += c.unique_tokens
            stats.model_tokens += c.model_tokens
            stats.calls += c.n_calls
            stats.tito_misses += c.tito_misses
            stats.false_forks += c.false_forks
            now = time.monotonic()
            if now - last[0] >= cfg.progress_s:
                last[0] = now
                el = now - t0
                n = stats.scored + sum(stats.dropped.values())
                print(
                    f"teacher-data: {n}/{len(todo)} tasks, {stats.rollouts / el:.2f} rollouts/s, "
                    f"success {stats.solved / max(stats.scored, 1):.3f}, "
                    f"ETA {(len(todo) - n) * el / max(n, 1) / 60:.1f} min",
                    file=sys.stderr,
                    flush=True,
                )

        try:
            async with RolloutDeps.open(settings, bus, actor="teacher-data") as deps:
                await asyncio.gather(*(one(i, t, s, deps) for i, (t, s) in enumerate(todo)))
        finally:
            out.close()
            stats.wall_s = time.monotonic() - t0
            c1_self, c1_child = cpu_seconds()
            stats.cpu_self_s, stats.cpu_children_s = c1_self - c0_self, c1_child - c0_child
            stats.load = loadavg()
            await stack.aclose()
    return stats
