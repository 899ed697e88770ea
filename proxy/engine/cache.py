"""KV memory of the embedded engine: the slot pool of running requests and the prefix cache.

KV pool
-------
KV lives in a slot pool (one tensor ``[layers, 2, slots, kv_heads, cap, head_dim]``); slot ``i``
is row ``i``, so the decode batch reads the KV of every running request as one strided view.
The scheduler compacts slots when requests finish, so the decode batch is dense.

Prefix cache
------------
LRU entries ``(token ids, KV)`` bounded by ``prefix_cache_mb``. An entry is written when a
request's prefill completes and when a request ends (input + output minus the last token); an
entry that is a prefix of a new one is dropped (the new one covers it). A request reuses the
longest common prefix of its input with any entry (at least one token is always recomputed, for
its logits) and reports it as ``cached_tokens``. A request whose prompt shares a long prefix
with one being prefilled waits for that prefill to land in the cache (GRPO groups send the same
long prompt n times at once).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from harnessrl.common import metrics as m

_MIN_CAP = 256  # smallest KV capacity per slot, tokens
_SHRINK_BYTES = 64 << 20  # a KV pool smaller than this keeps its memory

M_CACHE_BYTES = m.gauge("hrl_engine_prefix_cache_bytes", "Bytes held by the prefix cache.")


# ---------------------------------------------------------------------------------------------
# KV slot pool
# ---------------------------------------------------------------------------------------------


class KVPool:
    """KV of the requests holding a slot: one tensor ``[layers, 2, rows, kv_heads, cap, dim]``.

    Slot ``i`` is row ``i``; rows are contiguous, so the decode batch reads the KV of every
    running request as one strided view. ``rows`` (up to ``slots``) and ``cap`` (up to
    ``max_len``) grow by doubling as requests arrive and lengthen, and shrink once the pool is
    big and mostly unused. Unused positions hold finite values (zeros or stale KV), which the
    attention masks ignore (NaN garbage would leak through a mask: 0 * NaN = NaN).
    """

    def __init__(
        self,
        layers: int,
        heads: int,
        dim: int,
        slots: int,
        dtype: Any,
        max_len: int,
        device: Any = "cpu",
    ):
        self.dims = (layers, heads, dim)
        self.slots = slots
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_len = max_len
        self.kv = self._alloc(1, min(_MIN_CAP, max_len))
        self.free = list(range(slots))

    def _alloc(self, rows: int, cap: int) -> torch.Tensor:
        layers, heads, dim = self.dims
        return torch.zeros(layers, 2, rows, heads, cap, dim, dtype=self.dtype, device=self.device)

    @property
    def rows(self) -> int:
        return self.kv.shape[2]

    @property
    def cap(self) -> int:
        return self.kv.shape[4]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def fit(self, rows: int, length: int, shrink: bool = False) -> None:
        """Make room for slots ``< rows`` and positions ``< length`` (which must cover all
        the KV in use); with ``shrink``, give memory back when the pool is mostly unused."""
        new_rows, new_cap = self.rows, self.cap
        if rows > new_rows:
            new_rows = min(self.slots, max(rows, 2 * new_rows))
        while new_cap < length:
            new_cap *= 2
        if shrink and self.nbytes > _SHRINK_BYTES:
            if rows * 2 <= new_rows:
                new_rows = max(rows, 1)
            if length * 4 <= new_cap:
                new_cap = max(_MIN_CAP, 1 << max(2 * length - 1, 1).bit_length())
        new_cap = min(new_cap, self.max_len)
        if (new_rows, new_cap) == (self.rows, self.cap):
            return
        kv = self._alloc(new_rows, new_cap)
        r, c = min(self.rows, new_rows), min(self.cap, new_cap)
        kv[:, :, :r, :, :c] = self.kv[:, :, :r, :, :c]
        self.kv = kv

    def alloc(self) -> int:
        self.free.sort()
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def read(self, slot: int, n: int) -> torch.Tensor:
        """A contiguous copy ``[layers, 2, heads, n, dim]`` of a slot's first ``n`` positions."""
        return self.kv[:, :, slot, :, :n].clone()

    def write(self, slot: int, kv: torch.Tensor, n: int) -> None:
        self.kv[:, :, slot, :, :n] = kv[:, :, :, :n]

    def move(self, src: int, dst: int, n: int) -> None:
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]


# ---------------------------------------------------------------------------------------------
# Prefix cache
# ---------------------------------------------------------------------------------------------


@dataclass
class _CacheEntry:
    tokens: np.ndarray
    kv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.tokens.nbytes


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """LRU map from token prefixes to their KV, bounded in bytes.

    Invariant: no entry's tokens are a prefix of another entry's tokens (the longer one serves
    every lookup the shorter one would), so memory goes to distinct branches.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.entries: collections.OrderedDict[int, _CacheEntry] = collections.OrderedDict()
        self.nbytes = 0
        self._next = 0

    def lookup(self, tokens: np.ndarray, limit: int) -> tuple[_CacheEntry | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and that length (<= limit)."""
        best, best_n = None, 0
        for key, e in self.entries.items():
            if len(e.tokens) and len(tokens) and e.tokens[0] == tokens[0]:
                n = min(_lcp(e.tokens, tokens), limit)
                if n > best_n:
                    best, best_n = key, n
        if best is None:
            return None, 0
        self.entries.move_to_end(best)
        return self.entries[best], best_n

    def insert(self, tokens: np.ndarray, read_kv: Any) -> bool:
        """Add ``tokens`` (KV from ``read_kv()``, called only if it will be stored)."""
        if self.capacity <= 0 or len(tokens) < 2:
            return False
        covered = []
        for key, e in self.entries.items():
            n = _lcp(e.tokens, tokens)
            if n == len(tokens):  # an entry already covers it
                self.entries.move_to_end(key)
                return False
            if n == len(e.tokens):
                covered.append(key)
        for key in covered:
            self._drop(key)
        entry = _CacheEntry(tokens.copy(), read_kv())
        if entry.nbytes > self.capacity:
            return False
        while self.nbytes + entry.nbytes > self.capacity and self.entries:
            self._drop(next(iter(self.entries)))
        self.entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        M_CACHE_BYTES.set(self.nbytes)
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
        M_CACHE_BYTES.set(self.nbytes)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
        M_CACHE_BYTES.set(0)
