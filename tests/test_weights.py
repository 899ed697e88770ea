"""Weight broadcast: the stream transport end to end over a real nats-server (chunking, digest,
purging, a half-received version never applied), and the learner -> embedded engine paths
(stream via the updater, and SGLang's distributed update over gloo): after an update the
engine's log-probs for a fixed prompt+output equal the learner's own forward pass."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harnessrl.common.bus import Bus, connect
from harnessrl.common.models import load_model, resolve_model
from harnessrl.common.records import (
    TreeNode,
    TreeSample,
    WeightChunk,
    WeightsReady,
    encode,
    pack_f32,
    pack_ids,
    pack_u8,
)
from harnessrl.common.weights import (
    ChunkJoiner,
    IncompleteVersion,
    chunk,
    join_chunks,
    same_bytes,
    serialize,
    weights_digest,
)
from harnessrl.learner.weights import DistributedPublisher, StreamPublisher
from harnessrl.proxy.weights_sync import WeightUpdater, engine_apply
from tests.helpers.wait import until

TOL = 1e-4


@pytest.fixture
async def bus(nats_url: str, run_name: str) -> Bus:
    b = await connect(nats_url, run_name)
    yield b
    await b.close()


def random_state(seed: int = 0, n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 1000 + i, generator=g) for i in range(n)}


class Recorder:
    """An ``ApplyFn`` that records what it was asked to load."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def __call__(self, path: str, version: int) -> None:
        self.calls.append((path, version))


