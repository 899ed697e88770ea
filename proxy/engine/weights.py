"""Engine side of the weight updates: membership in a trainer's distributed weight-update group,
dtype names, and ``load_state_dict`` (a folder's safetensors; ``/update_weights_from_disk``
reads and checks a folder with ``Engine.read_weights``).

The engine joins a trainer's group with a ``TCPStore`` client and a ``ProcessGroupGloo`` under
the store layout of ``harnessrl.common.weights.group_store`` (``torch.distributed``'s own), so a trainer
written against SGLang (``init_custom_process_group``-style), or ``harnessrl.common.weights.WeightSender``,
talks to this engine unchanged. The HTTP endpoints that drive them live in
``harnessrl.proxy.engine.server``; the swap itself happens in the scheduler thread.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path

import torch

from harnessrl.common.models import resolve_model
from harnessrl.common.weights import broadcast, group_store
from harnessrl.proxy.engine.requests import BadRequest


def _parse_dtype(name: str) -> torch.dtype:
    n = name.removeprefix("torch.")
    dt = getattr(torch, n, None)
    if not isinstance(dt, torch.dtype):
        raise BadRequest(f"unknown dtype {name!r}")
    return dt


class _WeightGroup:
    """The engine's membership (rank ``rank_offset``) in a trainer's weight-update group."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int, name: str, timeout: float):
        import torch.distributed as dist

        td = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=td)
        self.pg = dist.ProcessGroupGloo(group_store(self.store, name), rank, world_size, td)

    def receive(self, dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        out = []
        for dt, shape in zip(dtypes, shapes, strict=True):
            t = torch.empty(tuple(shape), dtype=_parse_dtype(dt))
            broadcast(self.pg, t)
            out.append(t)
        return out

    def close(self) -> None:
        self.pg = None
        self.store = None


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A model folder's safetensors as one state dict (helper for tests and trainers)."""
    from safetensors.torch import load_file

    folder = resolve_model(path)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
