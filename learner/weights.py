"""Weight broadcast: learner-side publishers and the engine-side updater.

Control always travels over the bus: after a step the learner publishes ``WeightsReady`` on
``hrl.<run>.weights.ready`` (msg id ``weights:<version>:ready``). The data plane is one of:

* ``stream`` — the LM state dict serialised as safetensors bytes (the model's ``config.json`` in
  its metadata), cut into ``WeightChunk`` records of at most ``chunk_bytes`` on
  ``hrl.<run>.weights.data.<version>`` (msg ids ``weights:<version>:<i>:<incarnation>``),
  published *before* the WeightsReady that carries ``n_chunks``, ``total_bytes`` and the
  blake2b ``digest``. Only the newest ``keep_versions`` data subjects are kept; older ones are
  purged. The msg ids carry a per-process token because a learner resumed from a checkpoint
  publishes the version numbers of its lost steps again, with other weights (it purges their
  stale chunks first); updaters that already applied a lost version catch up at the next
  version above it.
* ``disk`` — an HF folder ``<dir>/v<version>`` written atomically (temp dir + rename);
  WeightsReady carries its ``path``.
* ``distributed`` — SGLang's ``init_weights_update_group`` once, then per version bucketed
  ``update_weights_from_distributed`` calls while this process (rank 0) broadcasts each bucket
  (gloo against the embedded engine, nccl against SGLang on GPUs); the version travels with
  the last bucket. WeightsReady is still published, as a record.

``WeightUpdater`` (``harnessrl weights-sync``, or built into an engine) consumes WeightsReady in
order and applies the newest waiting version newer than the engine's: for ``stream`` it reads
every chunk of that version, checks count, size and digest, writes an HF folder and calls the
engine's ``update_weights_from_disk`` with the version. **A version that is not completely and
correctly received is never applied** (it is counted and skipped; the engine keeps serving the
previous weights until a complete newer version arrives).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import secrets
import shutil
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from common import metrics
from common.bus import Bus
from common.records import WeightChunk, WeightsReady, encode

log = logging.getLogger("harnessrl.weights")

CONFIG_META_KEY = "hrl_config_json"
"""safetensors metadata key holding the model's ``config.json`` (stream transport)."""

M_BROADCAST_S = metrics.histogram(
    "hrl_learner_broadcast_seconds", "From a new version to its WeightsReady (incl. data plane)"
)
M_BROADCAST_BYTES = metrics.counter("hrl_learner_broadcast_bytes_total", "Weight bytes broadcast")
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