@pytest.mark.integration
async def test_stream_round_trip_chunks_digest_and_purge(bus: Bus, tmp_path: Path) -> None:
    """Chunks <= chunk_bytes; the updater reassembles, verifies and writes the exact tensors;
    only the newest keep_versions data subjects stay stored."""
    from safetensors.torch import load_file

    pub = StreamPublisher(bus, config_json='{"model_type": "x"}', chunk_bytes=64 * 1024, keep=2)
    rec = Recorder()
    upd = WeightUpdater(bus, rec, tmp_path / "sync", durable="upd", read_retries=0)
    states = {v: random_state(v) for v in (1, 2, 3)}
    for v, st in states.items():
        ready = await pub.publish(v, v, st)
        assert ready.n_chunks == -(-ready.total_bytes // (64 * 1024)) > 10
    chunks = await bus.read_subject(bus.subjects.weights_data(3), WeightChunk)
    assert max(len(c.data) for c in chunks) <= 64 * 1024
    assert await bus.stream_count("WEIGHTS", bus.subjects.weights_data(1)) == 0
    assert await bus.stream_count("WEIGHTS", bus.subjects.weights_data(2)) > 0
    assert await upd.poll(timeout=2.0) == 3  # the newest waiting version wins
    assert rec.calls[-1][1] == 3 and upd.applied_version == 3
    folder = Path(rec.calls[-1][0])
    got = load_file(str(folder / "model.safetensors"))
    assert all(torch.equal(got[k], states[3][k]) for k in states[3])
    assert (folder / "config.json").read_text() == '{"model_type": "x"}'


@pytest.mark.integration
async def test_half_received_version_is_never_applied(bus: Bus, tmp_path: Path) -> None:
    """A version with a missing chunk or a wrong digest is skipped; the next complete one is
    applied."""
    rec = Recorder()
    upd = WeightUpdater(bus, rec, tmp_path, durable="upd", read_retries=1, retry_delay_s=0.05)
    data = serialize(random_state(7))
    parts = chunk(data, 16 * 1024)
    subject = bus.subjects.weights_data(5)
    for i, p in enumerate(parts[:-1]):  # the last chunk never arrives
        rec_ = WeightChunk(version=5, index=i, n_chunks=len(parts), data=p)
        await bus.publish(subject, encode(rec_, compress=False), rec_.msg_id())
    ready = WeightsReady(
        version=5, n_chunks=len(parts), total_bytes=len(data), digest=weights_digest(data)
    )
    await bus.publish(bus.subjects.weights_ready, ready)
    assert await upd.poll(timeout=2.0) is None
    assert rec.calls == [] and upd.rejected == {5: "missing_chunks"}
    # every chunk present, but the digest announces other bytes
    pub = StreamPublisher(bus, chunk_bytes=16 * 1024)
    await pub.publish_bytes(6, 6, data)
    bad = WeightsReady(
        version=7, n_chunks=len(parts), total_bytes=len(data), digest=weights_digest(b"x")
    )
    for c in await bus.read_subject(bus.subjects.weights_data(6), WeightChunk):
        c7 = WeightChunk(version=7, index=c.index, n_chunks=c.n_chunks, data=c.data)
        await bus.publish(bus.subjects.weights_data(7), encode(c7, compress=False), c7.msg_id())
    await bus.publish(bus.subjects.weights_ready, bad)
    assert await upd.poll(timeout=2.0) is None
    assert upd.rejected[7] == "digest_mismatch" and rec.calls == []
    await pub.publish_bytes(8, 8, data)
    assert await upd.poll(timeout=2.0) == 8 and [v for _, v in rec.calls] == [8]
    assert await upd.poll(timeout=0.2) is None  # nothing older is applied afterwards


@pytest.mark.integration
async def test_disk_transport_folder_is_applied_in_place(bus: Bus, tmp_path: Path) -> None:
    """``disk``: an atomic HF folder per version (config + tokenizer files + weights), older
    folders removed; the updater hands the path itself to the engine."""
    from harnessrl.learner.weights import DiskPublisher

    model_dir = resolve_model("tiny-1m")
    pub = DiskPublisher(bus, tmp_path / "w", model_dir=model_dir, keep=2)
    for v in (1, 2, 3):
        ready = await pub.publish(v, v, random_state(v, n=2))
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v000000002", "v000000003"]
    folder = Path(ready.path)
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    assert resolve_model(str(folder)) == folder
    rec = Recorder()
    upd = WeightUpdater(bus, rec, tmp_path / "sync", durable="disk")
    assert await upd.poll(timeout=2.0) == 3 and rec.calls == [(str(folder), 3)]


# ------------------------------------------------------------------------------------------
# learner -> embedded engine
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def learner():
    """A DeepSpeed learner on tiny-1m that has taken SFT steps (its weights moved)."""
    from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
    from harnessrl.learner.losses import LossConfig

    return LearnerEngine("tiny-1m", DeepSpeedConfig(lr=1e-2, grad_clip=0), LossConfig(algo="sft"))


def sft_step(learner, seed: int) -> None:
    from harnessrl.learner.packing import PackConfig, pack

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 8000, 40)
    s = TreeSample(
        rollout_id=f"s-0-{seed + 1}",
        group_id="s",
        k=0,
        nodes=[TreeNode(parent=-1, token_ids=pack_ids(ids), loss_mask=pack_u8(np.ones(40)))],
    )
    learner.train_step(
        pack([s], PackConfig(max_tokens=64), drop_missing_logprobs=False).rows
    )  # SFT


def learner_logprobs(learner, prompt: list[int], output: list[int]) -> np.ndarray:
    """The learner's own forward pass (packed tree path) over prompt + output."""
    from harnessrl.learner.packing import PackConfig, pack

    s = TreeSample(
        rollout_id="q-0-1",
        group_id="q",
        k=0,
        nodes=[
            TreeNode(parent=-1, token_ids=pack_ids(prompt)),
            TreeNode(
                parent=0,
                token_ids=pack_ids(output),
                logprobs=pack_f32(np.zeros(len(output))),  # any behaviour log-prob
                loss_mask=pack_u8(np.ones(len(output))),
            ),
        ],
    )
    return learner.logprobs(pack([s], PackConfig(max_tokens=256)).rows)[0]


def reference_logprobs(model, prompt: list[int], output: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(output)[:, None])[:, 0].numpy()


