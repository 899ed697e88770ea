"""The weight protocol shared by the learner (which sends weights) and the engines' side
(which receives them): the weight-group sender and its store layout, the HTTP calls of SGLang's
distributed update, and the serialization and stream formats of a weight version.

Formats
-------
* A version's weights are one safetensors blob (``serialize``), the model's ``config.json`` in
  its metadata (``CONFIG_META_KEY``), identified by ``weights_digest`` (``xxh3-128:<hex>``;
  the ``sha256:<hex>`` and bare blake2b-256 digests of releases before still verify).
* ``stream``: the blob cut into chunks (``chunk``: views, no copies) and joined back as they
  arrive, verified by one hash against the ``WeightsReady`` that announces it
  (``ChunkJoiner``, ``join_chunks``, ``IncompleteVersion``), kept as the received chunks
  (``Blob``: no join).
* ``disk``: an HF folder (``write_hf_folder``) written atomically (temp sibling + rename).

Distributed update (SGLang's protocol)
--------------------------------------
``WeightSender`` (rank 0) plus ``init_weight_group`` / ``push_weights_distributed`` implement
what a trainer does against SGLang's ``init_weights_update_group`` /
``update_weights_from_distributed``: the engines join with a ``TCPStore`` client and a process
group under ``group_store`` (``PrefixStore("cpu/" | "cuda/", PrefixStore(group_name + "/"))``),
exactly the store layout ``torch.distributed``'s own group creation uses, so the same sender
talks to SGLang servers and to the embedded engine. ``backend="gloo"`` sends CPU tensors (the
embedded engine); ``backend="nccl"`` sends CUDA tensors (SGLang on GPUs; not exercised without
GPUs).

torch is imported inside functions only: actor machines import ``common`` without torch.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import re
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from harnessrl.common.records import WeightChunk, WeightsReady

CONFIG_META_KEY = "hrl_config_json"
"""safetensors metadata key holding the model's ``config.json`` (stream transport)."""

# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------


DIGEST_PREFIX = "xxh3-128:"
"""``WeightsReady.digest`` names its algorithm. XXH3-128 (``xxhash``): 15 GB/s here against
SHA-256's 1.7 GB/s (on the CPU's SHA extensions) and blake2b's 0.8 GB/s, and the stream path
hashes every byte twice, once on each side (``benchmarks/weight_broadcast.py``). The digest
guards against lost, mixed or corrupted chunks, not against a forger: whoever may publish on
the weights subjects may announce any digest, so a cryptographic hash adds nothing there."""

