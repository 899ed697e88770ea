"""``harnessrl eval``: score policies on a fixed task pool across harnesses, without training.

    harnessrl eval --policy PATH|tiny|teacher [--policy ...] --suite NAME [--suite ...]
                   --harness H [--harness ...] [--n K] [--limit N] [--out FILE.json]

For each policy it starts its own engine (``harnessrl engine --model PATH``, or
``harnessrl engine --kind teacher``, the scripted toy teacher, for ``teacher`` — a ceiling and a
sanity check) as a child process, then runs every
(task, harness) ``n`` times through the same rollout pipeline an actor uses
(``harnessrl.actors.rollout.run_rollout``: sandbox, harness, proxy, verifier), in this process, with
``concurrency`` rollouts at once per policy. CallRecords go to an in-memory bus unless
``--nats`` is given (nothing here is trained on, so nothing needs to outlive the command).

It prints one table: mean reward and success rate (reward 1.0) per policy and harness — with
several of each, the transfer matrix (policy x harness) that a cross-harness claim needs — and
with ``--per-task`` the score of each task. ``--out`` writes every result as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from harnessrl.actors.config import RolloutSettings
from harnessrl.common.config import NatsClientSettings

TEACHER = "teacher"
"""Policy name of the scripted toy teacher."""


class EvalConfig(NatsClientSettings):
    """``harnessrl eval``: a fixed task pool, several policies and harnesses, no training."""

    policies: list[str] = ["tiny"]
    """Policies (``--policy``, repeat): model folders, tiny specs, or ``teacher`` (the scripted
    toy teacher)."""
    suites: list[str] = ["toy-eval"]
    """Task suites (``--suite``, repeat): names or folders."""
    harnesses: list[str] = ["reference"]
    """Harness adapters (``--harness``, repeat)."""
    n: int = Field(1, ge=1, le=10_000)
    """Rollouts per (policy, task, harness)."""
    limit: int = Field(0, ge=0, le=1_000_000)
    """Evaluate only this many tasks, spread evenly over the sorted pool (0: all)."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Rollouts run at once per policy."""
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    """Sampling temperature (0: greedy)."""
    max_new_tokens: int = Field(0, ge=0, le=1_000_000)
    """Most tokens one model call may generate; 0: each policy's own limit (its
    ``generation_config.json`` ``max_new_tokens``; ``tiny-agent``: 256), else 4096."""
    max_turns: int = Field(10, ge=0, le=100_000)
    """Most model turns per rollout, for harnesses that take a limit (0: harness default)."""
    harness_timeout_s: float = Field(300.0, ge=0, le=86_400)
    """Wall-clock limit of one harness run (0: each task's own)."""
    sandbox: Literal["bwrap", "docker"] = "bwrap"
    """Sandbox backend."""
    sandbox_root: Path | None = None
    """Host folder for sandbox state (empty: the backend's default)."""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """Further rollout settings (the fields of ``[actor]`` that shape a rollout, e.g.
    ``--rollout.harness-options`` or an ``[eval.rollout]`` table); ``model`` names the
    teacher's tokenizer. Its ``engines``, ``temperature``, ``max_new_tokens``, ``max_turns``,
    ``sandbox``, ``sandbox_root`` and ``harness_timeout_s`` are replaced by this command's own
    fields (and ``model`` by each policy other than the teacher)."""
    engine_max_batch_size: int = Field(16, ge=1, le=1024)
    """``--max-batch-size`` of each policy's engine."""
    engine_threads: int = Field(0, ge=0, le=1024)
    """torch threads of each policy's engine (0: torch's default)."""
    startup_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """How long an engine may take to start."""
    nats: str = ""
    """NATS URL for the CallRecords; empty: an in-memory bus."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of every rollout's sampling."""
    log_dir: Path | None = None
    """Folder for the engines' logs; empty: a temp folder."""
    out: Path | None = None
    """Write every result (and the table) to this JSON file."""
    per_task: bool = False
    """Also print each task's mean reward."""
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    """Logging level (stderr)."""

    @field_validator("policies", "suites", "harnesses")
    @classmethod
    def _not_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one")
        return v


CONFIG = EvalConfig
SECTION = "eval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, dest, what in (
        ("--policy", "policies", "policy: model folder, tiny spec or 'teacher'"),
        ("--suite", "suites", "task suite (name or folder)"),
        ("--harness", "harnesses", "harness adapter"),
    ):
        parser.add_argument(
            flag, dest=f"cfg__{dest}", action="append", metavar="X", help=f"{what}; repeat"
        )


# ---------------------------------------------------------------------------------------------
# the pool and the table
# ---------------------------------------------------------------------------------------------


@dataclass
class Item:
    policy: int
    task: Any
    harness: str
    k: int