async def check_engine_matches(client, learner, base, version: int) -> None:
    prompt = list(range(100, 120))
    res = await client.generate(
        prompt, {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
    )
    assert res.weight_version_end == version
    mine = learner_logprobs(learner, prompt, res.output_ids)
    assert np.abs(np.asarray(res.logprobs) - mine).max() < TOL
    old = reference_logprobs(base, prompt, res.output_ids)
    assert np.abs(np.asarray(res.logprobs) - old).max() > 1e-3


@pytest.mark.integration
async def test_learner_versions_reach_embedded_engine(learner, bus: Bus, tmp_path: Path) -> None:
    """stream (updater -> update_weights_from_disk) then distributed (gloo, two buckets): each
    time the engine's log-probs equal the learner's forward of the new weights and differ from
    the base model; a corrupt version in between leaves the engine where it was."""
    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import EngineServer
    from harnessrl.proxy.sglang import EngineClient

    base = load_model(resolve_model("tiny-1m")).requires_grad_(False)
    cfg = EngineConfig(model="tiny-1m", port=0, threads=1)
    async with EngineServer(cfg) as srv, EngineClient(srv.url) as client:
        config_json = learner.policy.lm.config.to_json_string()
        pub = StreamPublisher(bus, config_json=config_json)
        upd = WeightUpdater(
            bus,
            engine_apply(client),
            tmp_path / "sync",
            durable="engine",
            applied_version=await client.weight_version(),
        )
        sft_step(learner, 1)
        await pub.publish(1, 1, learner.state_dict_for_broadcast(torch.float32))
        assert await upd.poll(timeout=5.0) == 1
        await check_engine_matches(client, learner, base, 1)

        bad = WeightsReady(version=2, n_chunks=3, total_bytes=10, digest="00")
        await bus.publish(bus.subjects.weights_ready, bad)
        upd.read_retries = 0
        assert await upd.poll(timeout=2.0) is None
        assert await client.weight_version() == 1

        sft_step(learner, 2)
        named = learner.state_dict_for_broadcast(torch.float32)
        dist = DistributedPublisher(bus, [srv.url], bucket_bytes=2 << 20, timeout_s=60)
        try:
            ready = await asyncio.wait_for(dist.publish(3, 3, named), 120)
            assert ready.transport == "distributed"
            await check_engine_matches(client, learner, base, 3)
        finally:
            await dist.close()


@pytest.mark.integration
async def test_weights_sync_command_applies_versions(
    bus: Bus, nats_url: str, tmp_path: Path
) -> None:
    """``harnessrl weights-sync`` (as ``python -m harnessrl.proxy.weights_sync_cmd``) applies a streamed
    version to an engine and reports it."""
    import os
    import signal
    import subprocess
    import sys

    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import EngineServer, load_state_dict
    from harnessrl.proxy.sglang import EngineClient

    root = Path(__file__).resolve().parent.parent
    new = load_state_dict(resolve_model("tiny-1m@seed1"))
    cfg = EngineConfig(model="tiny-1m", port=0, threads=1)
    async with EngineServer(cfg) as srv, EngineClient(srv.url) as client:
        argv = [sys.executable, "-m", "harnessrl.proxy.weights_sync_cmd", "--nats", nats_url]
        argv += ["--run", bus.run, "--engine", srv.url, "--work-dir", str(tmp_path)]
        argv += ["--metrics-port", "-1"]
        env = {**os.environ, "PYTHONPATH": str(root)}
        proc = subprocess.Popen(argv, cwd=root, env=env, stderr=subprocess.PIPE, text=True)
        try:
            config_json = (resolve_model("tiny-1m") / "config.json").read_text()
            await StreamPublisher(bus, config_json=config_json).publish(4, 4, new)

            async def at_4() -> bool:
                return await client.weight_version() == 4

            await until(at_4, 60, "version 4 at the engine", interval=0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "applied weight version 4" in err


@pytest.mark.integration
async def test_weights_sync_load_once(tmp_path: Path) -> None:
    """``harnessrl weights-sync --engine URL --load PATH``: loads one folder (no NATS) and exits
    0; a folder the engine cannot load exits 1 with one line naming the engine and the folder."""
    import os
    import subprocess
    import sys

    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import EngineServer
    from harnessrl.proxy.sglang import EngineClient

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}

    def weights_sync(*flags: str) -> subprocess.CompletedProcess:
        argv = [
            sys.executable,
            "-m",
            "harnessrl.proxy.weights_sync_cmd",
            "--metrics-port",
            "-1",
            *flags,
        ]
        return subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=120)

    new = resolve_model("tiny-1m@seed1")
    cfg = EngineConfig(model="tiny-1m", port=0, threads=1)
    async with EngineServer(cfg) as srv, EngineClient(srv.url) as client:
        ok = await asyncio.to_thread(
            weights_sync, "--engine", srv.url, "--load", str(new), "--load-version", "7"
        )
        assert ok.returncode == 0, ok.stderr
        assert await client.weight_version() == 7
        assert (await client.model_info())["weight_version"] == "7"

        bad = tmp_path / "not-a-model"
        bad.mkdir()
        res = await asyncio.to_thread(weights_sync, "--engine", srv.url, "--load", str(bad))
        assert res.returncode == 1
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and srv.url in lines[0] and str(bad) in lines[0], res.stderr
        assert await client.weight_version() == 7  # the old weights keep serving

    res = await asyncio.to_thread(
        weights_sync, "--engine", srv.url, "--load", str(new), "--engine-wait-s", "0"
    )
    assert res.returncode == 1 and srv.url in res.stderr and str(new) in res.stderr


