"""``harnessrl rollout``: run one rollout by hand and print its score and its tree.

    harnessrl rollout --suite S --task ID (--harness NAME | --harness-cmd '…') --engine URL
                      [--nats URL] [--sandbox bwrap|docker] [--keep-workspace DIR] [--json]

``--task`` may be a task folder path (then ``--suite`` is not needed). The rollout runs exactly
as an actor runs it (``harnessrl.actors.rollout.run_rollout``, same settings); without ``--nats`` an
embedded nats-server is started in a temp dir for the CallRecords. The calls are then read back
from the bus and assembled with ``harnessrl.common.tree.assemble``, as the assembler would.

While it runs, a progress line goes to stderr every 2 s (elapsed, model calls, tokens
generated, the last call's prompt/output size and finish reason); ``--quiet`` turns them off.

The RolloutResult is printed, not published: a rollout run by hand never becomes a training
sample, even when ``--nats`` points at a live run.

Exit status (`EXIT_STATUS`): 0 the rollout was scored (status ``ok``); 1 it ended in an
infrastructure failure (any other status: ``engine_error``, ``harness_error``, ...), with
``harnessrl rollout: STATUS (REASON): ERROR`` on stderr (when no engine answers ``/health``
the rollout is refused at once as ``engine_error (engine_unreachable)``; a bus that refuses
the credential or the publishes and reads is ``bus_error`` — ``cannot_connect``,
``permission_denied`` naming the role needed, ``records_not_stored``); 2 bad arguments — a
missing or unknown task, suite or harness, contradicting flags — refused in well under a
second, before any nats-server, engine check, sandbox or proxy is started. Every failure is
that one line, never a traceback; with ``--json`` a failure without a rollout result is one
object on stdout too: ``status``, ``reason``, ``error``, ``exit``.

``--json`` prints one object: ``rollout_id``, ``task``, ``harness``, ``harness_version``,
``status``, ``reason``, ``reward``, ``metrics``, ``n_calls``, ``durations``, ``error``,
``harness_exit``, ``timed_out``, ``workspace``, ``harness_stderr`` and ``harness_stdout``
(their tails), ``verifier_output``, ``tree`` {``n_calls``, ``n_leaves``, ``dropped``,
``truncated_calls``, ``unique_tokens``, ``expanded_tokens``, ``model_tokens``,
``tito_misses``, ``false_forks``, ``n_nodes``, ``dropped_reason``}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import logging
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harnessrl.actors.config import RolloutConfig

CONFIG = RolloutConfig
SECTION = "rollout"

log = logging.getLogger("harnessrl.rollout")

EXIT_STATUS = (
    "exit status: 0 the rollout was scored (status ok); 1 an infrastructure failure (any other "
    "status, printed on stderr as STATUS (REASON): ERROR; with --json also a JSON object on "
    "stdout); 2 bad arguments (unknown task, suite or harness; contradicting flags), refused "
    "before anything starts"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    g = parser.add_argument_group("the rollout")
    g.add_argument("--suite", default="", help="suite name or folder (omit with a task folder)")
    g.add_argument("--task", default="", help="task id within the suite, or a task folder")
    g.add_argument("--harness", default="", help="harness adapter (default: reference)")
    g.add_argument(
        "--harness-cmd",
        default="",
        metavar="CMD",
        help="command line run by the 'command' harness (implies --harness command)",
    )
    g.add_argument(
        "--timeout", type=float, default=0.0, metavar="S", help="harness wall-clock limit, s"
    )
    g.add_argument(
        "--keep-workspace", type=Path, metavar="DIR", help="copy the final workspace to DIR"
    )
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines on stderr (by default one every 2 s: elapsed, calls, tokens)",
    )


def _harness(args: argparse.Namespace) -> str:
    return args.harness or ("command" if args.harness_cmd else "reference")


def bad_arguments(args: argparse.Namespace) -> str:
    """Why the arguments can never make a rollout ("" when they can): checked before anything
    starts. Names the bad value and what exists."""
    from harnessrl.actors.harnesses import ADAPTERS, unknown_harness

    if not args.task:
        return "--task ID (or a task folder) is required"
    harness = _harness(args)
    if harness not in ADAPTERS:
        return unknown_harness(harness)
    if args.harness_cmd and harness != "command":
        return "--harness-cmd goes with --harness command"
    if harness == "command" and not args.harness_cmd.strip():
        return "--harness command needs --harness-cmd 'COMMAND LINE'"
    keep = args.keep_workspace
    if keep is not None and keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
        return f"{keep} exists and is not an empty folder"
    return _task_problem(args.suite, args.task)


def _task_problem(suite: str, task_id: str) -> str:
    """Why ``task_id`` (of ``suite``, or a folder) cannot be loaded, as the rollout loads it."""
    from harnessrl.common.tasks import TaskError, load_task, load_task_path, suite_dir

    try:
        load_task(suite, task_id) if suite else load_task_path(task_id)
        return ""
    except TaskError as e:
        why = str(e)
    if not suite:
        return f"{why} (give a task folder, or --suite SUITE --task ID)"
    try:
        root = suite_dir(suite)
    except TaskError:
        return why  # names the unknown suite and the known ones
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name[0] not in "._")
    near = difflib.get_close_matches(task_id, names, n=5, cutoff=0.5) or names[:5]
    more = f" ({len(names)} in all: harnessrl tasks list {suite})" if len(names) > len(near) else ""
    return f"unknown task {task_id!r} in suite {suite!r}; nearest: {', '.join(near)}{more}"


def _request(args: argparse.Namespace) -> Any:
    from harnessrl.common.records import TaskRequest

    harness = _harness(args)
    return TaskRequest(
        group_id="manual" + secrets.token_hex(4),
        k=0,
        group_size=1,
        issued_version=0,
        task_id=args.task,
        suite=args.suite,
        harness=harness,
        harness_cmd=args.harness_cmd,
        timeout_s=args.timeout,
    )


def progress_line(elapsed: float, calls: list[Any]) -> str:
    """One progress line: elapsed time, model calls so far, tokens in the last prompt and
    generated in all, and how the last call ended."""
    from harnessrl.common.records import unpack_ids

    done = [c for c in calls if c.status == "ok"]
    out = sum(len(unpack_ids(c.output_ids)) for c in done)
    last = ""
    if calls:
        c = calls[-1]
        why = c.finish_reason or c.status
        last = f", last: {c.label} {c.input_len} in / {len(unpack_ids(c.output_ids))} out ({why})"
    return f"rollout: {elapsed:5.1f}s, {len(calls)} calls, {out} tokens generated{last}"


async def progress(bus: Any, rid: str, every: float = 2.0, out: Any = None) -> None:
    """Print `progress_line` to stderr every ``every`` seconds while the rollout runs (reads
    the rollout's CallRecords back from the bus, as the assembler would)."""
    from harnessrl.common.records import CallRecord

    out = out or sys.stderr
    t0 = time.monotonic()
    subject = bus.subjects.calls(rid)
    while True:
        await asyncio.sleep(every)
        calls = await bus.read_subject(subject, CallRecord)
        print(progress_line(time.monotonic() - t0, calls), file=out, flush=True)


async def rollout(cfg: RolloutConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Run the rollout and assemble its tree; the report as a JSON-able dict."""
    from harnessrl.actors.rollout import RolloutDeps, RolloutReport, run_rollout
    from harnessrl.common.bus import BusConnectError, BusError, PermissionDenied, connect
    from harnessrl.common.natsauth import ACTOR_PREFIX, ROLES
    from harnessrl.common.natsd import NatsServer
    from harnessrl.common.records import CallRecord, rollout_id
    from harnessrl.common.tree import assemble

    req = _request(args)
    with contextlib.ExitStack() as stack:
        url = cfg.nats
        if not url:
            store = stack.enter_context(tempfile.TemporaryDirectory(prefix="hrl-rollout-nats-"))
            url = stack.enter_context(NatsServer(store)).url
        try:
            bus = await connect(
                url, cfg.run, name="harnessrl rollout", creds=cfg.nats_creds, ca=cfg.nats_ca
            )
        except BusError as e:  # the run's streams missing and not ours to create, say
            if isinstance(e, BusConnectError):
                raise
            raise BusConnectError(str(e)) from None
        role = getattr(bus, "user", "")
        if role.startswith(ACTOR_PREFIX):  # an actor's own credential
            role = "actor"
        if role != "admin" and (role in ROLES or role == "actor"):  # refused before anything runs
            await bus.close()
            raise PermissionDenied(f"this credential is the {role!r} role's")
        try:
            watch = None
            if not getattr(args, "quiet", False):
                watch = asyncio.create_task(progress(bus, rollout_id(req.group_id, req.k, 1)))
            try:
                async with RolloutDeps.open(cfg, bus, actor="rollout") as deps:
                    report = RolloutReport()
                    res = await run_rollout(
                        req, 1, deps, keep_workspace=args.keep_workspace, report=report
                    )
            finally:
                if watch is not None:
                    watch.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watch
            calls = await bus.read_subject(bus.subjects.calls(res.rollout_id), CallRecord)
        finally:
            await bus.close()
    sample = assemble(calls, res)
    c = sample.counters
    return {
        "rollout_id": res.rollout_id,
        "task": report.task.name if report.task is not None else req.task_id,
        "harness": res.harness,
        "harness_version": res.harness_version,
        "status": res.status,
        "reason": res.reason,
        "reward": res.reward,
        "metrics": res.metrics,
        "n_calls": res.n_calls,
        "durations": res.durations,
        "error": res.error,
        "harness_exit": report.harness_exit,
        "timed_out": report.timed_out,
        "workspace": str(report.workspace) if report.workspace is not None else None,
        "harness_stderr": report.harness_stderr,
        "harness_stdout": report.harness_stdout,
        "verifier_output": report.verifier_output,
        "tree": {
            "n_calls": c.n_calls,
            "n_leaves": c.n_leaves,
            "dropped": dict(c.dropped),
            "truncated_calls": c.truncated_calls,
            "unique_tokens": c.unique_tokens,
            "expanded_tokens": c.expanded_tokens,
            "model_tokens": c.model_tokens,
            "tito_misses": c.tito_misses,
            "false_forks": c.false_forks,
            "n_nodes": len(sample.nodes),
            "dropped_reason": sample.dropped_reason,
        },
    }


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report."""
    version = f" {r['harness_version']}" if r.get("harness_version") else ""
    lines = [f"rollout {r['rollout_id']}: {r['task']} with {r['harness']}{version}"]
    reason = f" ({r['reason']})" if r.get("reason") else ""
    status = r["status"] + reason + (f" — {r['error']}" if r["error"] else "")
    lines.append(f"  status   {status}")
    if r["status"] == "ok":
        lines.append(f"  reward   {r['reward']:.4f}")
    for name, v in sorted(r["metrics"].items()):
        lines.append(f"    {name:<24} {v:.4f}")
    exit_ = r["harness_exit"]
    exited = "never ran" if exit_ is None else f"exit {exit_}" + (" (timeout)" * r["timed_out"])
    lines.append(f"  harness  {exited}, {r['n_calls']} model calls")
    lines.append("  seconds  " + ", ".join(f"{k} {v:.2f}" for k, v in r["durations"].items()))
    t = r["tree"]
    lines.append(
        f"  tree     {t['n_calls']} calls, {t['n_leaves']} leaves, {t['n_nodes']} nodes, "
        f"{t['unique_tokens']} unique / {t['expanded_tokens']} expanded tokens, "
        f"{t['model_tokens']} model tokens, {t['tito_misses']} TITO misses, "
        f"{t['false_forks']} false forks, {t['truncated_calls']} cut at max tokens"
    )
    if t["dropped"]:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(t["dropped"].items()))
        lines.append(f"           dropped: {dropped}")
    if t["dropped_reason"]:
        lines.append(f"           no sample: {t['dropped_reason']}")
    if r["workspace"]:
        lines.append(f"  workspace kept in {r['workspace']}")
    for stream in ("stderr", "stdout"):
        text = r.get(f"harness_{stream}") or ""
        if r["status"] != "ok" and text:
            lines.append(f"  harness {stream} (tail):")
            lines.extend("    " + ln for ln in text.splitlines()[-20:])
    return "\n".join(lines)


def failure_line(r: dict[str, Any]) -> str:
    """The one stderr line of a failed rollout: status, reason and error."""
    reason = f" ({r['reason']})" if r.get("reason") else ""
    error = " ".join(str(r.get("error") or "no error text").split())
    return f"harnessrl rollout: {r['rollout_id']} {r['status']}{reason}: {error}"


async def engines_down(urls: list[str], timeout: float = 5.0) -> list[str]:
    """The engines that do not answer ``/health`` within ``timeout`` (all of them: the rollout
    cannot call the model, so it is refused at once instead of letting the harness retry each
    call against a dead engine for minutes)."""
    import asyncio

    from harnessrl.proxy.sglang import EngineClient

    async def down(url: str) -> bool:
        async with EngineClient(url) as client:
            return not await client.health(retries=0, timeout=timeout)

    flags = await asyncio.gather(*(down(u) for u in urls))
    return [u for u, d in zip(urls, flags, strict=True) if d]


def main(cfg: RolloutConfig, args: argparse.Namespace) -> int:
    from harnessrl.common.aio import StartupError, run, setup_logging
    from harnessrl.common.bus import BusError, PermissionDenied

    bad = bad_arguments(args)
    if bad:
        return failed(args, 2, "bad_arguments", "", bad)
    setup_logging(cfg.log_level, "rollout")
    down = run(engines_down(cfg.engines))
    if len(down) == len(cfg.engines):
        why = f"no engine answers /health at {', '.join(down)}"
        return failed(args, 1, "engine_error", "engine_unreachable", why)
    try:
        report = run(rollout(cfg, args), subprocesses=True)
    except PermissionDenied as e:
        return failed(args, 1, "bus_error", "permission_denied", f"{e}. {NEEDS_ADMIN}")
    except StartupError as e:  # the server refused the credential, or it cannot be read
        return failed(args, 1, "bus_error", "cannot_connect", unprefixed(str(e)))
    except (BusError, TimeoutError) as e:
        return failed(args, 1, "bus_error", "records_not_stored", str(e))
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(format_report(report))
    if report["status"] != "ok":
        print(failure_line(report), file=sys.stderr, flush=True)
        return 1
    return 0


NEEDS_ADMIN = (
    "harnessrl rollout records the rollout's calls and reads them back (as an actor and the "
    "assembler do): on a secured nats-server it needs the admin credential (--nats-creds "
    "<auth>/admin.cred)"
)


def failed(args: argparse.Namespace, code: int, status: str, reason: str, error: str) -> int:
    """A rollout that failed before it had a result: one line on stderr and, with ``--json``,
    one object on stdout (``status``, ``reason``, ``error``, ``exit``); returns ``code``."""
    error = " ".join(error.split())
    if getattr(args, "json", False):
        obj = {"status": status, "reason": reason, "error": error, "exit": code}
        print(json.dumps(obj, sort_keys=True), flush=True)
    why = f"{status} ({reason})" if reason else ""
    print(f"harnessrl rollout: {why + ': ' if why else ''}{error}", file=sys.stderr, flush=True)
    return code


def unprefixed(message: str) -> str:
    """``message`` without a leading ``harnessrl rollout:`` (the bus names its client so)."""
    prefix = "harnessrl rollout:"
    return message[len(prefix) :].strip() if message.startswith(prefix) else message


if __name__ == "__main__":  # ``python -m harnessrl.actors.rollout_cmd`` is ``harnessrl rollout``
    from harnessrl.common.cli import run_module

    run_module("rollout")
