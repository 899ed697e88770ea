"""The learner fleet: N data-parallel ranks that rank 0 drives over one control channel.

Rank 0 runs the learner service (feeder, ledger, bus, checkpoint commits, broadcast); every
other rank runs ``LearnerEngine.follow``: it waits for rank 0's next command and does its part.
A command is one exchange on a gloo group of its own (``Fleet.call``)::

    rank 0: scatter (op, each rank's args) -> do its own part -> gather every rank's result
    rank r: receive (op, its args)         -> do its part      -> send its result

What must stay true:

* Every rank runs the same commands in the same order, so each enters every DeepSpeed
  collective of a step (gradient all-reduce, ZeRO-3 parameter gathers), of a broadcast gather
  and of a checkpoint save together.
* Rank 0's gather is a barrier: when ``call`` returns, every rank has finished its part (a
  checkpoint's shards are written and fsynced before rank 0 commits it).
* A rank that dies fails the others' next collective (gloo reports the closed connection at
  once); one that hangs fails it after ``timeout_s``. Either way ``call`` raises
  ``FleetBroken``, every later ``call`` raises at once, and nothing is committed: the fleet
  exits and ``--resume`` continues from the last commit. While rank 0 waits for data it pings
  (``keepalive``), so idle followers never reach the timeout and a dead one is seen within
  ``ping_s``.

Row sharding (``shard_rows``) is contiguous and padded so every rank gets the same number of
rows: ZeRO-3 gathers parameters in every forward, so all ranks must run as many micro-batches.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("harnessrl.learner.fleet")

STOP = "stop"


class FleetBroken(RuntimeError):
    """A learner rank died or timed out; the fleet cannot take another step."""


def world() -> tuple[int, int]:
    """(rank, world size) from a torchrun/deepspeed launcher's environment; (0, 1) alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def shard_rows(n_rows: int, n_ranks: int) -> list[list[int]]:
    """Row indices of each rank: contiguous blocks of ``ceil(n_rows / n_ranks)``; each row goes
    to exactly one rank (the last ranks may get fewer, possibly none: they are padded)."""
    per = -(-n_rows // n_ranks)
    return [list(range(r * per, min((r + 1) * per, n_rows))) for r in range(n_ranks)]


class Fleet:
    """The control channel between the learner ranks (a gloo group; torch.distributed is
    already initialised by DeepSpeed)."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = timeout_s
        self.ping_s = max(0.5, min(30.0, timeout_s / 4))
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.broken: BaseException | None = None
        self.stopped = False
        self._last = time.monotonic()

    def call(self, op: str, args: list[tuple[Any, ...]], run: Callable[..., Any]) -> list[Any]:
        """Rank 0: have rank r run ``run(op, *args[r])``; every rank's result (rank 0's own
        never crosses the wire). Raises ``FleetBroken`` when a rank fails."""
        if self.broken is not None:
            raise FleetBroken(f"a learner rank failed earlier: {self.broken}")
        if self.stopped:
            raise FleetBroken("the fleet was stopped")
        dist = self.dist
        try:
            box: list[Any] = [None]
            dist.scatter_object_list(box, [(op, a) for a in args], src=0, group=self.group)
            mine = run(op, *args[0])
            results: list[Any] = [None] * self.world
            dist.gather_object(None, results, dst=0, group=self.group)
        except Exception as e:
            self.broken = e
            raise FleetBroken(f"learner fleet failed during {op!r}: {e}") from e
        self._last = time.monotonic()
        results[0] = mine
        return results

    def serve(self, run: Callable[..., Any]) -> None:
        """Rank r > 0: run rank 0's commands until it says stop (raises if rank 0 is gone)."""
        dist = self.dist
        while True:
            box: list[Any] = [None]
            dist.scatter_object_list(box, None, src=0, group=self.group)
            op, args = box[0]
            out = None if op == STOP else run(op, *args)
            dist.gather_object(out, None, dst=0, group=self.group)
            if op == STOP:
                self._shutdown()
                return

    def all_reduce_sum(self, *tensors: Any) -> None:
        """Sum CPU tensors over the ranks in place (inside a command every rank runs)."""
        for t in tensors:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, group=self.group)

    def keepalive(self, run: Callable[..., Any]) -> None:
        """Rank 0 while idle: ping when the channel has been quiet for ``ping_s``."""
        if time.monotonic() - self._last >= self.ping_s:
            self.call("ping", [()] * self.world, run)

    def stop(self) -> None:
        """Rank 0 at exit: release the followers (nothing to do once broken)."""
        if self.broken is not None or self.stopped:
            return
        try:
            self.call(STOP, [()] * self.world, lambda op: None)
        except FleetBroken as e:
            log.warning("could not stop the other ranks: %s", e)
        else:
            self._shutdown()
        self.stopped = True

    def _shutdown(self) -> None:
        """After a clean stop, on every rank: tear the process groups down now, so that no
        collective thread is still alive when the interpreter exits (a rank then died of
        SIGABRT, "terminate called without an active exception", once in three CI runs)."""
        try:
            self.dist.destroy_process_group()
        except Exception as e:  # already gone: nothing to tear down
            log.debug("destroying the process groups: %r", e)
