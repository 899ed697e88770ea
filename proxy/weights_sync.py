"""Weight sync, engine side: apply the versions the learner broadcasts to one engine.

``WeightUpdater`` (``harnessrl weights-sync``, or built into an engine) consumes WeightsReady in
order and applies the newest waiting version newer than the engine's: for ``stream`` it reads
every chunk of that version, checks count, size and digest, writes an HF folder and calls the
engine's ``update_weights_from_disk`` with the version; for ``disk`` it hands the folder's path
itself to the engine; a ``distributed`` version was already pushed by the learner and is only
recorded. **A version that is not completely and correctly received is never applied** (it is
counted and skipped; the engine keeps serving the previous weights until a complete newer
version arrives). The formats are ``harnessrl.common.weights``; the publishers are ``harnessrl.learner.weights``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harnessrl.common import lifecycle, metrics
from harnessrl.common.bus import Bus
from harnessrl.common.layout import weights_folder
from harnessrl.common.records import WeightChunk, WeightsReady
from harnessrl.common.weights import (
    Blob,
    ChunkJoiner,
    IncompleteVersion,
    retain_freed_memory,
    write_hf_folder,
)
from harnessrl.proxy.config import WeightSyncConfig

log = logging.getLogger("harnessrl.weights")

M_SYNC_VERSION = metrics.gauge(
    "hrl_weights_sync_version", "Weight version the updater last applied", ("engine",)
)
M_SYNC_SECONDS = metrics.histogram(
    "hrl_weights_sync_seconds", "Receive + verify + write + apply of one version", ("engine",)
)
M_SYNC_REJECTED = metrics.counter(
    "hrl_weights_sync_rejected_total", "Versions never applied, by reason", ("engine", "reason")
)
M_SYNC_SKIPPED = metrics.counter(
    "hrl_weights_sync_skipped_total",
    "Versions skipped (older, or superseded while waiting)",
    ("engine",),
)


ApplyFn = Callable[[str, int], Awaitable[None]]
"""``apply(model_path, version)``: load an HF folder into the engine as ``version``."""


def engine_apply(client: Any) -> ApplyFn:
    """An ``ApplyFn`` for an ``EngineClient`` (SGLang ``update_weights_from_disk``)."""

    async def apply(path: str, version: int) -> None:
        await client.update_weights_from_disk(path, weight_version=version)

    return apply


def durable_name(engine_url: str) -> str:
    """A consumer name derived from an engine URL (``http://h:30000`` -> ``weights-sync-h_30000``)."""
    base = re.sub(r"^[a-z]+://", "", engine_url).rstrip("/")
    return "weights-sync-" + (re.sub(r"[^A-Za-z0-9_-]", "_", base) or "engine")


class WeightUpdater:
    """Applies broadcast versions to one engine, newest first, never a partial one.

    ``applied_version`` starts at the engine's current version (pass it in); versions at or
    below it are skipped. Usable as a library (``poll``/``apply``) or as a loop (``run``).
    """

    def __init__(
        self,
        bus: Bus,
        apply: ApplyFn,
        work_dir: str | Path,
        *,
        durable: str,
        applied_version: int = -1,
        keep_local: int = 2,
        base_model: str | Path | None = None,
        read_retries: int = 3,
        retry_delay_s: float = 0.5,
        ack_wait: float = 10.0,
        label: str = "",
        read_batch: int = 16,
        retain_memory: bool = True,
    ) -> None:
        self.bus = bus
        self._apply = apply
        self.work_dir = Path(work_dir)
        self.durable = durable
        self.applied_version = applied_version
        self.keep_local = keep_local
        self.base_model = Path(base_model) if base_model else None
        self.read_retries = read_retries
        self.retry_delay_s = retry_delay_s
        self.ack_wait = ack_wait
        self.label = label or durable
        self.read_batch = read_batch
        """Chunks fetched per request while reading a stream version (each batch is hashed
        while the next is on its way)."""
        self.retain_memory = retain_memory
        """Before reading a stream version, have malloc keep a version's worth of freed memory
        (`harnessrl.common.weights.retain_freed_memory`, process-wide): each version then lands in the
        pages of the one before instead of fresh ones (receive 0.34-0.38 s -> 0.25-0.29 s for
        256 MB here)."""
        self._retained = 0
        self.consumer: Any = None
        self.rejected: dict[int, str] = {}
        """Versions never applied, with the reason."""

    async def start(self) -> None:
        if self.consumer is None:
            self.consumer = await self.bus.consumer(
                "WEIGHTS",
                self.durable,
                WeightsReady,
                filter_subject=self.bus.subjects.weights_ready,
                ack_wait=self.ack_wait,
            )

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """``poll`` until ``stop`` is set (or forever)."""
        await self.start()
        while stop is None or not stop.is_set():
            try:
                await self.poll(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the engine or the bus is away: try again
                log.warning("weight update failed: %r; retrying", e)
                await asyncio.sleep(1.0)

    async def poll(self, timeout: float = 1.0) -> int | None:
        """Fetch waiting WeightsReady records and apply the newest newer one; return the
        version applied (None if none was)."""
        await self.start()
        got = await self.consumer.fetch(64, timeout=timeout)
        if not got:
            return None
        newest = max(got, key=lambda d: d.record.version)
        for d in got:
            if d is not newest:
                M_SYNC_SKIPPED.labels(engine=self.label).inc()
                await d.ack()
        if newest.record.version <= self.applied_version:
            M_SYNC_SKIPPED.labels(engine=self.label).inc()
            await newest.ack()
            return None
        try:
            async with newest.keepalive():
                ok = await self.apply(newest.record)
        except Exception:
            with contextlib.suppress(Exception):
                await newest.nak(delay=1.0)
            raise
        await newest.ack()
        return newest.record.version if ok else None

    async def apply(self, ready: WeightsReady) -> bool:
        """Receive, verify and apply one version; False if it was rejected (never applied)."""
        t0 = time.perf_counter()
        if ready.transport == "distributed":  # already pushed by the learner
            self._applied(ready.version, t0)
            return True
        if ready.transport == "disk":
            path = Path(ready.path)
        else:
            data = await self.receive(ready)
            if data is None:
                return False
            path = await asyncio.to_thread(
                write_hf_folder, weights_folder(self.work_dir, ready.version), data, self.base_model
            )
        await self._apply(str(path), ready.version)
        self._applied(ready.version, t0)
        if ready.transport == "stream":
            await asyncio.to_thread(self._clean_local)
        return True

    async def receive(self, ready: WeightsReady) -> Blob | None:
        """All chunks of a stream version, verified; None (counted) if incomplete."""
        err: IncompleteVersion | None = None
        for attempt in range(self.read_retries + 1):
            try:
                return await self._read_version(ready)
            except IncompleteVersion as e:
                err = e
            if attempt < self.read_retries:
                await asyncio.sleep(self.retry_delay_s)
        assert err is not None
        self.rejected[ready.version] = err.reason
        M_SYNC_REJECTED.labels(engine=self.label, reason=err.reason).inc()
        log.warning("version %d not applied: %s", ready.version, err)
        return None

    async def _read_version(self, ready: WeightsReady) -> Blob:
        """Read a version's chunks, hashing each batch in a worker thread while
        the next one is fetched (`ChunkJoiner`)."""
        if self.retain_memory and ready.total_bytes > self._retained:
            self._retained = ready.total_bytes
            retain_freed_memory(ready.total_bytes)
        subject = self.bus.subjects.weights_data(ready.version)
        joiner = ChunkJoiner(ready)
        work: asyncio.Future[None] | None = None
        try:
            async with contextlib.aclosing(
                self.bus.read_subject_batches(subject, WeightChunk, batch=self.read_batch)
            ) as batches:
                async for chunks in batches:
                    if work is not None:
                        await work
                    work = asyncio.ensure_future(asyncio.to_thread(joiner.add, chunks))
        finally:
            if work is not None:
                await work
        return joiner.finish()

    def _applied(self, version: int, t0: float) -> None:
        self.applied_version = version
        M_SYNC_VERSION.labels(engine=self.label).set(version)
        M_SYNC_SECONDS.labels(engine=self.label).observe(time.perf_counter() - t0)
        log.info("applied weight version %d (%.2f s)", version, time.perf_counter() - t0)

    def _clean_local(self) -> None:
        folders = sorted(p for p in self.work_dir.glob("v*") if p.is_dir())
        for p in folders[: -self.keep_local]:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the ``harnessrl weights-sync`` process
# ---------------------------------------------------------------------------------------------


async def serve(cfg: WeightSyncConfig) -> int:
    """Apply every broadcast version to ``cfg.engine`` until SIGTERM or Ctrl-C (which stop it
    without waiting for an unreachable NATS); 1 if the engine never became healthy."""
    from harnessrl.proxy.engine.auth import client_key
    from harnessrl.proxy.sglang import EngineClient

    key = client_key(cfg.engine_api_key_file)

    async def body(proc: lifecycle.Process) -> int:
        client = EngineClient(cfg.engine, api_key=key)
        try:
            if not await _wait_healthy(client, cfg, proc.stop):
                print(f"harnessrl weights-sync: engine {cfg.engine} not healthy", file=sys.stderr)
                return 1
            applied = await client.weight_version()
            updater = WeightUpdater(
                proc.bus,
                engine_apply(client),
                cfg.work_dir,
                durable=f"weights-sync-{cfg.name}" if cfg.name else durable_name(cfg.engine),
                applied_version=applied,
                keep_local=cfg.keep_local,
                base_model=cfg.base_model or None,
                read_retries=cfg.read_retries,
                ack_wait=cfg.ack_wait,
                label=cfg.engine,
            )
            print(f"weights-sync: {cfg.engine} at version {applied}", file=sys.stderr, flush=True)
            await updater.run(proc.stop)
            return 0
        finally:
            await client.close()

    return await lifecycle.serve(cfg, f"weights-sync {cfg.name or cfg.engine}", body)


async def load_once(cfg: WeightSyncConfig) -> int:
    """Load the folder ``cfg.load`` into the engine as ``cfg.load_version``, once (no NATS):
    0 once the engine serves it, 1 with a one-line error naming the engine and the folder."""
    from harnessrl.proxy.engine.auth import client_key
    from harnessrl.proxy.sglang import EngineClient, EngineError

    client = EngineClient(cfg.engine, api_key=client_key(cfg.engine_api_key_file))
    what = f"harnessrl weights-sync: engine {cfg.engine}"
    try:
        if not await _wait_healthy(client, cfg, asyncio.Event()):
            print(f"{what} not healthy; {cfg.load} not loaded", file=sys.stderr)
            return 1
        try:
            await client.update_weights_from_disk(
                cfg.load, weight_version=cfg.load_version, abort_all_requests=False
            )
        except EngineError as e:
            msg = " ".join(str(e).split())
            print(f"{what} did not load {cfg.load}: {msg}", file=sys.stderr)
            return 1
        loaded = f"weights-sync: {cfg.engine} loaded {cfg.load} as version {cfg.load_version}"
        print(loaded, file=sys.stderr, flush=True)
        return 0
    finally:
        await client.close()


async def _wait_healthy(client: Any, cfg: WeightSyncConfig, stop: asyncio.Event) -> bool:
    """Wait up to ``engine_wait_s`` for the engine's ``/health``; False if it never answered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.engine_wait_s
    while not await client.health(retries=0, timeout=5.0):
        if loop.time() > deadline or stop.is_set():
            return False
        await asyncio.sleep(1.0)
    return True
