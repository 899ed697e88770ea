"""Redelivery after a consumer process dies: how long the task of a SIGKILLed actor waits
before another actor gets it.

    python -m benchmarks.redelivery [--quick]

A consumer process (``python -m benchmarks.redelivery --hold URL RUN ACK_WAIT HEARTBEAT``)
binds the actors' durable consumer on TASKS (which the trial made with ``ACK_WAIT``, as the
learner's feeder does), takes one task and keeps it
alive with ``in_progress`` heartbeats every ``HEARTBEAT`` s, exactly as an actor does with a
running rollout (``Delivery.keepalive``). Half a heartbeat after it took the task (the average
phase of a death) it is SIGKILLed; another consumer pulls from the same durable, and the
latency runs from the kill to the redelivery. Every trial has its own run (streams) on one
nats-server; the trials of a case run at once.

Cases:

* ``defaults``: today's task consumer (``[learner.feeder] task_ack_wait_s``, which the
  learner gives it; actors heartbeat every third of it);
* ``old_defaults`` (full runs only: a minute each): the previous 60 s ``ack_wait`` and 20 s
  heartbeats, after which chaos runs saw the learner idle for 51-61 s;
* baseline ``graceful``, same run: the same consumer stopped with SIGTERM, which nak's its task
  as a stopping actor does (the floor a SIGKILL can only approach).

Target (reported, not asserted): redelivery after a SIGKILL within 15 s with the defaults; full
runs also report how many times faster than with the old defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
import time
import uuid

from benchmarks._common import parse_args, print_table, target, write_result

OLD_ACK_WAIT_S, OLD_HEARTBEAT_S = 60.0, 20.0
"""The defaults before the task consumer's ack_wait was shortened to seconds."""
TARGET_S = 15.0
DURABLE = "actors"


async def hold(url: str, run: str, ack_wait: float, heartbeat: float) -> None:
    """The consumer process: take one task, keep it alive; SIGTERM nak's it and exits."""
    from harnessrl.common.bus import connect
    from harnessrl.common.records import TaskRequest

    bus = await connect(url, run)
    consumer = await bus.bind_consumer("TASKS", DURABLE, TaskRequest)
    got: list = []
    while not got:
        got = await consumer.fetch(1, timeout=1.0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("held", flush=True)
    async with got[0].keepalive(heartbeat):
        await stop.wait()
    await got[0].nak()
    await bus.close()


async def trial(url: str, ack_wait: float, heartbeat: float, sig: int) -> float:
    """Seconds from killing a consumer that holds a task to its redelivery."""
    from harnessrl.common.bus import connect
    from harnessrl.common.records import TaskRequest

    run = "b" + uuid.uuid4().hex[:10]
    bus = await connect(url, run)
    await bus.ensure_consumer("TASKS", DURABLE, ack_wait=ack_wait)  # as the learner does
    task = TaskRequest(group_id="g", k=0, group_size=1, issued_version=0, task_id="t")
    await bus.publish(bus.subjects.tasks, task)
    argv = [sys.executable, "-m", "benchmarks.redelivery", "--hold", url, run]
    proc = await asyncio.create_subprocess_exec(
        *argv, str(ack_wait), str(heartbeat), stdout=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)  # type: ignore[union-attr]
        assert line.startswith(b"held"), line
        await asyncio.sleep(heartbeat / 2)
        other = await bus.bind_consumer("TASKS", DURABLE, TaskRequest)
        proc.send_signal(sig)
        t_kill = time.monotonic()
        got: list = []
        while not got:
            got = await other.fetch(1, timeout=1.0)
        latency = time.monotonic() - t_kill
        await got[0].term()
        return latency
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        await bus.close()


async def measure(url: str, n: int, ack_wait: float, heartbeat: float, sig: int) -> list[float]:
    return list(await asyncio.gather(*(trial(url, ack_wait, heartbeat, sig) for _ in range(n))))


def stats(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "mean_s": round(statistics.mean(xs), 2), "max_s": round(max(xs), 2)}


async def main(quick: bool) -> dict[str, dict[str, float]]:
    from harnessrl.common.natsd import NatsServer
    from harnessrl.learner.config import FeederConfig

    wait = FeederConfig().task_ack_wait_s
    beat = wait / 3  # an actor's default: a third of the consumer's ack_wait
    n = 2 if quick else 5
    with tempfile.TemporaryDirectory() as d, NatsServer(d) as server:
        url = server.url
        out = {
            "graceful": stats(await measure(url, n, wait, beat, signal.SIGTERM)),
            "defaults": stats(await measure(url, n, wait, beat, signal.SIGKILL)),
        }
        if not quick:
            old = await measure(url, 3, OLD_ACK_WAIT_S, OLD_HEARTBEAT_S, signal.SIGKILL)
            out["old_defaults"] = stats(old)
    out["defaults"]["ack_wait_s"] = wait
    out["defaults"]["heartbeat_s"] = round(beat, 3)
    return out


def run(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--hold":
        url, run_name, ack_wait, heartbeat = sys.argv[2:6]
        asyncio.run(hold(url, run_name, float(ack_wait), float(heartbeat)))
        return
    args = parse_args(__doc__.splitlines()[0], argv)
    res = asyncio.run(main(args.quick))
    rows = [(k, str(v["n"]), f"{v['mean_s']:.2f}", f"{v['max_s']:.2f}") for k, v in res.items()]
    print_table("redelivery after a consumer dies", rows, ("case", "n", "mean s", "max s"))
    ratios = {}
    if "old_defaults" in res:
        ratios["old_over_new"] = round(res["old_defaults"]["mean_s"] / res["defaults"]["mean_s"], 2)
        print(f"\nold defaults / defaults: {ratios['old_over_new']}x")
    metrics = {k: v for k, v in res.items() if k != "graceful"}
    targets = {"sigkill_redelivery_s": target(res["defaults"]["max_s"], TARGET_S, at_least=False)}
    path = write_result(
        "redelivery",
        metrics,
        {"graceful": res["graceful"]},
        targets,
        ratios=ratios,
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    run()