@pytest.mark.unit
def test_digest_names_its_algorithm_and_earlier_digests_still_verify() -> None:
    """``weights_digest`` is ``xxh3-128:<hex>``; ``sha256:<hex>`` and a bare hex digest
    (blake2b-256), what earlier learners announced, still verify, and each form rejects other
    bytes; a digest naming an algorithm not known here rejects the version with its reason."""
    import hashlib

    import xxhash

    data = serialize(random_state(5, n=1))
    parts = chunk(data, 4096)
    chunks = [
        WeightChunk(version=1, index=i, n_chunks=len(parts), data=p) for i, p in enumerate(parts)
    ]

    def forms(b: bytes) -> list[str]:
        return [
            weights_digest(b),
            "sha256:" + hashlib.sha256(b).hexdigest(),
            hashlib.blake2b(b, digest_size=32).hexdigest(),
        ]

    assert weights_digest(data) == "xxh3-128:" + xxhash.xxh3_128(data).hexdigest()
    for d in forms(data):
        ready = WeightsReady(version=1, n_chunks=len(parts), total_bytes=len(data), digest=d)
        assert bytes(join_chunks(ready, chunks)) == data
    other = data[:-1] + bytes([data[-1] ^ 1])
    for d in [*forms(other), "md5:" + hashlib.md5(data).hexdigest()]:
        ready = WeightsReady(version=1, n_chunks=len(parts), total_bytes=len(data), digest=d)
        with pytest.raises(IncompleteVersion) as e:
            join_chunks(ready, chunks)
        assert e.value.reason == ("unknown_digest" if d.startswith("md5:") else "digest_mismatch")


