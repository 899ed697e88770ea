"""Each rollout belongs to the actor that was handed it, against an attacker holding a valid
actor credential: a real nats-server with per-actor credentials (``actors/actor-<i>.cred``)
refuses an actor's publish into another actor's calls or results; records and results that
get through under the attacker's own name are refused by the real assembler (dead-lettered
with the reason, never assembled), and they cannot get the real ones dropped as duplicates.
``harnessrl nats`` makes the per-actor credentials and picks up new ones while it runs; a
folder of them is a pool each actor process claims one credential of."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harnessrl.common import metrics, natsauth
from harnessrl.common import records as r
from harnessrl.common.bus import Bus, BusConnectError, PermissionDenied
from harnessrl.common.natsd import NatsServer
from harnessrl.common.tree import assemble
from harnessrl.learner.assembler import Assembler
from harnessrl.learner.config import AssemblerConfig
from tests.helpers.nats_cli import ready_line, spawn_nats_cli, stop_nats_cli
from tests.helpers.secure_nats import HRL, as_role
from tests.helpers.trees import Spec, make_calls, result_for

pytestmark = pytest.mark.integration

CHAIN = [Spec([1, 2, 3], [4, 5], wv=2), Spec([1, 2, 3, 4, 5, 6], [7, 8], wv=3)]


@contextlib.asynccontextmanager
async def assembler_running(bus: Bus):
    cfg = AssemblerConfig(run=bus.run, straggler_wait_s=2.0, straggler_poll_s=0.05, ack_wait=5.0)
    task = asyncio.create_task(Assembler(bus, cfg).run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def issue(learner: Bus, group_id: str, k: int = 0) -> r.TaskRequest:
    """The learner's feeder issues one member (with its claim) on a fresh task consumer."""
    from harnessrl.learner.config import FeederConfig
    from harnessrl.learner.task_queue import TaskQueue

    await TaskQueue(learner, FeederConfig()).ensure()
    key = await learner.claim_key(create=True)
    req = r.TaskRequest(
        group_id=group_id,
        k=k,
        group_size=1,
        issued_version=0,
        task_id="toy/t",
        claim=r.member_claim(key, group_id, k),
    )
    await learner.publish(learner.subjects.tasks, req)
    return req


async def take(actor: Bus) -> r.TaskRequest:
    consumer = await actor.bind_consumer("TASKS", "actors", r.TaskRequest)
    [d] = await consumer.fetch(1, timeout=5)
    await d.ack()
    return d.record


async def samples(learner: Bus, want: int, timeout: float = 20.0) -> list[r.TreeSample]:
    cons = await learner.consumer("SAMPLES", "learner", r.TreeSample)
    got: list[r.TreeSample] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for d in await cons.fetch(8, timeout=0.5):
            got.append(d.record)
            await d.ack()
    for d in await cons.fetch(8, timeout=1.0):  # nothing more may follow
        got.append(d.record)
        await d.ack()
    return got


async def dead(admin: Bus, kind: str, n: int, timeout: float = 10.0) -> list[r.DeadLetter]:
    deadline = time.monotonic() + timeout
    while True:
        got = await admin.read_subject(admin.subjects.dead(kind), r.DeadLetter)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


async def test_an_actor_cannot_publish_into_another_actors_rollout(
    secure_server: NatsServer,
    run: str,
) -> None:
    """With its own valid credential, actor-1 is refused at once every publish under
    actor-0's name: a call into actor-0's rollout, a result in actor-0's name; and the old
    shared subjects (``hrl.<run>.calls.<rollout id>``, ``hrl.<run>.rollouts``) are gone."""
    a0 = await as_role(secure_server, "actor-0", run)
    a1 = await as_role(secure_server, "actor-1", run)
    rid = "g0-0-1"
    call = make_calls(CHAIN, rid=rid)[0]
    res = result_for(1, rid=rid)
    try:
        assert (a0.subjects.publisher, a1.subjects.publisher) == ("actor-0", "actor-1")
        await a0.publish(a0.subjects.calls(rid), call)  # its own: fine
        for subject, rec in [
            (a1.subjects.calls(rid, "actor-0"), call),
            (a1.subjects.rollouts_of("actor-0"), res),
            (f"hrl.{run}.calls.{rid}", call),
            (f"hrl.{run}.rollouts", res),
            (a1.subjects.calls(rid, "proxy"), call),
        ]:
            t0 = time.monotonic()
            with pytest.raises(PermissionDenied, match="'actor-1'"):
                await a1.publish(subject, rec, f"x:{subject}")
            assert time.monotonic() - t0 < 5, subject
        with pytest.raises(PermissionDenied):
            await a1.claim_key()  # the claim key is the learner's and the assembler's
    finally:
        await a0.close()
        await a1.close()


