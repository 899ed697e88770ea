"""Bus throughput: publish/consume N realistic CallRecords through the JetStream bus.

Baselines measured in the same run against the same nats-server:
* raw nats-py ``publish_async`` of the very same encoded bytes, all acks gathered at the end
  (the floor for publish cost; it is given the records already encoded, the bus encodes and
  zstd-frames them itself);
* a naive JSON-of-lists encoding of the same records (bytes per token on the wire).

Also one record per call, each ack awaited before the next (how a proxy records calls at
concurrency 1): the bus's CPU per record against raw nats-py ``publish_async`` + await of the
same record, encoded by ``records.encode`` (``one_at_a_time_cpu_vs_raw``, reported).

Raw and bus publish alternate for ``ROUNDS`` rounds (the stream purged between them, not
timed); ``publish_vs_raw`` is the median of the rounds' ratios. Target (reported, not
asserted): ``publish_vs_raw`` >= 0.9. Also reported: ``publish_bytes_vs_raw``, the bus given
the encoded bytes too (its transport overhead alone), and the cost of encoding alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time

import numpy as np

from benchmarks._common import parse_args, print_table, proc_cpu_s, target, write_result
from harnessrl.common import records as r
from harnessrl.common.bus import connect
from harnessrl.common.natsd import NatsServer

SUFFIX, OUTPUT = 2000, 300


def make_records(n: int, seed: int = 0) -> list[r.CallRecord]:
    """CallRecords shaped like a real harness call: 2k-token input delta, 300 sampled tokens."""
    rng = np.random.default_rng(seed)
    # token frequencies follow Zipf's law over a 151k vocabulary, but a token's id is not its
    # frequency rank: map ranks through a fixed permutation
    vocab = rng.permutation(151_000).astype("<i4")
    recs = []
    for i in range(n):
        suffix = vocab[np.minimum(rng.zipf(1.3, SUFFIX), 150_999)]
        out = vocab[np.minimum(rng.zipf(1.3, OUTPUT), 150_999)]
        lps = -rng.exponential(0.7, OUTPUT).astype("<f4")
        recs.append(
            r.CallRecord(
                rollout_id=f"bench-{i % 64}-1",
                seq=i,
                parent_seq=i - 1,
                prefix_len=8000 + i,
                suffix_ids=suffix.tobytes(),
                input_len=8000 + i + SUFFIX,
                input_hash=r.ids_hash(suffix),
                output_ids=out.tobytes(),
                output_logprobs=lps.tobytes(),
                finish_reason="stop",
                weight_version_start=3,
                weight_version_end=3,
                t_start=time.time(),
                t_end=time.time(),
            )
        )
    return recs


def json_encoding(rec: r.CallRecord) -> bytes:
    d = {
        f: getattr(rec, f)
        for f in rec.__struct_fields__
        if f not in ("suffix_ids", "output_ids", "output_logprobs", "input_hash", "sampling")
    }
    d["suffix_ids"] = r.unpack_ids(rec.suffix_ids).tolist()
    d["output_ids"] = r.unpack_ids(rec.output_ids).tolist()
    d["output_logprobs"] = [float(x) for x in r.unpack_f32(rec.output_logprobs)]
    d["input_hash"] = rec.input_hash.hex()
    return json.dumps(d).encode()


ROUNDS = 3


async def cpu_of(coro, server_pid: int) -> tuple[float, float, float]:
    """``(wall, this process's CPU, the server's CPU)`` seconds of running ``coro``: where a
    publish path's CPU goes, so a ratio can be read against the machine's cores."""
    c0, s0, t0 = time.process_time(), proc_cpu_s(server_pid), time.perf_counter()
    await coro
    return (
        time.perf_counter() - t0,
        time.process_time() - c0,
        proc_cpu_s(server_pid) - s0,
    )


async def raw_publish(js, subjects, recs, encoded) -> float:
    """Seconds for raw nats-py ``publish_async`` of pre-encoded records, acks gathered."""
    t0 = time.perf_counter()
    futs = [
        await js.publish_async(subjects.calls(x.rollout_id), b, headers={"Nats-Msg-Id": x.msg_id()})
        for x, b in zip(recs, encoded, strict=True)
    ]
    await asyncio.gather(*futs)
    return time.perf_counter() - t0


async def bus_publish(bus, recs, payloads=None, chunk: int = 512) -> float:
    """Seconds for ``Bus.publish_many`` of the records (or of their encoded ``payloads``)."""
    t0 = time.perf_counter()
    for i in range(0, len(recs), chunk):
        part = recs[i : i + chunk]
        data = payloads[i : i + chunk] if payloads is not None else part
        await bus.publish_many(
            [
                (bus.subjects.calls(x.rollout_id), d, x.msg_id())
                for x, d in zip(part, data, strict=True)
            ]
        )
    return time.perf_counter() - t0


async def one_at_a_time(b, recs, raw: bool) -> float:
    """CPU seconds per record (this process: the server excluded) publishing ``recs`` one call
    each, every ack awaited before the next (a proxy recording calls at concurrency 1): through
    ``publish_many`` of one record, or raw nats-py ``publish_async`` of its encoded bytes."""
    js = b.js  # type: ignore[attr-defined]
    t0 = time.process_time()
    for x in recs:
        subject = b.subjects.calls(x.rollout_id)
        if raw:
            fut = await js.publish_async(subject, r.encode(x), headers={"Nats-Msg-Id": x.msg_id()})
            await fut
        else:
            await b.publish_many([(subject, x, x.msg_id())])
    return (time.process_time() - t0) / len(recs)


async def bench(n: int, nats_url: str, server_pid: int) -> dict:
    recs = make_records(n)
    t0 = time.perf_counter()
    encoded = [r.encode(x) for x in recs]
    encode_s = time.perf_counter() - t0
    tokens = n * (SUFFIX + OUTPUT)
    wire = sum(len(b) for b in encoded)
    json_bytes = sum(len(json_encoding(x)) for x in recs)

    bytes_s = []
    cpu: dict[str, list[tuple[float, float, float]]] = {"raw": [], "bus": []}
    for k in range(ROUNDS):  # alternate, so that load on the machine hits both alike
        # a fresh run (streams) per pass: a msg id seen before would be a cheap duplicate
        async with await connect(nats_url, f"raw{k}") as b:
            js = b.js  # type: ignore[attr-defined]
            cpu["raw"].append(await cpu_of(raw_publish(js, b.subjects, recs, encoded), server_pid))
            await b.purge("CALLS")
        async with await connect(nats_url, f"bus{k}") as b:
            cpu["bus"].append(await cpu_of(bus_publish(b, recs), server_pid))
            await b.purge("CALLS")
        async with await connect(nats_url, f"bytes{k}") as b:
            bytes_s.append(await bus_publish(b, recs, encoded))
            await b.purge("CALLS")
    one_raw, one_bus = [], []
    for k in range(ROUNDS):
        for raw, out in ((True, one_raw), (False, one_bus)):
            async with await connect(nats_url, f"one{raw}{k}") as b:
                out.append(await one_at_a_time(b, recs[: min(n, 400)], raw))
                await b.purge("CALLS")
    bus = await connect(nats_url, "benchbus")
    await bus_publish(bus, recs)  # stored for the consume pass below

    # sequential publish (one round trip each): what a naive publisher gets
    seq_n = min(n, 500)
    bus2 = await connect(nats_url, "benchseq")
    t0 = time.perf_counter()
    for x in recs[:seq_n]:
        await bus2.publish(bus2.subjects.calls(x.rollout_id), x)
    seq_s = time.perf_counter() - t0
    await bus2.close()

    # consume: durable pull consumer, decode, ack
    cons = await bus.consumer("CALLS", "bench", r.CallRecord, filter_subject=bus.subjects.all_calls)
    got = 0
    t0 = time.perf_counter()
    while got < n:
        batch = await cons.fetch(256, timeout=2.0)
        if not batch:
            break
        await asyncio.gather(*(d.ack() for d in batch))
        got += len(batch)
    cons_s = time.perf_counter() - t0
    await bus.close()
    raw_s, bus_s = ([wall for wall, _, _ in cpu[k]] for k in ("raw", "bus"))
    ratios = [r_ / b_ for r_, b_ in zip(raw_s, bus_s, strict=True)]

    def cpu_row(runs: list[tuple[float, float, float]]) -> dict[str, float]:
        wall, mine, srv = (statistics.median(x[i] for x in runs) for i in range(3))
        return {
            "client_cpu_us_per_record": mine / n * 1e6,
            "server_cpu_us_per_record": srv / n * 1e6,
            "cores_busy": (mine + srv) / wall,
        }

    cpu_rows = {k: cpu_row(v) for k, v in cpu.items()}
    total = {
        k: v["client_cpu_us_per_record"] + v["server_cpu_us_per_record"]
        for k, v in cpu_rows.items()
    }
    bytes_ratios = [r_ / b_ for r_, b_ in zip(raw_s, bytes_s, strict=True)]
    return {
        "n": n,
        "rounds": ROUNDS,
        "record_bytes_mean": wire / n,
        "bus_publish_rec_s": n / statistics.median(bus_s),
        "bus_publish_MB_s": wire / statistics.median(bus_s) / 1e6,
        "bus_publish_encoded_rec_s": n / statistics.median(bytes_s),
        "raw_publish_async_rec_s": n / statistics.median(raw_s),
        "raw_publish_async_MB_s": wire / statistics.median(raw_s) / 1e6,
        "encode_only_rec_s": n / encode_s,
        "publish_vs_raw_rounds": ratios,
        "publish_bytes_vs_raw_rounds": bytes_ratios,
        "cpu": {
            **cpu_rows,
            "cores": os.cpu_count(),
            # with every core busy, throughput follows CPU per record (client + server): the
            # ratio the bus can reach at best on this machine, encoding included
            "cpu_bound_publish_vs_raw": total["raw"] / total["bus"],
        },
        "sequential_publish_rec_s": seq_n / seq_s,
        "one_at_a_time_cpu_us": {
            "bus": [x * 1e6 for x in one_bus],
            "raw": [x * 1e6 for x in one_raw],
            "bus_vs_raw_rounds": [b_ / r_ for b_, r_ in zip(one_bus, one_raw, strict=True)],
        },
        "consume_rec_s": got / cons_s,
        "consume_MB_s": wire * got / n / cons_s / 1e6,
        "consumed": got,
        "bytes_per_token": wire / tokens,
        "json_bytes_per_token": json_bytes / tokens,
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n = 2000 if args.quick else 20000
    with tempfile.TemporaryDirectory() as d, NatsServer(d) as srv:
        m = asyncio.run(bench(n, srv.url, srv.pid))
    pub_ratio = statistics.median(m["publish_vs_raw_rounds"])
    bytes_ratio = statistics.median(m["publish_bytes_vs_raw_rounds"])
    size_ratio = m["json_bytes_per_token"] / m["bytes_per_token"]
    one = m["one_at_a_time_cpu_us"]
    one_ratio = statistics.median(one["bus_vs_raw_rounds"])
    print_table(
        f"bus throughput: {n} CallRecords ({SUFFIX}-token suffix + {OUTPUT} output tokens), "
        f"median of {ROUNDS} rounds",
        [
            (
                "bus publish_many (encodes)",
                f"{m['bus_publish_rec_s']:.0f}",
                f"{m['bus_publish_MB_s']:.1f}",
            ),
            ("bus publish_many (encoded bytes)", f"{m['bus_publish_encoded_rec_s']:.0f}", "-"),
            (
                "raw nats-py publish_async",
                f"{m['raw_publish_async_rec_s']:.0f}",
                f"{m['raw_publish_async_MB_s']:.1f}",
            ),
            ("encode alone (msgpack + zstd)", f"{m['encode_only_rec_s']:.0f}", "-"),
            ("bus publish (sequential)", f"{m['sequential_publish_rec_s']:.0f}", "-"),
            (
                "one record per publish_many, acked (CPU us/record: bus / raw)",
                f"{statistics.median(one['bus']):.0f} / {statistics.median(one['raw']):.0f}",
                "-",
            ),
            ("bus consume + ack", f"{m['consume_rec_s']:.0f}", f"{m['consume_MB_s']:.1f}"),
        ],
        ("path", "records/s", "MB/s"),
    )
    print(
        f"\nbytes/token: msgpack+packed {m['bytes_per_token']:.2f} vs JSON "
        f"{m['json_bytes_per_token']:.2f} ({size_ratio:.1f}x smaller); publish vs raw: "
        f"{pub_ratio:.2f} (rounds {', '.join(f'{x:.2f}' for x in m['publish_vs_raw_rounds'])}); "
        f"encoded bytes vs raw: {bytes_ratio:.2f}"
    )
    c = m["cpu"]
    print(
        "CPU us/record (client + nats-server), cores busy: "
        + "; ".join(
            f"{k} {c[k]['client_cpu_us_per_record']:.0f} + {c[k]['server_cpu_us_per_record']:.0f}"
            f", {c[k]['cores_busy']:.2f} of {c['cores']}"
            for k in ("raw", "bus")
        )
        + f"; CPU-bound publish vs raw: {c['cpu_bound_publish_vs_raw']:.2f}"
    )
    path = write_result(
        "bus_throughput",
        m,
        {
            "raw_publish_async_rec_s": m["raw_publish_async_rec_s"],
            "json_bytes_per_token": m["json_bytes_per_token"],
        },
        {"publish_vs_raw": target(pub_ratio, 0.9)},
        ratios={
            "publish_vs_raw": pub_ratio,
            "publish_bytes_vs_raw": bytes_ratio,
            "one_at_a_time_cpu_vs_raw": one_ratio,
            "json_over_packed_bytes": size_ratio,
        },
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