def weights_digest(data: bytes | memoryview) -> str:
    """The digest carried by ``WeightsReady.digest``: blake2b-256, hex."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def serialize(state: dict[str, Any], config_json: str = "") -> bytes:
    """A state dict as safetensors bytes, with the model config in the metadata."""
    from safetensors.torch import save

    meta = {CONFIG_META_KEY: config_json} if config_json else None
    return save({k: v.contiguous() for k, v in state.items()}, metadata=meta)


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of serialised safetensors bytes (header only, no tensors read)."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


def chunk(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


# ---------------------------------------------------------------------------------------------
# learner side
# ---------------------------------------------------------------------------------------------


class WeightPublisher(Protocol):
    """Learner side of one transport."""

    transport: str

    async def publish(self, version: int, step: int, state: dict[str, Any]) -> WeightsReady: ...

    def state(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class _Base:
    transport = "none"

    def __init__(self, bus: Bus, *, dtype: str = "float32", keep: int = 2) -> None:
        self.bus = bus
        self.dtype = dtype
        self.keep = keep
        self.published: list[int] = []

    def state(self) -> dict[str, Any]:
        return {"published": list(self.published)}

    def restore(self, state: dict[str, Any] | None) -> None:
        self.published = list((state or {}).get("published", []))

    async def _announce(self, ready: WeightsReady, msg_id: str | None = None) -> WeightsReady:
        ready.created_at = time.time()
        await self.bus.publish(self.bus.subjects.weights_ready, ready, msg_id)
        return ready

    async def close(self) -> None:
        return None


class StreamPublisher(_Base):
    """``stream``: chunks on the WEIGHTS stream, then WeightsReady; keeps ``keep`` versions."""

    transport = "stream"

    def __init__(
        self,
        bus: Bus,
        *,
        config_json: str = "",
        chunk_bytes: int = 1024 * 1024 - 4096,
        dtype: str = "float32",
        keep: int = 2,
    ) -> None:
        super().__init__(bus, dtype=dtype, keep=keep)
        self.config_json = config_json
        self.chunk_bytes = chunk_bytes
        self.incarnation = secrets.token_hex(3)
        """Suffix of this publisher's msg ids: a learner restarted from a checkpoint re-uses the
        version numbers of the steps it lost, with other weights, which must not be dropped as
        duplicates of the lost ones."""

    async def publish(self, version: int, step: int, state: dict[str, Any]) -> WeightsReady:
        data = await asyncio.to_thread(serialize, state, self.config_json)
        return await self.publish_bytes(version, step, data)

    async def publish_bytes(self, version: int, step: int, data: bytes) -> WeightsReady:
        """Publish already serialised weights (the benchmark's entry point)."""
        t0 = time.perf_counter()
        parts = chunk(data, self.chunk_bytes)
        subject = self.bus.subjects.weights_data(version)
        records = [
            (
                subject,
                encode(
                    WeightChunk(version=version, index=i, n_chunks=len(parts), data=p),
                    compress=False,
                ),
                f"weights:{version}:{i}:{self.incarnation}",
            )
            for i, p in enumerate(parts)
        ]
        await self.bus.publish_many(records)
        ready = WeightsReady(
            version=version,
            step=step,
            transport="stream",
            n_chunks=len(parts),
            total_bytes=len(data),
            digest=await asyncio.to_thread(weights_digest, data),
            dtype=self.dtype,
        )
        await self._announce(ready, f"weights:{version}:ready:{self.incarnation}")
        self.published.append(version)
        await self._purge_old()
        M_BROADCAST_BYTES.inc(len(data))
        M_BROADCAST_S.observe(time.perf_counter() - t0)
        return ready

    async def _purge_old(self) -> None:
        old, self.published = self.published[: -self.keep], self.published[-self.keep :]
        await self.purge(old)

    async def purge(self, versions: Sequence[int]) -> None:
        """Remove the stored chunks of ``versions`` (e.g. of steps lost in a crash, before
        their numbers are published again with other weights)."""
        for v in versions:
            try:
                await self.bus.purge("WEIGHTS", self.bus.subjects.weights_data(v))
            except Exception as e:  # not fatal: the data ages out with the stream's max age
                log.warning("purging weights of version %d failed: %r", v, e)


class DiskPublisher(_Base):
    """``disk``: an HF folder per version under ``root`` (shared with the engines)."""

    transport = "disk"

    def __init__(
        self,
        bus: Bus,
        root: str | Path,
        *,
        model_dir: str | Path | None = None,
        config_json: str = "",
        dtype: str = "float32",
        keep: int = 2,
    ) -> None:
        super().__init__(bus, dtype=dtype, keep=keep)
        self.root = Path(root)
        self.model_dir = Path(model_dir) if model_dir else None
        self.config_json = config_json

    def folder(self, version: int) -> Path:
        return self.root / f"v{version:09d}"

    async def publish(self, version: int, step: int, state: dict[str, Any]) -> WeightsReady:
        t0 = time.perf_counter()
        data = await asyncio.to_thread(serialize, state, self.config_json)
        path = await asyncio.to_thread(
            write_hf_folder, self.folder(version), data, self.model_dir, self.config_json
        )
        ready = WeightsReady(
            version=version,
            step=step,
            transport="disk",
            path=str(path.resolve()),
            total_bytes=len(data),
            digest=weights_digest(data),
            dtype=self.dtype,
        )
        await self._announce(ready)
        self.published.append(version)
        old, self.published = self.published[: -self.keep], self.published[-self.keep :]
        for v in old:
            shutil.rmtree(self.folder(v), ignore_errors=True)
        M_BROADCAST_BYTES.inc(len(data))
        M_BROADCAST_S.observe(time.perf_counter() - t0)
        return ready


class DistributedPublisher(_Base):
    """``distributed``: SGLang's group update, this process as rank 0.

    The group is created on first use (``init_weights_update_group`` on every engine while this
    process joins); a failure tears it down so the next version re-creates it (an engine
    restarted meanwhile is re-joined).
    """

    transport = "distributed"

    def __init__(
        self,
        bus: Bus,
        engines: Sequence[str],
        *,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        bucket_bytes: int = 256 << 20,
        pause: bool = True,
        timeout_s: float = 300.0,
        group_name: str = "",
        dtype: str = "float32",
    ) -> None:
        super().__init__(bus, dtype=dtype, keep=1)
        if not engines:
            raise ValueError("the distributed transport needs at least one engine URL")
        self.engines = [u.rstrip("/") for u in engines]
        self.backend = backend
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.pause = pause
        self.timeout_s = timeout_s
        self.group_name = group_name or f"hrl-{bus.run}"
        self.sender: Any = None
        self.session: Any = None

    async def _connect(self) -> None:
        import aiohttp

        from proxy.engine import init_weight_group

        if self.session is None:
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        cls = NcclWeightSender if self.backend == "nccl" else _gloo_sender()
        self.sender = cls(
            world_size=1 + len(self.engines),
            master_address=self.master_address,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
        )
        await init_weight_group(self.session, self.engines, self.sender)

    async def publish(self, version: int, step: int, state: dict[str, Any]) -> WeightsReady:
        from proxy.engine import push_weights_distributed

        t0 = time.perf_counter()
        try:
            if self.sender is None:
                await self._connect()
            buckets = bucketize(list(state.items()), self.bucket_bytes)
            paused = self.pause and len(buckets) > 1
            if paused:
                await self._post_all("/pause_generation", {"mode": "in_place"})
            try:
                for i, bucket in enumerate(buckets):
                    last = i == len(buckets) - 1
                    replies = await push_weights_distributed(
                        self.session,
                        self.engines,
                        self.sender,
                        bucket,
                        str(version) if last else None,
                    )
                    bad = [r for r in replies if r.get("status") != 200 or not r.get("success")]
                    if bad:
                        raise RuntimeError(f"update_weights_from_distributed failed: {bad[0]}")
            finally:
                if paused:
                    await self._post_all("/continue_generation", {})
        except Exception:
            await self._teardown()
            raise
        total = sum(t.numel() * t.element_size() for t in state.values())
        ready = WeightsReady(
            version=version, step=step, transport="distributed", total_bytes=total, dtype=self.dtype
        )
        await self._announce(ready)
        M_BROADCAST_BYTES.inc(total)
        M_BROADCAST_S.observe(time.perf_counter() - t0)
        return ready

    async def _post_all(self, path: str, body: dict[str, Any]) -> None:
        async def post(url: str) -> None:
            async with self.session.post(url + path, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}{path}: HTTP {r.status}")

        await asyncio.gather(*(post(u) for u in self.engines))

    async def _teardown(self) -> None:
        if self.sender is not None:
            with contextlib.suppress(Exception):
                await self._post_all(
                    "/destroy_weights_update_group", {"group_name": self.group_name}
                )
            self.sender.close()
            self.sender = None

    async def close(self) -> None:
        await self._teardown()
        if self.session is not None:
            await self.session.close()
            self.session = None


def bucketize(named: list[tuple[str, Any]], bucket_bytes: int) -> list[list[tuple[str, Any]]]:
    """Consecutive tensors grouped into buckets of about ``bucket_bytes`` (at least one each)."""
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out if out[-1] else out[:-1]


def _gloo_sender() -> type:
    from proxy.engine import GlooWeightSender

    return GlooWeightSender


class NcclWeightSender:
    """Rank 0 of SGLang's weight-update group over NCCL (GPU learners against SGLang).

    Same protocol and store layout as ``proxy.engine.GlooWeightSender`` (``torch.distributed``'s
    own: ``PrefixStore("cuda/", PrefixStore(group_name + "/", store))``), with a
    ``ProcessGroupNCCL`` and CUDA tensors. Not exercised without GPUs.
    """

    def __init__(
        self,
        world_size: int = 2,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
    ) -> None:  # pragma: no cover - GPU only
        import datetime

        import torch.distributed as dist

        self.world_size = world_size
        self.master_address = master_address
        self.group_name = group_name
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=True,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        self.port = int(self.store.port)
        self.pg: Any = None

    def connect(self) -> None:  # pragma: no cover - GPU only
        import torch.distributed as dist

        store = dist.PrefixStore("cuda/", dist.PrefixStore(f"{self.group_name}/", self.store))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        self.pg = dist.ProcessGroupNCCL(store, 0, self.world_size, opts)

    def init_request(self, rank_offset: int = 1) -> dict[str, Any]:
        return {
            "master_address": self.master_address,
            "master_port": self.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": "nccl",
        }

    def update_request(
        self,
        named: Sequence[tuple[str, Any]],
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        return {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": self.group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }

    def send(self, named: Sequence[tuple[str, Any]]) -> None:  # pragma: no cover - GPU only
        import torch
        import torch.distributed as dist

        for _, t in named:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.rootTensor = 0
            self.pg.broadcast([t.detach().contiguous().cuda()], opts).wait()
        torch.cuda.synchronize()

    def close(self) -> None:
        self.pg = None
        self.store = None


def make_publisher(
    cfg: Any,
    bus: Bus,
    *,
    model_dir: Path | None,
    config_json: str,
    dtype: str,
    default_disk_dir: Path,
) -> WeightPublisher | None:
    """The publisher a ``BroadcastConfig`` asks for (None for ``transport = "none"``)."""
    if cfg.transport == "stream":
        return StreamPublisher(
            bus,
            config_json=config_json,
            chunk_bytes=cfg.chunk_bytes,
            dtype=dtype,
            keep=cfg.keep_versions,
        )
    if cfg.transport == "disk":
        root = Path(cfg.disk_dir) if cfg.disk_dir else default_disk_dir
        return DiskPublisher(
            bus,
            root,
            model_dir=model_dir,
            config_json=config_json,
            dtype=dtype,
            keep=cfg.keep_versions,
        )
    if cfg.transport == "distributed":
        return DistributedPublisher(
            bus,
            cfg.engines,
            backend=cfg.backend,
            master_address=cfg.master_address,
            bucket_bytes=cfg.bucket_mb << 20,
            pause=cfg.pause,
            timeout_s=cfg.timeout_s,
            dtype=dtype,
        )
    return None


# ---------------------------------------------------------------------------------------------
# HF folders
# ---------------------------------------------------------------------------------------------

_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$")


def write_hf_folder(
    final: Path, data: bytes, base: Path | None = None, config_json: str = ""
) -> Path:
    """Write ``model.safetensors`` (+ ``config.json``, + the non-weight files of ``base``) into
    ``final`` atomically: a temp sibling renamed into place."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if base is not None and base.is_dir():
        for f in base.iterdir():
            if f.is_file() and not _WEIGHT_FILES.match(f.name):
                shutil.copy2(f, tmp / f.name)
    config_json = config_json or safetensors_metadata(data).get(CONFIG_META_KEY, "")
    if config_json:
        (tmp / "config.json").write_text(config_json)
    (tmp / "model.safetensors").write_bytes(data)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


# ---------------------------------------------------------------------------------------------
# engine side: the updater
# ---------------------------------------------------------------------------------------------

ApplyFn = Callable[[str, int], Awaitable[None]]
"""``apply(model_path, version)``: load an HF folder into the engine as ``version``."""


class IncompleteVersion(ValueError):
    """A stream version's chunks are missing, duplicated inconsistently, or fail the digest."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def join_chunks(ready: WeightsReady, chunks: Sequence[WeightChunk]) -> bytes:
    """The verified bytes of ``ready``'s version, or ``IncompleteVersion``."""
    by_index: dict[int, bytes] = {}
    for c in chunks:
        if c.version != ready.version:
            continue
        if c.index in by_index and by_index[c.index] != c.data:
            raise IncompleteVersion("conflicting_chunks", f"chunk {c.index} differs")
        by_index[c.index] = c.data
    n = ready.n_chunks
    if sorted(by_index) != list(range(n)):
        raise IncompleteVersion("missing_chunks", f"have {len(by_index)} of {n} chunks")
    data = b"".join(by_index[i] for i in range(n))
    if len(data) != ready.total_bytes:
        raise IncompleteVersion("size_mismatch", f"{len(data)} bytes, expected {ready.total_bytes}")
    if weights_digest(data) != ready.digest:
        raise IncompleteVersion("digest_mismatch", "blake2b digest differs")
    return data


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
        ack_wait: float = 120.0,
        label: str = "",
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
                write_hf_folder, self.work_dir / f"v{ready.version:09d}", data, self.base_model
            )
        await self._apply(str(path), ready.version)
        self._applied(ready.version, t0)
        if ready.transport == "stream":
            await asyncio.to_thread(self._clean_local)
        return True

    async def receive(self, ready: WeightsReady) -> bytes | None:
        """All chunks of a stream version, verified; None (counted) if incomplete."""
        subject = self.bus.subjects.weights_data(ready.version)
        err: IncompleteVersion | None = None
        for attempt in range(self.read_retries + 1):
            chunks = await self.bus.read_subject(subject, WeightChunk)
            try:
                return await asyncio.to_thread(join_chunks, ready, chunks)
            except IncompleteVersion as e:
                err = e
            if attempt < self.read_retries:
                await asyncio.sleep(self.retry_delay_s)
        assert err is not None
        self.rejected[ready.version] = err.reason
        M_SYNC_REJECTED.labels(engine=self.label, reason=err.reason).inc()
        log.warning("version %d not applied: %s", ready.version, err)
        return None

    def _applied(self, version: int, t0: float) -> None:
        self.applied_version = version
        M_SYNC_VERSION.labels(engine=self.label).set(version)
        M_SYNC_SECONDS.labels(engine=self.label).observe(time.perf_counter() - t0)
        log.info("applied weight version %d (%.2f s)", version, time.perf_counter() - t0)

    def _clean_local(self) -> None:
        folders = sorted(p for p in self.work_dir.glob("v*") if p.is_dir())
        for p in folders[: -self.keep_local]:
            shutil.rmtree(p, ignore_errors=True)
