"""Trust on the bus against a real nats-server with role credentials, permissions and TLS:
anonymous and wrong clients are refused with one clear error, each role does its own work and
nothing else (``harnessrl.common.natsauth``'s table)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time
from pathlib import Path

import nats
import pytest

from harnessrl.common import bus as busmod
from harnessrl.common import natsauth
from harnessrl.common import records as r
from harnessrl.common.bus import STREAMS, BusConnectError, PermissionDenied
from harnessrl.common.natsd import NatsServer
from tests.helpers.nats_cli import start_nats_cli, stop_nats_cli
from tests.helpers.records import sample_records
from tests.helpers.secure_nats import HRL, RUNS, actor_creds, as_role
from tests.helpers.wait import until

pytestmark = pytest.mark.integration


def test_credential_files_are_private_and_the_table_matches_the_code(
    secure_server: NatsServer,
) -> None:
    """Credential files and the server config are 0600; the permission table names the real
    streams and durable consumers."""
    from harnessrl.actors import service as actor_service
    from harnessrl.learner import assembler, service

    actors = [actor_creds(i) for i in range(natsauth.DEFAULT_ACTORS)]
    for role in (*natsauth.ROLES, *actors):
        mode = stat.S_IMODE(os.stat(secure_server.creds(role)).st_mode)
        assert mode == 0o600, (role, oct(mode))
    assert stat.S_IMODE(os.stat(Path(secure_server.creds(actors[0])).parent).st_mode) == 0o700
    assert not (secure_server.auth.auth_dir / "actor.cred").exists()  # no shared actor one
    conf = secure_server.store_dir / "nats-server.conf"
    assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(Path(secure_server.ca).parent / "ca-key.pem").st_mode) == 0o600
    assert set(natsauth.STREAM_KINDS) == set(STREAMS)
    assert natsauth.ACTOR_DURABLE == actor_service.DURABLE
    assert natsauth.ASSEMBLER_DURABLE == assembler.DURABLE
    assert natsauth.LEARNER_DURABLE == service.DURABLE


async def test_connection_without_credentials_is_refused(secure_server: NatsServer) -> None:
    """No credentials: refused at once with one line naming the process and the URL."""
    t0 = time.monotonic()
    with pytest.raises(BusConnectError) as e:
        await busmod.connect(secure_server.url, RUNS[0], name="anon-proc", ca=secure_server.ca)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "anon-proc" in msg and secure_server.url in msg and "credentials" in msg
    assert "\n" not in msg
    with pytest.raises(Exception, match="Authorization Violation"):  # the raw client too
        tls = natsauth.tls_context(secure_server.ca)
        await nats.connect(secure_server.url, tls=tls, allow_reconnect=False)


async def test_bad_password_and_wrong_ca_are_one_clear_error(
    secure_server: NatsServer, tmp_path: Path
) -> None:
    """A wrong password names the credential file; a missing CA names the TLS problem; an
    unreadable credential file names the file."""
    bad = tmp_path / "actor-0.cred"
    bad.write_text("actor-0:not-the-password\n")
    with pytest.raises(BusConnectError) as e:
        await busmod.connect(
            secure_server.url, RUNS[0], name="actor x", creds=str(bad), ca=secure_server.ca
        )
    assert str(bad) in str(e.value) and "actor x" in str(e.value)
    assert "authorization violation" in str(e.value)
    with pytest.raises(BusConnectError, match="--nats-ca"):
        await busmod.connect(secure_server.url, RUNS[0], creds=secure_server.creds("actor-0"))
    with pytest.raises(BusConnectError, match="missing.cred"):
        await busmod.connect(secure_server.url, RUNS[0], creds=str(tmp_path / "missing.cred"))


def test_bad_credentials_on_the_command_line_print_one_line(
    secure_server: NatsServer, tmp_path: Path
) -> None:
    """``harnessrl assembler`` with a wrong password exits 1 with one line, no traceback."""
    bad = tmp_path / "assembler.cred"
    bad.write_text("assembler:wrong\n")
    res = subprocess.run(
        [*HRL, "assembler", "--nats", secure_server.url, "--run", RUNS[0]]
        + ["--nats-creds", str(bad), "--nats-ca", secure_server.ca, "--metrics-port", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("harnessrl assembler: assembler: cannot connect to NATS at ")
    assert secure_server.url in lines[0] and str(bad) in lines[0]


async def test_actor_cannot_publish_samples_or_weights_nor_manage_streams(
    secure_server: NatsServer, run: str
) -> None:
    """The actor credential is refused, fast and visibly, everything outside its role."""
    actor = await as_role(secure_server, actor_creds(0), run)
    s = actor.subjects
    sample = r.TreeSample(rollout_id="g-1-1-1", group_id="g", k=1, dropped_reason="x")
    try:
        for subject, rec in [
            (s.samples, sample),
            (s.weights_ready, r.WeightsReady(version=1)),
            (s.weights_data(1), r.WeightChunk(version=1, index=0, n_chunks=1, data=b"x")),
            (s.tasks, sample_records()[0]),
        ]:
            t0 = time.monotonic()
            with pytest.raises(PermissionDenied, match="'actor-0'"):
                await actor.publish(subject, rec)
            assert time.monotonic() - t0 < 5, subject  # not retried for publish_timeout
        with pytest.raises(PermissionDenied):
            await actor.publish_many([(s.samples, sample, "m1")])
        stream = s.stream("SAMPLES")
        with pytest.raises(PermissionDenied):
            await actor._api(stream, actor.js.delete_stream(stream))
        with pytest.raises(PermissionDenied):
            await actor.purge("TASKS")
        for kind in ("SAMPLES", "WEIGHTS"):
            with pytest.raises(PermissionDenied):
                await actor.consumer(kind, "sneaky", r.TreeSample)
        with pytest.raises(PermissionDenied):
            await actor.consumer("TASKS", "another-name", r.TaskRequest)
        rollouts = s.stream("ROLLOUTS")
        with pytest.raises(PermissionDenied):
            await actor._api(rollouts, actor.js.delete_consumer(rollouts, "assembler"))
    finally:
        await actor.close()
    admin = await as_role(secure_server, "admin", run)
    try:  # nothing of it happened
        assert await admin.stream_count("SAMPLES") == 0
        assert await admin.stream_count("WEIGHTS") == 0
        await admin.js.stream_info(s.stream("SAMPLES"))
    finally:
        await admin.close()


async def test_a_role_cannot_snoop_another_roles_inbox(secure_server: NatsServer, run: str) -> None:
    """Subscriptions are limited to the role's own inbox: the actor cannot read the samples
    delivered to the learner, nor subscribe to a stream subject."""
    denied: list[str] = []

    async def on_err(e: Exception) -> None:
        denied.append(str(e))

    opts = natsauth.client_options(secure_server.creds("actor-0"), secure_server.ca)
    nc = await nats.connect(secure_server.url, error_cb=on_err, allow_reconnect=False, **opts)
    try:
        await nc.subscribe("_INBOX.learner.>")
        await nc.subscribe(f"hrl.{run}.samples")
        await nc.flush()
        await until(lambda: len(denied) >= 2, 5, "two permission errors")
    finally:
        await nc.close()
    text = " ".join(denied).lower()
    assert 'subscription to "_inbox.learner.>"' in text
    assert f'subscription to "hrl.{run}.samples"' in text


async def test_each_role_does_exactly_its_own_work(secure_server: NatsServer, run: str) -> None:
    """The whole data flow through the bus, each step with its own role's credential."""
    roles = {
        role: await as_role(secure_server, role, run)
        for role in ("learner", "actor-0", "proxy", "assembler", "weights_sync")
    }
    learner, actor, proxy, assembler, ws = (
        roles[k] for k in ("learner", "actor-0", "proxy", "assembler", "weights_sync")
    )
    s = learner.subjects
    task, call, result, sample = sample_records()[:4]
    try:
        # learner issues a task (its feeder made the actors' consumer); an actor takes it
        await learner.ensure_consumer("TASKS", "actors", filter_subject=s.tasks)
        await learner.publish(s.tasks, task)
        tasks = await actor.bind_consumer("TASKS", "actors", r.TaskRequest)
        [d] = await tasks.fetch(1, timeout=5)
        assert d.record == task
        # the actor's proxy (and a standalone proxy) record calls; the actor reports the result
        await actor.publish(actor.subjects.calls("g-1-2-1"), call)
        await proxy.publish(proxy.subjects.calls("g-1-2-9"), call, "call:other")
        await actor.publish(actor.subjects.rollouts_of(), result)
        await d.ack()
        # a poison task is dead-lettered by the actor (its own dead subject)
        await learner.publish(s.tasks, b"junk", "junk-task")
        assert await tasks.fetch(1, timeout=2) == []
        # the assembler consumes the result, reads the calls, publishes the sample
        results = await assembler.consumer("ROLLOUTS", "assembler", r.RolloutResult)
        [res] = await results.fetch(1, timeout=5)
        assert res.record == result
        assert await assembler.read_subject(s.calls("g-1-2-1", "actor-0"), r.CallRecord) == [call]
        await assembler.publish(s.samples, sample)
        await res.ack()
        # a resumed learner's feeder looks up which members exist already (read-only)
        assert [r.decode(b, r.RolloutResult) for _, b in await learner.stored(s.rollouts)] == [
            result
        ]
        assert await learner.stored(s.tasks) == []
        # the learner trains on it and broadcasts weights; old versions are purged
        samples = await learner.consumer("SAMPLES", "learner", r.TreeSample)
        [got] = await samples.fetch(1, timeout=5)
        assert got.record == sample
        await got.ack()
        chunk = r.WeightChunk(version=1, index=0, n_chunks=1, data=b"w")
        await learner.publish_many([(s.weights_data(1), chunk, "w:1:0")])
        await learner.publish(s.weights_ready, r.WeightsReady(version=1, n_chunks=1))
        # each engine's updater follows the versions and reads their chunks
        ready = await ws.consumer(
            "WEIGHTS", "weights-sync-e0", r.WeightsReady, filter_subject=s.weights_ready
        )
        [w] = await ready.fetch(1, timeout=5)
        assert w.record.version == 1
        assert await ws.read_subject(s.weights_data(1), r.WeightChunk) == [chunk]
        await w.ack()
        await learner.purge("WEIGHTS", s.weights_data(1))
        assert await ws.read_subject(s.weights_data(1), r.WeightChunk) == []
        # and nobody does another role's work
        forbidden = [
            (proxy, s.rollouts_of("proxy")),
            (proxy, s.calls("g-1-2-1", "actor-0")),
            (assembler, s.tasks),
            (assembler, s.weights_ready),
            (learner, s.samples),
            (learner, s.rollouts_of("learner")),
            (ws, s.weights_ready),
            (ws, s.samples),
        ]
        for bus, subject in forbidden:
            with pytest.raises(PermissionDenied):
                await bus.publish(subject, b"x", f"forbidden:{subject}")
        with pytest.raises(PermissionDenied):
            await ws.purge("WEIGHTS")
        with pytest.raises(PermissionDenied):
            await assembler.consumer("TASKS", "actors", r.TaskRequest)
        with pytest.raises(PermissionDenied):
            await learner.read_subject(s.calls("g-1-2-1", "actor-0"), r.CallRecord)
        with pytest.raises(PermissionDenied):
            await actor.stored(s.rollouts)
    finally:
        for b in roles.values():
            await b.close()
    admin = await as_role(secure_server, "admin", run)
    try:
        assert await admin.stream_count("DEAD", s.dead("tasks")) == 1
    finally:
        await admin.close()


