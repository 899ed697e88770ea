"""Bus throughput: publish/consume N realistic CallRecords through the JetStream bus.

Baselines measured in the same run against the same nats-server:
* raw nats-py ``publish_async`` of the very same encoded bytes (floor for publish cost);
* a naive JSON-of-lists encoding of the same records (bytes per token on the wire).

Targets (reported, not asserted): bus publish throughput >= 0.7x raw publish_async;
bytes per token >= 3x smaller than JSON.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import numpy as np

from benchmarks._common import parse_args, print_table, target, write_result
from common import records as r
from common.bus import connect
from common.natsd import NatsServer

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


async def bench(n: int, nats_url: str) -> dict:
    recs = make_records(n)
    encoded = [r.encode(x) for x in recs]
    tokens = n * (SUFFIX + OUTPUT)
    wire = sum(len(b) for b in encoded)
    json_bytes = sum(len(json_encoding(x)) for x in recs)

    # baseline: raw nats-py publish_async of the same bytes, same msg-id headers
    raw_bus = await connect(nats_url, "benchraw")
    js = raw_bus.js  # type: ignore[attr-defined]
    subj = raw_bus.subjects
    t0 = time.perf_counter()
    futs = [
        await js.publish_async(subj.calls(x.rollout_id), b, headers={"Nats-Msg-Id": x.msg_id()})
        for x, b in zip(recs, encoded, strict=True)
    ]
    await asyncio.gather(*futs)
    raw_s = time.perf_counter() - t0
    await raw_bus.close()

    # the bus: encode + pipelined publish with de-dup ids and retry handling
    bus = await connect(nats_url, "benchbus")
    t0 = time.perf_counter()
    chunk = 512
    for i in range(0, n, chunk):
        await bus.publish_many(
            [(bus.subjects.calls(x.rollout_id), x, None) for x in recs[i : i + chunk]]
        )
    bus_s = time.perf_counter() - t0

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
    return {
        "n": n,
        "record_bytes_mean": wire / n,
        "bus_publish_rec_s": n / bus_s,
        "bus_publish_MB_s": wire / bus_s / 1e6,
        "raw_publish_async_rec_s": n / raw_s,
        "raw_publish_async_MB_s": wire / raw_s / 1e6,
        "sequential_publish_rec_s": seq_n / seq_s,
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
        m = asyncio.run(bench(n, srv.url))
    pub_ratio = m["bus_publish_rec_s"] / m["raw_publish_async_rec_s"]
    size_ratio = m["json_bytes_per_token"] / m["bytes_per_token"]
    print_table(
        f"bus throughput: {n} CallRecords ({SUFFIX}-token suffix + {OUTPUT} output tokens)",
        [
            (
                "bus publish (publish_many)",
                f"{m['bus_publish_rec_s']:.0f}",
                f"{m['bus_publish_MB_s']:.1f}",
            ),
            (
                "raw nats-py publish_async",
                f"{m['raw_publish_async_rec_s']:.0f}",
                f"{m['raw_publish_async_MB_s']:.1f}",
            ),
            ("bus publish (sequential)", f"{m['sequential_publish_rec_s']:.0f}", "-"),
            ("bus consume + ack", f"{m['consume_rec_s']:.0f}", f"{m['consume_MB_s']:.1f}"),
        ],
        ("path", "records/s", "MB/s"),
    )
    print(
        f"\nbytes/token: msgpack+packed {m['bytes_per_token']:.2f} vs JSON {m['json_bytes_per_token']:.2f} "
        f"({size_ratio:.1f}x smaller); publish ratio vs raw: {pub_ratio:.2f}"
    )
    path = write_result(
        "bus_throughput",
        m,
        {
            "raw_publish_async_rec_s": m["raw_publish_async_rec_s"],
            "json_bytes_per_token": m["json_bytes_per_token"],
        },
        {
            "publish_vs_raw": target(pub_ratio, 0.7),
            "json_over_packed_bytes": target(size_ratio, 3.0),
        },
        ratios={"publish_vs_raw": pub_ratio, "json_over_packed_bytes": size_ratio},
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