def task_pool(suites: list[str], limit: int = 0) -> list[Any]:
    """The tasks of ``suites`` sorted by (suite, id); ``limit`` picks that many, evenly spread."""
    from harnessrl.common.tasks import list_tasks

    tasks = sorted((t for s in suites for t in list_tasks(s)), key=lambda t: (t.suite, t.id))
    if limit and limit < len(tasks):
        step = len(tasks) / limit
        tasks = [tasks[int(i * step)] for i in range(limit)]
    return tasks


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{policy: {harness: {"reward", "success", "n", "errors"}}}``; infrastructure failures
    (sandbox/harness/verifier errors) are counted apart and left out of the means."""
    acc: dict[tuple[str, str], list[Any]] = defaultdict(lambda: [0.0, 0, 0, 0])
    for r in results:
        a = acc[(r["policy"], r["harness"])]
        if r["status"] in ("ok", "timeout"):
            reward = r["reward"] if r["status"] == "ok" else 0.0
            a[0] += reward
            a[1] += reward >= 1.0
            a[2] += 1
        else:
            a[3] += 1
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (p, h), (s, ok, n, err) in acc.items():
        out[p][h] = {
            "reward": s / n if n else float("nan"),
            "success": ok / n if n else float("nan"),
            "n": n,
            "errors": err,
        }
    return dict(out)


def format_table(
    summary: dict[str, dict[str, dict[str, float]]], policies: list[str], harnesses: list[str]
) -> str:
    """Policy x harness: ``reward / success (n)``."""
    width = max(12, *(len(p) for p in policies)) + 2
    head = "policy".ljust(width) + "".join(h.rjust(26) for h in harnesses)
    lines = [head, "-" * len(head)]
    for p in policies:
        row = p.ljust(width)
        for h in harnesses:
            c = summary.get(p, {}).get(h)
            cell = "—" if c is None else f"{c['reward']:.3f} / {c['success']:.3f} ({c['n']})"
            if c is not None and c["errors"]:
                cell += f" +{c['errors']}err"
            row += cell.rjust(26)
        lines.append(row)
    lines.append("cells: mean reward / success rate (rollouts scored); errors are left out")
    return "\n".join(lines)


def per_task_table(results: list[dict[str, Any]], policies: list[str]) -> str:
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        by[r["task"]][r["policy"]].append(r["reward"] if r["status"] == "ok" else 0.0)
    width = max(len(t) for t in by) + 2
    lines = ["task".ljust(width) + "".join(p[-18:].rjust(20) for p in policies)]
    for task in sorted(by):
        cells = [by[task].get(p) for p in policies]
        lines.append(
            task.ljust(width)
            + "".join((f"{sum(c) / len(c):.2f}" if c else "—").rjust(20) for c in cells)
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


def engine_spec(name: str, policy: str, cfg: EvalConfig, port: int) -> Any:
    """The child that serves ``policy``."""
    from harnessrl.common.run.plan import command_prefix
    from harnessrl.common.run.supervisor import ChildSpec

    py = sys.executable
    if policy == TEACHER:
        argv = [*command_prefix(py, "engine"), "--kind", "teacher"]
        for s in cfg.suites:
            argv += ["--suites", s]
        argv += ["--model", tokenizer_of(policy, cfg), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--log-level", "warning"]
    else:
        argv = [*command_prefix(py, "engine"), "--model", policy, "--port", str(port)]
        argv += ["--max-batch-size", str(cfg.engine_max_batch_size), "--log-level", "warning"]
        argv += ["--seed", str(cfg.seed)]
        if cfg.engine_threads:
            argv += ["--threads", str(cfg.engine_threads)]
    ready = r"engine ready: (http://\S+)"
    return ChildSpec(
        name, argv, "engine", on_exit="stop", ready=ready, ready_timeout_s=cfg.startup_timeout_s
    )


def tokenizer_of(policy: str, cfg: EvalConfig) -> str:
    """Where the rollouts' tokenizer and chat template come from for ``policy``."""
    if policy == TEACHER:
        return cfg.rollout.model
    return policy