async def test_a_role_waits_for_the_admin_to_create_streams(secure_server: NatsServer) -> None:
    """A role may not create streams: it waits for them, and fails clearly if they never come."""
    run = RUNS[-1]
    admin = await as_role(secure_server, "admin", run, create_streams=False)
    for kind in STREAMS:
        try:
            await admin.js.delete_stream(admin.subjects.stream(kind))
        except Exception:
            pass
    waiting = asyncio.create_task(as_role(secure_server, "assembler", run))
    await asyncio.sleep(1.0)
    assert not waiting.done()
    await admin.ensure_streams()
    await admin.close()
    bus = await asyncio.wait_for(waiting, 30)
    assert await bus.stream_count("SAMPLES") == 0
    await bus.close()
    await admin_delete(secure_server, run, "TASKS")
    with pytest.raises(busmod.BusError, match="may not create it"):
        await busmod.connect(
            secure_server.url,
            run,
            creds=secure_server.creds("actor-0"),
            ca=secure_server.ca,
            stream_wait_s=0.5,
        )


async def admin_delete(srv: NatsServer, run: str, kind: str) -> None:
    admin = await as_role(srv, "admin", run, create_streams=False)
    await admin.js.delete_stream(admin.subjects.stream(kind))
    await admin.close()


async def test_nats_command_is_secure_by_default_and_creates_the_runs_streams(
    tmp_path: Path,
) -> None:
    """``harnessrl nats`` makes credentials and a CA, refuses anonymous clients and creates
    the streams of ``--runs``; a restart keeps the credentials valid."""
    proc, line = start_nats_cli(tmp_path, "--runs", "exp1")
    try:
        url = line.split("ready: ")[1].split()[0]
        assert url.startswith("tls://")
        auth = tmp_path / "store" / "auth"
        ca = str(auth / "tls" / "ca.pem")
        assert f"CA {ca}" in line
        with pytest.raises(BusConnectError, match="requires credentials"):
            await busmod.connect(url, "exp1", ca=ca)
        bus = await busmod.connect(url, "exp1", creds=str(auth / "learner.cred"), ca=ca)
        assert await bus.stream_count("TASKS") == 0  # created by the server, not by the learner
        await bus.close()
        password = (auth / "learner.cred").read_text()
    finally:
        stop_nats_cli(proc)
    proc, line = start_nats_cli(tmp_path, "--runs", "exp1")
    try:
        assert (auth / "learner.cred").read_text() == password
        url = line.split("ready: ")[1].split()[0]
        bus = await busmod.connect(url, "exp1", creds=str(auth / "learner.cred"), ca=ca)
        await bus.close()
    finally:
        stop_nats_cli(proc)