@pytest.mark.unit
def test_chunk_joiner_orders_dedups_and_verifies_once() -> None:
    """Chunks may arrive in any order and twice: the joined bytes are the version's; a chunk
    seen twice with other bytes, a corrupted byte (one digest over the whole) or bytes beyond
    the announced size reject the version, each with its reason."""
    data = serialize(random_state(3, n=2))
    parts = chunk(data, 4096)
    ready = WeightsReady(
        version=4, n_chunks=len(parts), total_bytes=len(data), digest=weights_digest(data)
    )

    def chunks(ps) -> list[WeightChunk]:
        return [WeightChunk(version=4, index=i, n_chunks=len(ps), data=p) for i, p in enumerate(ps)]

    shuffled = chunks(parts)[::-1]
    joiner = ChunkJoiner(ready)
    joiner.add(shuffled[:5])
    joiner.add(shuffled[3:] + shuffled[-2:])  # repeats, some after they were placed
    assert bytes(joiner.finish()) == data
    bad = bytearray(parts[7])
    bad[100] ^= 0xFF
    corrupted = chunks([*parts[:7], bytes(bad), *parts[8:]])
    with pytest.raises(IncompleteVersion) as e:
        join_chunks(ready, corrupted)
    assert e.value.reason == "digest_mismatch"
    for late in (chunks(parts) + [corrupted[7]], [corrupted[7], *chunks(parts)[::-1]]):
        with pytest.raises(IncompleteVersion) as e:  # a conflict after or before it was placed
            join_chunks(ready, late)
        assert e.value.reason == "conflicting_chunks"
    short = WeightChunk(version=4, index=7, n_chunks=len(parts), data=parts[7][:-1])
    with pytest.raises(IncompleteVersion) as e:
        join_chunks(ready, [short, *chunks(parts)[::-1]])
    assert e.value.reason == "conflicting_chunks"
    assert same_bytes(b"ab", memoryview(b"xab")[1:]) and not same_bytes(b"ab", b"ac")
    longer = chunks([*parts[:-1], bytes(parts[-1]) + b"x"])
    with pytest.raises(IncompleteVersion) as e:
        join_chunks(ready, longer)
    assert e.value.reason == "size_mismatch"


@pytest.mark.integration
async def test_corrupted_chunk_is_never_applied(bus: Bus, tmp_path: Path) -> None:
    """A version whose chunks are all there with the announced sizes, one byte of one chunk
    altered, fails the single digest check and is counted; the next good version applies."""
    rec = Recorder()
    upd = WeightUpdater(bus, rec, tmp_path, durable="upd", read_retries=0, read_batch=3)
    data = serialize(random_state(9))
    parts = chunk(data, 16 * 1024)
    for i, p in enumerate(parts):
        body = bytearray(p)
        if i == len(parts) // 2:
            body[5] ^= 0x01
        c = WeightChunk(version=2, index=i, n_chunks=len(parts), data=bytes(body))
        await bus.publish(bus.subjects.weights_data(2), c, c.msg_id())
    ready = WeightsReady(
        version=2, n_chunks=len(parts), total_bytes=len(data), digest=weights_digest(data)
    )
    await bus.publish(bus.subjects.weights_ready, ready)
    assert await upd.poll(timeout=2.0) is None
    assert upd.rejected == {2: "digest_mismatch"} and rec.calls == []
    await StreamPublisher(bus, chunk_bytes=16 * 1024).publish_bytes(3, 3, data)
    assert await upd.poll(timeout=2.0) == 3 and [v for _, v in rec.calls] == [3]


_REUSE = """
import resource, sys
from harnessrl.common.weights import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory(256 << 20)
def version():  # a version's worth of ~1 MiB messages, held together, then dropped
    held = [bytearray(1 << 20) for _ in range(96)]
    del held
version()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
version()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.integration
@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc")
def test_retained_memory_is_reused_by_the_next_version() -> None:
    """By default malloc maps each ~1 MiB message afresh and gives it back when freed, so a
    second version faults all its pages in again (~24k 4 KiB faults for 96 MiB); with
    `retain_freed_memory` it lands in the first one's pages."""
    faults = {}
    for mode in ("default", "retain"):
        out = subprocess.run(
            [sys.executable, "-c", _REUSE, mode],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        faults[mode] = int(out.stdout)
    assert faults["default"] > 10_000, faults
    assert faults["retain"] < faults["default"] / 10, faults
