"""Wire records: standard msgpack, packed arrays, zstd framing, one clear decode error."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.common import records as r
from tests.helpers.records import sample_records

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rec", sample_records(), ids=lambda x: x.record)
def test_roundtrip_and_plain_msgpack(rec: r.Record) -> None:
    """Every record type round-trips and decodes with the plain msgpack package."""
    data = r.encode(rec)
    assert r.decode(data, type(rec)) == rec
    raw = zstandard.ZstdDecompressor().decompress(data) if data[:4] == r.ZSTD_MAGIC else data
    plain = msgpack.unpackb(raw, raw=False)
    assert plain["record"] == type(rec).__name__
    assert plain["schema_version"] == r.SCHEMA_VERSION
    for name in type(rec).__struct_fields__:
        assert name in plain, name


def test_token_ids_are_packed_int32() -> None:
    """Token ids travel as little-endian int32 bytes, not msgpack lists."""
    rec = sample_records()[1]
    plain = msgpack.unpackb(r.unframe(r.encode(rec)))
    assert isinstance(plain["suffix_ids"], bytes)
    assert np.frombuffer(plain["suffix_ids"], "<i4").tolist() == list(range(1600, 2100))
    assert np.frombuffer(plain["output_logprobs"], "<f4").tolist() == pytest.approx(
        [-0.1, -0.2, -0.3]
    )


def test_large_payloads_are_zstd_framed_small_are_not() -> None:
    big, small = r.encode(sample_records()[1]), r.encode(sample_records()[0])
    assert big[:4] == r.ZSTD_MAGIC
    assert small[:4] != r.ZSTD_MAGIC and len(small) < r.COMPRESS_THRESHOLD


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"garbage",
        b"\xff\xff\xff",
        r.ZSTD_MAGIC + b"broken frame",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"record": "CallRecord"}),
        msgpack.packb({"record": "TaskRequest", "schema_version": 1, "k": "x"}),
    ],
)
def test_garbage_raises_one_error_type(payload: bytes) -> None:
    with pytest.raises(r.RecordDecodeError):
        r.decode(payload, r.CallRecord)


def test_wrong_type_and_newer_schema_rejected() -> None:
    task = sample_records()[0]
    with pytest.raises(r.RecordDecodeError, match="expected a CallRecord"):
        r.decode(r.encode(task), r.CallRecord)
    newer = msgpack.packb(
        {**msgpack.unpackb(r.encode(task)), "schema_version": r.SCHEMA_VERSION + 1}
    )
    with pytest.raises(r.RecordDecodeError, match="newer than supported"):
        r.decode(newer, r.TaskRequest)


def test_unknown_extra_fields_are_tolerated() -> None:
    """A same-version producer that adds a field does not break older consumers."""
    task = sample_records()[0]
    extended = msgpack.packb({**msgpack.unpackb(r.encode(task)), "future_field": [1, 2]})
    assert r.decode(extended, r.TaskRequest) == task


def test_rollout_identity() -> None:
    assert r.rollout_id("grp_a", 3, 2) == "grp_a-3-2"
    assert r.parse_rollout_id("grp-a-3-2") == ("grp-a", 3, 2)
    for bad in ("a.b", "a b", "a>", "", "x" * 201):
        with pytest.raises(ValueError):
            r.check_token(bad)
    with pytest.raises(ValueError):
        r.rollout_id("g", 0, 0)


def test_tombstone() -> None:
    recs = sample_records()
    assert recs[4].is_tombstone and not recs[3].is_tombstone
    assert recs[3].msg_id() == "sample:g-1-2-1"


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**31 - 1), max_size=3000),
    lps=st.lists(st.floats(-50, 0, width=32), max_size=300),
    label=st.sampled_from(["main", "subagent", "compaction", "aux"]),
)
def test_callrecord_roundtrip_property(ids: list[int], lps: list[float], label: str) -> None:
    rec = r.CallRecord(
        rollout_id="g-0-1",
        seq=0,
        label=label,
        suffix_ids=r.pack_ids(ids),
        input_len=len(ids),
        input_hash=r.ids_hash(ids),
        output_logprobs=r.pack_f32(lps),
    )
    back = r.decode(r.encode(rec), r.CallRecord)
    assert r.unpack_ids(back.suffix_ids).tolist() == ids
    assert back.input_hash == r.ids_hash(r.unpack_ids(back.suffix_ids))
    assert np.array_equal(r.unpack_f32(back.output_logprobs), np.asarray(lps, "<f4"))


@settings(max_examples=60, deadline=None)
@given(
    size=st.sampled_from([0, 1, 255, 256, 65535, 65536, 300_000]),
    version=st.integers(0, 2**40),
    index=st.integers(0, 10_000),
)
def test_scattered_chunk_joins_to_encode(size: int, version: int, index: int) -> None:
    """A weight chunk encoded in two parts (its msgpack head, then its bytes uncopied) is
    exactly ``encode``'s bytes at every msgpack ``bin`` length class, and decodes back."""
    data = bytes((index + i) % 251 for i in range(size))
    chunk = r.WeightChunk(version=version, index=index, n_chunks=index + 1, data=data)
    parts = r.encode_many([chunk])[0]
    assert isinstance(parts, r.Scattered)
    assert parts.body.obj is data  # a view of the chunk's own bytes, not a copy
    assert parts.join() == r.encode(chunk) and parts.nbytes == len(r.encode(chunk))
    assert r.wire_size(parts) == len(r.encode(chunk))
    back = r.decode(parts.join(), r.WeightChunk)
    assert bytes(back.data) == data and (back.version, back.index) == (version, index)


def test_scatter_refuses_a_field_that_is_not_a_trailing_bin() -> None:
    """``SCATTER`` names the last field, a buffer; on any other field it is an error, never
    a wrong encoding."""

    class Bad(r.Record, kw_only=True):
        COMPRESS = False
        SCATTER = "data"
        data: bytes
        after: int = 0

    with pytest.raises(TypeError, match="last bin field"):
        r.encode_scattered(Bad(data=b"x" * 10))