async def evaluate(cfg: EvalConfig, urls: list[str], *, progress: Any = None) -> list[dict]:
    """Run the pool against one engine URL per policy; one dict per rollout."""
    import contextlib

    from harnessrl.actors.rollout import RolloutDeps, run_rollout
    from harnessrl.common.bus import connect
    from harnessrl.common.records import TaskRequest

    tasks = task_pool(cfg.suites, cfg.limit)
    run = "eval" + secrets.token_hex(4)
    bus = await connect(
        cfg.nats or f"memory://{run}",
        run,
        name="harnessrl eval",
        creds=cfg.nats_creds,
        ca=cfg.nats_ca,
    )
    results: list[dict[str, Any]] = []
    done = [0]
    total = len(cfg.policies) * len(tasks) * len(cfg.harnesses) * cfg.n

    async def one(pi: int, deps: Any, sem: asyncio.Semaphore, item: Item, idx: int) -> None:
        async with sem:
            req = TaskRequest(
                group_id=f"p{pi}_{idx}",
                k=item.k,
                group_size=cfg.n,
                issued_version=0,
                task_id=item.task.id,
                suite=item.task.suite,
                harness=item.harness,
                timeout_s=cfg.harness_timeout_s,
                is_eval=True,
                seed=cfg.seed + idx * 1000 + item.k,
            )
            t0 = time.monotonic()
            res = await run_rollout(req, 1, deps)
            results.append(
                {
                    "policy": cfg.policies[pi],
                    "task": item.task.name,
                    "harness": item.harness,
                    "k": item.k,
                    "status": res.status,
                    "reward": res.reward,
                    "metrics": res.metrics,
                    "n_calls": res.n_calls,
                    "seconds": round(time.monotonic() - t0, 2),
                    "error": res.error,
                }
            )
            done[0] += 1
            if progress is not None:
                progress(done[0], total)

    async def policy_run(pi: int, url: str) -> None:
        settings = RolloutSettings.model_validate(
            {
                **cfg.rollout.model_dump(),
                "engines": [url],
                "model": tokenizer_of(cfg.policies[pi], cfg),
                "temperature": cfg.temperature,
                "max_new_tokens": cfg.max_new_tokens,
                "max_turns": cfg.max_turns,
                "sandbox": cfg.sandbox,
                "sandbox_root": cfg.sandbox_root,
                "harness_timeout_s": cfg.harness_timeout_s,
            }
        )
        sem = asyncio.Semaphore(cfg.concurrency)
        items = [Item(pi, t, h, k) for t in tasks for h in cfg.harnesses for k in range(cfg.n)]
        async with RolloutDeps.open(settings, bus, actor=f"eval-p{pi}") as deps:
            await asyncio.gather(
                *(one(pi, deps, sem, it, i // cfg.n) for i, it in enumerate(items))
            )

    from harnessrl.common.models import load_tokenizer

    for p in cfg.policies:  # one at a time: transformers' lazy imports race across threads
        await asyncio.to_thread(load_tokenizer, tokenizer_of(p, cfg))
    try:
        await asyncio.gather(*(policy_run(pi, u) for pi, u in enumerate(urls)))
    finally:
        with contextlib.suppress(Exception):
            await bus.close()
    return results


def run_eval(cfg: EvalConfig, out: Any = None) -> dict[str, Any]:
    """Start the engines, evaluate, stop the engines; return the report (also printed)."""
    import tempfile

    from harnessrl.common import aio
    from harnessrl.common.files import free_port
    from harnessrl.common.run.supervisor import Supervisor

    out = out or sys.stdout
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="hrl-eval-"))
    sup = Supervisor(log_dir)
    t0 = time.monotonic()
    try:
        names = [f"engine-{i}" for i in range(len(cfg.policies))]
        for name, policy in zip(names, cfg.policies, strict=True):
            sup.start(engine_spec(name, policy, cfg, free_port()))
        sup.wait_ready(names)
        urls = [sup.children[n].ready_match.group(1) for n in names]  # type: ignore[union-attr]
        started = time.monotonic() - t0

        def progress(i: int, n: int) -> None:
            if i == n or i % max(1, n // 10) == 0:
                print(f"eval: {i}/{n} rollouts ({time.monotonic() - t0:.0f}s)", file=sys.stderr)

        results = aio.run(evaluate(cfg, urls, progress=progress), subprocesses=True)
    finally:
        sup.stop_all(timeout=20)
    summary = summarize(results)
    report = {
        "policies": cfg.policies,
        "suites": cfg.suites,
        "harnesses": cfg.harnesses,
        "n": cfg.n,
        "tasks": len({r["task"] for r in results}),
        "summary": summary,
        "results": sorted(results, key=lambda r: (r["policy"], r["task"], r["harness"], r["k"])),
        "seconds": {"engines": round(started, 1), "total": round(time.monotonic() - t0, 1)},
    }
    print(format_table(summary, cfg.policies, cfg.harnesses), file=out)
    if cfg.per_task:
        print(per_task_table(results, cfg.policies), file=out)
    print(
        f"{report['tasks']} tasks from {', '.join(cfg.suites)}, n={cfg.n}, "
        f"{len(results)} rollouts in {report['seconds']['total']:.0f}s",
        file=out,
    )
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"results: {cfg.out}", file=out)
    return report


def main(cfg: EvalConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common.aio import setup_logging
    from harnessrl.common.run.supervisor import ChildFailed

    setup_logging(cfg.log_level, "eval")
    try:
        run_eval(cfg)
    except ChildFailed as e:
        print(f"harnessrl eval: an engine did not start: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # ``python -m harnessrl.actors.eval_cmd`` is ``harnessrl eval``
    from harnessrl.common.cli import run_module

    run_module("eval")