async def test_nats_command_insecure_accepts_anyone(tmp_path: Path) -> None:
    """Only an explicit ``--insecure`` serves anonymous clients (plain TCP)."""
    proc, line = start_nats_cli(tmp_path, "--insecure")
    try:
        assert "INSECURE" in line
        url = line.split("ready: ")[1].split()[0]
        assert url.startswith("nats://")
        bus = await busmod.connect(url, "default")
        await bus.publish(bus.subjects.samples, sample_records()[3])
        await bus.close()
        assert not (tmp_path / "store" / "auth").exists()
    finally:
        stop_nats_cli(proc)


async def test_credentials_never_enter_a_sandbox(backend, tmp_path: Path) -> None:
    """A command in a bubblewrap sandbox (where harnesses run) cannot read a credential file
    that the actor process itself reads."""
    from harnessrl.actors.sandbox import SandboxSpec

    passwords = natsauth.ensure_credentials(tmp_path / "auth")
    passwords |= natsauth.ensure_actor_credentials(tmp_path / "auth", 1)
    cred = tmp_path / "auth" / "actors" / "actor-0.cred"
    assert natsauth.parse_userpass(cred) == ("actor-0", passwords["actor-0"])  # the host reads it
    async with await backend.create(SandboxSpec(owner="test")) as sb:
        read = await sb.run(["cat", str(cred)], timeout=30)
        env = await sb.run(["env"], timeout=30)
    assert read.returncode != 0 and b"No such file" in read.stderr, read
    out = (read.stdout + env.stdout).decode()
    assert not any(p in out for p in passwords.values())


async def test_a_server_with_the_users_own_certificate(tmp_path: Path) -> None:
    """``--tls-cert/--tls-key/--tls-ca``: the server serves the given certificate and clients
    verify it with the given CA; a half-given pair is refused naming the fields."""
    ca, cert, key = natsauth.ensure_tls(tmp_path / "mine", ["127.0.0.1"])
    with pytest.raises(natsauth.AuthError, match="tls_cert and tls_key"):
        natsauth.prepare_server_auth(tmp_path / "a0", ["r"], tls_cert=str(cert))
    auth = natsauth.prepare_server_auth(
        tmp_path / "auth", ["r"], tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca)
    )
    assert not (tmp_path / "auth" / "tls").exists()  # nothing generated
    with NatsServer(tmp_path / "store", auth=auth) as srv:
        assert srv.url.startswith("tls://") and srv.ca == str(ca)
        bus = await busmod.connect(srv.url, "r", creds=srv.creds("admin"), ca=str(ca))
        await bus.close()
        other_ca, _, _ = natsauth.ensure_tls(tmp_path / "other", ["127.0.0.1"])
        with pytest.raises(BusConnectError, match="does not verify"):
            await busmod.connect(srv.url, "r", creds=srv.creds("admin"), ca=str(other_ca))