async def test_forged_calls_and_results_are_dead_lettered_never_assembled(
    secure_server: NatsServer,
    run: str,
) -> None:
    """actor-0 is handed member 0 of group ga and runs it. actor-1, holding a valid actor
    credential, does what the server still lets it: publishes a call of that rollout under its
    own name, first, with the real record's msg id; then a result for it (with a guessed claim),
    first, with the real result's old msg id; and a result for a member never issued. The
    assembler builds ga's sample from actor-0's calls alone, and dead-letters each forgery
    with the reason and the forger's name; nothing of actor-1's is assembled."""
    learner = await as_role(secure_server, "learner", run)
    a0 = await as_role(secure_server, "actor-0", run)
    a1 = await as_role(secure_server, "actor-1", run)
    assembler = await as_role(secure_server, "assembler", run)
    admin = await as_role(secure_server, "admin", run)
    forged_before = metrics.sample_value("hrl_assembler_rollouts_total", {"outcome": "forged"})
    try:
        req = await issue(learner, "ga")
        got = await take(a0)
        assert got.claim == req.claim and len(got.claim) == 32
        rid = r.rollout_id("ga", 0, 1)
        calls = make_calls(CHAIN, rid=rid)
        junk = make_calls([Spec([1, 2, 3], [66, 66], wv=2)], rid=rid)[0]  # would be call 0
        # the forger goes first, under its own name, with the real records' plain msg ids
        await a1.publish(a1.subjects.calls(rid), junk, junk.msg_id())
        fake = result_for(len(calls), rid=rid, reward=1.0, claim="0" * 32)
        await a1.publish(a1.subjects.rollouts_of(), fake, f"rollout:{rid}")
        never = result_for(1, rid="gz-0-1", reward=1.0)
        await a1.publish(a1.subjects.calls("gz-0-1"), junk, "z")
        await a1.publish(a1.subjects.rollouts_of(), never)
        # the real actor: its calls (as its recorder would: salted ids) and its result
        for c in calls:
            await a0.publish(a0.subjects.calls(rid), c, f"{c.msg_id()}:salt0")
        real = result_for(len(calls), rid=rid, claim=got.claim)
        assert (await a0.publish(a0.subjects.rollouts_of(), real)).duplicate is False
        async with assembler_running(assembler):
            out = await samples(learner, 1)
            dl_rollouts = await dead(admin, "ROLLOUTS", 2)
            dl_calls = await dead(admin, "CALLS", 1)
    finally:
        for b in (learner, a0, a1, assembler, admin):
            await b.close()
    assert [s.rollout_id for s in out] == [rid]
    assert r.encode(out[0]) == r.encode(assemble(calls, real))
    assert out[0].reward == real.reward and out[0].counters.n_calls == len(calls)
    reasons = sorted(d.reason for d in dl_rollouts)
    assert len(reasons) == 2 and all(x.startswith("forged: 'actor-1'") for x in reasons), reasons
    assert all("was never delivered to it" in x for x in reasons)
    assert {d.subject for d in dl_rollouts} == {f"hrl.{run}.rollouts.actor-1"}
    [call_dl] = dl_calls
    assert call_dl.subject == f"hrl.{run}.calls.actor-1.{rid}"
    assert "forged" in call_dl.reason and "'actor-1'" in call_dl.reason
    assert r.decode(call_dl.data, r.CallRecord) == junk  # kept for inspection
    forged = metrics.sample_value("hrl_assembler_rollouts_total", {"outcome": "forged"})
    assert forged - (forged_before or 0) == 2


async def test_nats_command_makes_per_actor_credentials_and_picks_up_new_ones(
    tmp_path: Path,
) -> None:
    """``harnessrl nats --actors 2`` writes actors/actor-{0,1}.cred (0600, no shared actor
    credential); a credential added while it runs is accepted within seconds; a folder of
    them is a pool: each process claims one no other process holds."""
    proc = spawn_nats_cli(tmp_path, "--runs", "idr", "--actors", "2")
    try:
        line = ready_line(proc)
        url = line.split("ready: ")[1].split()[0]
        auth = tmp_path / "store" / "auth"
        ca = str(auth / "tls" / "ca.pem")
        pool = auth / "actors"
        assert sorted(p.name for p in pool.glob("*.cred")) == ["actor-0.cred", "actor-1.cred"]
        assert "2 actor credentials" in line, line
        assert not (auth / "actor.cred").exists()
        unknown = tmp_path / "elsewhere" / "actor-late.cred"
        unknown.parent.mkdir()
        unknown.write_text("actor-late:not-known-yet\n")
        with pytest.raises(BusConnectError):
            await _connect(url, str(unknown), ca)
        natsauth.ensure_actor_credentials(auth, names=["late"])
        bus = await _connect(url, str(pool / "actor-late.cred"), ca, wait_s=15)
        assert bus.subjects.publisher == "actor-late"
        await bus.close()
        # the pool: three processes for three credentials, a fourth finds none free
        code = (
            "import sys; from harnessrl.common.natsauth import claim_credential;"
            "print(claim_credential(sys.argv[1]).name, flush=True); sys.stdin.read()"
        )
        holders = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(pool)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        names = sorted(h.stdout.readline().strip() for h in holders)  # type: ignore[union-attr]
        assert names == ["actor-0.cred", "actor-1.cred", "actor-late.cred"]
        last = subprocess.run(
            [sys.executable, "-c", code, str(pool)], capture_output=True, text=True, input=""
        )
        assert last.returncode != 0 and "held by another process" in last.stderr
        holders[0].communicate("")
        again = subprocess.run(
            [sys.executable, "-c", code, str(pool)], capture_output=True, text=True, input=""
        )
        assert again.stdout.strip() in names  # the one it freed
        for h in holders[1:]:
            h.communicate("")
    finally:
        stop_nats_cli(proc)


async def _connect(url: str, creds: str, ca: str, *, wait_s: float = 0.0) -> Bus:
    from harnessrl.common.bus import connect

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await connect(url, "idr", creds=creds, ca=ca, create_streams=False)
        except BusConnectError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def test_harnessrl_nats_help_names_actors() -> None:
    out = subprocess.run([*HRL, "nats", "--help"], capture_output=True, text=True, timeout=60)
    assert "--actors" in out.stdout