_HASHERS: dict[str, Any] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Algorithms a ``<name>:<hex>`` digest may name (``sha256``: what earlier learners announce)."""


def weights_hasher(digest: str) -> tuple[Any, str]:
    """A fresh hash object of the algorithm ``digest`` was made with, and the hex digest it
    must end with: ``xxh3-128:<hex>``, ``sha256:<hex>``, or a bare hex digest (blake2b-256, what
    the earliest learners announce); ``IncompleteVersion`` for an algorithm not known here."""
    name, sep, hexdigest = digest.rpartition(":")
    if not sep:
        return hashlib.blake2b(digest_size=32), digest
    if name not in _HASHERS:
        raise IncompleteVersion("unknown_digest", f"digest algorithm {name!r} is not known here")
    return _HASHERS[name](), hexdigest


def weights_digest(data: bytes | bytearray | memoryview) -> str:
    """The digest carried by ``WeightsReady.digest``: ``xxh3-128:<hex>`` of the whole blob."""
    return DIGEST_PREFIX + xxhash.xxh3_128(data).hexdigest()


def retain_freed_memory(nbytes: int) -> bool:
    """Have glibc's malloc keep up to ``nbytes`` of freed heap memory for reuse, and serve
    allocations up to 32 MiB from the heap: a weight version arrives as ~1 MiB messages held
    until it is written, so by default each version is faulted into fresh pages and trimmed
    back to the kernel after it (0.1-0.2 s of system CPU for 256 MB here, a third of the
    receive). With this the next version reuses the last one's pages. Process-wide; True if
    applied (False where the C library is not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library: no lookup
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(
        mallopt(m_trim_threshold, max(0, min(nbytes, 2**31 - 1)))
    )


def serialize(state: dict[str, Any], config_json: str = "") -> bytes:
    """A state dict as safetensors bytes, with the model config in the metadata."""
    from safetensors.torch import save

    meta = {CONFIG_META_KEY: config_json} if config_json else None
    return save({k: v.contiguous() for k, v in state.items()}, metadata=meta)


def safetensors_metadata(data: bytes | bytearray | memoryview | Blob) -> dict[str, str]:
    """The ``__metadata__`` of serialised safetensors bytes (header only, no tensors read)."""
    head = data.head if isinstance(data, Blob) else (lambda n: bytes(data[:n]))
    (n,) = struct.unpack("<Q", head(8))
    return json.loads(head(8 + n)[8:]).get("__metadata__") or {}


def chunk(data: bytes | bytearray | memoryview, size: int) -> list[memoryview]:
    """``data`` cut into views of at most ``size`` bytes (no copy: each view is encoded straight
    into its ``WeightChunk`` message)."""
    view = memoryview(data).cast("B")
    return [view[i : i + size] for i in range(0, len(view), size)] or [view[:0]]


class IncompleteVersion(ValueError):
    """A stream version's chunks are missing, duplicated inconsistently, or fail the digest."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def same_bytes(a: bytes | bytearray | memoryview, b: bytes | bytearray | memoryview) -> bool:
    """Whether two buffers hold the same bytes. Not ``memoryview.__eq__``: that compares
    element by element through the struct module (1.9 ms a MiB here, more than hashing it,
    even for a view compared with itself); this is a vectorised compare (0.1 ms a MiB)."""
    x, y = memoryview(a).cast("B"), memoryview(b).cast("B")
    if len(x) != len(y):
        return False
    return bool(np.array_equal(np.frombuffer(x, np.uint8), np.frombuffer(y, np.uint8)))


class Blob:
    """A stream version's bytes as the chunks they arrived in: views into the received
    messages, in order, never joined (a join is a copy of the whole version into a fresh
    buffer, whose page faults cost more than reading it off the socket: 0.2-0.8 s for 256 MB
    here against 0.25 s to read it). ``write_hf_folder`` writes the parts one after another."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self.parts = list(parts)
        self.nbytes = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes (fewer if the blob is shorter)."""
        out, have = [], 0
        for p in self.parts:
            if have >= n:
                break
            out.append(p[: n - have])
            have += len(out[-1])
        return b"".join(out)


class ChunkJoiner:
    """Collects a stream version's chunks as they arrive, verifying it with one hash.

    ``add`` takes chunks in any order (a publish retried after a lost ack lands later in the
    stream); each one, once every lower index is in, is fed to a single hash
    (``weights_hasher``) and kept as it came (no copy), so the digest check of ``finish`` costs
    no pass over the bytes of its own and the updater can hash while the rest of the version is
    still being read. A chunk index seen twice must carry the same bytes."""

    def __init__(self, ready: WeightsReady) -> None:
        self.ready = ready
        self.hash, self.expected = weights_hasher(ready.digest)
        self.placed: list[memoryview] = []
        """Chunks 0..len-1, in order, hashed."""
        self.waiting: dict[int, Any] = {}
        self.end = 0

    def add(self, chunks: Sequence[WeightChunk]) -> None:
        """Take chunks of ``ready``'s version (others are ignored); ``IncompleteVersion`` on a
        conflicting duplicate, an index out of range or more bytes than announced."""
        n = self.ready.n_chunks
        for c in chunks:
            if c.version != self.ready.version:
                continue
            if not 0 <= c.index < n:
                raise IncompleteVersion("missing_chunks", f"chunk {c.index} of {n} chunks")
            if c.index < len(self.placed):
                same = same_bytes(self.placed[c.index], c.data)
            else:
                held = self.waiting.setdefault(c.index, c.data)
                same = held is c.data or same_bytes(held, c.data)
            if not same:
                raise IncompleteVersion("conflicting_chunks", f"chunk {c.index} differs")
        total = self.ready.total_bytes
        while (data := self.waiting.pop(len(self.placed), None)) is not None:
            view = memoryview(data).cast("B")
            if self.end + len(view) > total:
                raise IncompleteVersion("size_mismatch", f"more than the {total} bytes announced")
            self.hash.update(view)
            self.placed.append(view)
            self.end += len(view)

    def finish(self) -> Blob:
        """The verified bytes, or ``IncompleteVersion``."""
        n, total = self.ready.n_chunks, self.ready.total_bytes
        if len(self.placed) != n:
            have = len(self.placed) + len(self.waiting)
            raise IncompleteVersion("missing_chunks", f"have {have} of {n} chunks")
        if self.end != total:
            raise IncompleteVersion("size_mismatch", f"{self.end} bytes, expected {total}")
        if self.hash.hexdigest() != self.expected:
            raise IncompleteVersion("digest_mismatch", f"{self.hash.name} digest differs")
        return Blob(self.placed)


def join_chunks(ready: WeightsReady, chunks: Sequence[WeightChunk]) -> Blob:
    """The verified bytes of ``ready``'s version, or ``IncompleteVersion`` (`ChunkJoiner`)."""
    joiner = ChunkJoiner(ready)
    joiner.add(chunks)
    return joiner.finish()


_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$")


def write_hf_folder(
    final: Path,
    data: bytes | bytearray | memoryview | Blob,
    base: Path | None = None,
    config_json: str = "",
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
    with open(tmp / "model.safetensors", "wb") as f:
        for part in data.parts if isinstance(data, Blob) else (data,):
            f.write(part)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


# ---------------------------------------------------------------------------------------------
# the weight-update group
# ---------------------------------------------------------------------------------------------


def group_store(store: Any, group_name: str, backend: str = "gloo") -> Any:
    """The store a ``backend`` process group of ``group_name`` uses inside torch.distributed."""
    from torch.distributed import PrefixStore

    device = "cuda" if backend == "nccl" else "cpu"
    return PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", store))


def broadcast(pg: Any, tensor: Any) -> None:
    """Broadcast ``tensor`` from rank 0 over ``pg`` (receive into it on the other ranks)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


class WeightSender:
    """Trainer side (rank 0) of SGLang's distributed weight update, over gloo or nccl.

    Usage: ``sender = WeightSender(world_size=1 + n_engines)`` binds the rendezvous store on a
    free port (``sender.port``); ``await init_weight_group(session, urls, sender)`` makes every
    engine join; ``await push_weights_distributed(session, urls, sender, named, version)`` sends
    a set of tensors (call it per bucket); ``sender.close()`` at the end. The same sender works
    with SGLang servers started with the same backend.
    """

    def __init__(
        self,
        world_size: int = 2,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
        backend: str = "gloo",
    ):
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.world_size = world_size
        self.master_address = master_address
        self.group_name = group_name
        self.backend = backend
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

    def connect(self) -> None:
        """Join the group as rank 0 (blocks until every engine has joined)."""
        import torch.distributed as dist

        store = group_store(self.store, self.group_name, self.backend)
        if self.backend == "nccl":  # pragma: no cover - GPU only
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, 0, self.world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, 0, self.world_size, self.timeout)

    def init_request(self, rank_offset: int = 1) -> dict[str, Any]:
        """The ``/init_weights_update_group`` body for the engine at ``rank_offset``."""
        return {
            "master_address": self.master_address,
            "master_port": self.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }

    def update_request(
        self,
        named: Sequence[tuple[str, Any]],
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """The ``/update_weights_from_distributed`` body announcing ``named``."""
        return {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": self.group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
        }

    def send(self, named: Sequence[tuple[str, Any]]) -> None:
        """Broadcast the tensors in order (the engines receive them in the announced order)."""
        if self.backend == "nccl":  # pragma: no cover - GPU only
            import torch

            for _, t in named:
                broadcast(self.pg, t.detach().contiguous().cuda())
            torch.cuda.synchronize()
            return
        for _, t in named:
            broadcast(self.pg, t.detach().contiguous().cpu())

    def close(self) -> None:
        self.pg = None
        self.store = None


async def init_weight_group(session: Any, urls: Sequence[str], sender: WeightSender) -> None:
    """POST ``/init_weights_update_group`` to every engine while joining as rank 0."""

    async def post(i: int, url: str) -> None:
        async with session.post(
            f"{url}/init_weights_update_group", json=sender.init_request(1 + i)
        ) as r:
            body = await r.json()
            if r.status != 200 or not body.get("success"):
                raise RuntimeError(f"{url}: init_weights_update_group failed: {body}")

    await asyncio.gather(
        asyncio.to_thread(sender.connect), *(post(i, u) for i, u in enumerate(urls))
    )


async def push_weights_distributed(
    session: Any,
    urls: Sequence[str],
    sender: WeightSender,
    named: Sequence[tuple[str, Any]],
    weight_version: str | None = None,
    flush_cache: bool = True,
) -> list[dict[str, Any]]:
    """Announce ``named`` to every engine and broadcast it; return the engines' replies."""
    body = sender.update_request(named, weight_version, flush_cache)

    async def post(url: str) -> dict[str, Any]:
        async with session.post(f"{url}/update_weights_from_distributed", json=body) as r:
            reply = await r.json()
            reply["status"] = r.status
            return reply

    posts = [asyncio.ensure_future(post(u)) for u in urls]
    await asyncio.to_thread(sender.send, named)
    return list(await asyncio.gather(*posts))
