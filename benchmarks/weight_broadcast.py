"""Weight broadcast: MB/s of the ``stream`` transport against a plain in-process copy.

The stream path, measured end to end on a real nats-server: the learner serialises a state
dict (safetensors), publishes it as <= 1 MiB WeightChunk records plus WeightsReady
(``StreamPublisher``); the updater reads every chunk back, checks count, size and digest and
writes the HF folder (``WeightUpdater.receive`` + ``write_hf_folder``). Applying it to an engine
is not included (that is the engine's load time, the same for every transport).

Baseline in the same run: a plain in-process copy of the same bytes (``bytearray(data)``),
the floor for moving them at all. Also reported: the ``disk`` path (write the HF folder, read it
back) on the same bytes.

Target (reported, not asserted): the stream path moves >= 100 MB/s end to end on this machine.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._common import parse_args, print_table, target, write_result
from common.bus import connect
from common.layout import weights_folder
from common.natsd import NatsServer
from common.weights import serialize, write_hf_folder
from learner.weights import StreamPublisher
from proxy.weights_sync import WeightUpdater


def make_state(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors of about ``mb`` MB, shaped like transformer layers."""
    g = torch.Generator().manual_seed(seed)
    per = 1024 * 1024  # 4 MiB tensors
    n = max(1, mb * 1_000_000 // (4 * per))
    return {f"model.layers.{i}.w": torch.randn(1024, 1024, generator=g) for i in range(n)}


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


async def stream_round(nats_url: str, data: bytes, work: Path, version: int) -> dict[str, float]:
    bus = await connect(nats_url, "benchweights")
    pub = StreamPublisher(bus, keep=2)
    calls: list[tuple[str, int]] = []

    async def apply(path: str, v: int) -> None:
        calls.append((path, v))

    upd = WeightUpdater(bus, apply, work, durable="bench", read_retries=0)
    t0 = time.perf_counter()
    ready = await pub.publish_bytes(version, version, data)
    t1 = time.perf_counter()
    got = await upd.receive(ready)
    t2 = time.perf_counter()
    assert got is not None and len(got) == len(data)
    await asyncio.to_thread(write_hf_folder, weights_folder(work, version), got)
    t3 = time.perf_counter()
    await bus.close()
    return {
        "publish_s": t1 - t0,
        "receive_verify_s": t2 - t1,
        "write_s": t3 - t2,
        "total_s": t3 - t0,
        "n_chunks": ready.n_chunks,
    }


async def bench(nats_url: str, mb: int, rounds: int) -> dict:
    state = make_state(mb)
    t0 = time.perf_counter()
    data = serialize(state)
    ser_s = time.perf_counter() - t0
    size = len(data)
    copy_s = best_of(5, lambda: bytearray(data))
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        runs = [await stream_round(nats_url, data, work / "sync", v) for v in range(1, rounds + 1)]
        disk_s = best_of(
            2,
            lambda: (
                write_hf_folder(work / "disk", data),
                (work / "disk/model.safetensors").read_bytes(),
            ),
        )
    best = min(runs, key=lambda r: r["total_s"])
    mbs = size / 1e6
    return {
        "bytes": size,
        "n_chunks": best["n_chunks"],
        "serialize_MB_s": mbs / ser_s,
        "stream_publish_MB_s": mbs / best["publish_s"],
        "stream_receive_verify_MB_s": mbs / best["receive_verify_s"],
        "stream_write_MB_s": mbs / best["write_s"],
        "stream_end_to_end_MB_s": mbs / best["total_s"],
        "stream_end_to_end_s": best["total_s"],
        "disk_write_read_MB_s": mbs / disk_s,
        "memcpy_MB_s": mbs / copy_s,
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    mb, rounds = (32, 2) if args.quick else (256, 3)
    with tempfile.TemporaryDirectory() as d, NatsServer(d) as srv:
        m = asyncio.run(bench(srv.url, mb, rounds))
    ratio = m["stream_end_to_end_MB_s"] / m["memcpy_MB_s"]
    print_table(
        f"weight broadcast: {m['bytes'] / 1e6:.0f} MB fp32 state, {m['n_chunks']} chunks",
        [
            ("in-process copy (baseline)", f"{m['memcpy_MB_s']:.0f}"),
            ("serialise (safetensors)", f"{m['serialize_MB_s']:.0f}"),
            ("stream: publish chunks + ready", f"{m['stream_publish_MB_s']:.0f}"),
            ("stream: read + verify chunks", f"{m['stream_receive_verify_MB_s']:.0f}"),
            ("stream: write HF folder", f"{m['stream_write_MB_s']:.0f}"),
            ("stream: end to end", f"{m['stream_end_to_end_MB_s']:.0f}"),
            ("disk: write folder + read back", f"{m['disk_write_read_MB_s']:.0f}"),
        ],
        ("path", "MB/s"),
    )
    print(f"\nstream end to end / in-process copy: {ratio:.4f}")
    path = write_result(
        "weight_broadcast",
        m,
        {"memcpy_MB_s": m["memcpy_MB_s"]},
        {"stream_end_to_end_MB_s": target(m["stream_end_to_end_MB_s"], 100.0)},
        ratios={"stream_vs_memcpy": ratio},
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
