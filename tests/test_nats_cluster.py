"""A JetStream cluster of three nodes on loopback, with role credentials and TLS on clients and
routes: R3 streams keep records flowing through the project's Bus while a node is SIGKILLed
and restarted (nothing lost, nothing acked twice, the node catches up); replica counts the
cluster cannot hold are clear errors; ``harnessrl nats`` starts cluster nodes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import json
import shutil
import subprocess
import time
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from harnessrl.common import bus as busmod
from harnessrl.common import natsauth
from harnessrl.common import records as r
from harnessrl.common.bus import Bus, BusError
from harnessrl.common.config import ConfigError, NatsServerConfig, load_config
from harnessrl.common.files import free_port
from harnessrl.common.natsd import Cluster, NatsServer, cluster_urls, start_cluster
from harnessrl.common.run.config import RunConfig
from tests.helpers.nats_cli import ready_line, spawn_nats_cli, stop_nats_cli

RUN = "clu"
LEADS = [("TASKS", ""), ("TASKS", "actors"), ("ROLLOUTS", ""), ("ROLLOUTS", "assembler")]
"""The streams and durable consumers of the test's flows."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """Three nodes sharing one auth folder (role credentials, route credential, CA)."""
    root = tmp_path_factory.mktemp("nats-cluster")
    auth = natsauth.prepare_server_auth(root / "auth", [RUN], tls=True)
    nodes = start_cluster(root, 3, auth=auth)
    yield nodes
    for node in nodes:
        node.stop()


async def as_role(nodes: list[NatsServer], role: str, run: str = RUN, **kw) -> Bus:
    """A Bus of ``role`` given every node's URL (it fails over between them)."""
    return await busmod.connect(
        cluster_urls(nodes), run, name=f"test {role}", creds=nodes[0].creds(role),
        ca=nodes[0].ca, **kw,
    )  # fmt: skip


async def make_leader(admin: Bus, node: str, stream: str, consumer: str = "") -> object:
    """Make ``node`` the leader of a stream (or of one of its consumers) and return its info
    from there. JetStream hands leadership only to a replica that is current, so a node that
    leads holds the whole state; a step-down is refused (or lands elsewhere) while it is not."""
    api = f"STREAM.LEADER.STEPDOWN.{stream}"
    if consumer:
        api = f"CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}"
    body = json.dumps({"placement": {"preferred": node}}).encode()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = await _info(admin, stream, consumer)
        if info is not None and info.cluster.leader == node:
            return info
        if info is not None:  # a leader to step down
            with contextlib.suppress(nats.errors.Error):
                await admin.nc.request(f"$JS.API.{api}", body, timeout=5)
        await asyncio.sleep(0.5)
    raise AssertionError(f"{node} never became leader of {stream} {consumer}")


async def _info(admin: Bus, stream: str, consumer: str) -> object:
    """Stream or consumer info; None while it has no leader."""
    try:
        if consumer:
            return await admin.js.consumer_info(stream, consumer)
        return await admin.js.stream_info(stream)
    except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
        return None


async def until(cond, tasks: list[asyncio.Task], timeout: float = 120.0) -> None:
    """Wait for ``cond()`` (a function, sync or async); a task among ``tasks`` that failed
    meanwhile raises its error."""
    deadline = time.monotonic() + timeout
    while not (await res if inspect.isawaitable(res := cond()) else res):
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.integration
async def test_r3_streams_lose_nothing_when_a_node_is_killed_and_restarted(
    cluster: list[NatsServer],
) -> None:
    """Publishers and durable consumers of the project's Bus (two flows, each role with its own
    credential, every client given all three URLs) keep going while the node leading both
    streams and their consumers is SIGKILLed, and after it restarts: every record whose publish
    returned is delivered and acked on the server, none is acked twice (counted by msg id), and
    the restarted node catches up (it can be made leader again, holding the full state)."""
    n = 240
    admin = await as_role(cluster, "admin", replicas=3)
    s = admin.subjects
    for kind in ("TASKS", "ROLLOUTS"):
        info = await admin.js.stream_info(s.stream(kind))
        assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2

    learner = await as_role(cluster, "learner", publish_timeout=60)
    actor_pub = await as_role(cluster, "actor-0", publish_timeout=60)
    actors = [await as_role(cluster, f"actor-{i}") for i in (1, 2)]
    assembler = await as_role(cluster, "assembler")
    # ack_wait as the services' default (10 s), over twice the Bus's ack timeout (5 s): an ack
    # in flight to the node when it dies hangs until that timeout, and the deliveries acked after
    # it must not lapse meanwhile (with 4 s they were redelivered elsewhere and acked twice)
    wait = 10
    await learner.ensure_consumer(
        "TASKS", "actors", filter_subject=s.tasks, ack_wait=wait
    )  # the learner's feeder owns the task consumer; actors bind to it
    flows = {
        "tasks": [await a.bind_consumer("TASKS", "actors", r.TaskRequest) for a in actors],
        "rollouts": [
            await assembler.consumer("ROLLOUTS", "assembler", r.RolloutResult, ack_wait=wait)
        ],
    }
    # the victim leads both streams and both consumers: its death leaves each without a leader
    victim = cluster[1]
    victim_name = victim.cluster.node_name()
    for stream, consumer in LEADS:
        await make_leader(admin, victim_name, s.stream(stream), consumer)
    published: dict[str, set[str]] = {f: set() for f in flows}
    acked: dict[str, collections.Counter] = {f: collections.Counter() for f in flows}
    delivered: dict[str, set[str]] = {f: set() for f in flows}
    ack_errors: dict[str, str] = {}  # msg id -> the error of an ack that raised

    async def publish_tasks() -> None:
        for i in range(n):
            t = r.TaskRequest(group_id=f"g{i}", k=0, group_size=1, issued_version=0, task_id="t")
            await learner.publish(s.tasks, t)
            published["tasks"].add(t.msg_id())

    async def publish_rollouts() -> None:
        for i in range(n):
            res = r.RolloutResult(rollout_id=f"g{i}-0-1", task_id="t", group_id=f"g{i}", k=0)
            await actor_pub.publish(actor_pub.subjects.rollouts_of(), res)
            published["rollouts"].add(res.msg_id())

    async def consume(flow: str, cons: busmod.Consumer) -> None:
        while True:
            for d in await cons.fetch(16, timeout=0.5):
                mid = d.record.msg_id()
                delivered[flow].add(mid)
                try:
                    await d.ack()
                except Exception as e:  # not counted: redelivered unless the server had it
                    ack_errors[mid] = repr(e)
                    continue
                acked[flow][mid] += 1

    pubs = [asyncio.create_task(publish_tasks()), asyncio.create_task(publish_rollouts())]
    subs = [asyncio.create_task(consume(f, c)) for f, cs in flows.items() for c in cs]
    await until(lambda: len(published["tasks"]) >= n // 3, pubs + subs)
    victim.kill()  # SIGKILL
    at_kill = {f: (len(published[f]), len(acked[f])) for f in flows}

    def flowing() -> bool:  # with one node down, new leaders are elected and records flow
        return all(
            len(published[f]) > at_kill[f][0] + 5 and len(acked[f]) > at_kill[f][1] + 5
            for f in flows
        )

    async def settled() -> bool:  # everything published, delivered and acked on the server
        if not all(t.done() for t in pubs):
            return False
        for kind, consumer in LEADS:
            if consumer:
                ci = await _info(admin, s.stream(kind), consumer)
                if ci is None or ci.num_pending or ci.num_ack_pending:
                    return False
        return True

    await until(flowing, pubs + subs)
    victim.start()
    await until(settled, pubs + subs)  # a publisher or consumer that failed raises here
    for t in subs:
        t.cancel()

    expected = {
        "tasks": {f"task:g{i}:0" for i in range(n)},
        "rollouts": {f"rollout:g{i}-0-1" for i in range(n)},
    }
    for flow in flows:
        assert published[flow] == expected[flow]
        twice = [m for m, c in acked[flow].items() if c > 1]
        assert twice == [], f"{flow}: acked twice {twice[:5]}"
        assert delivered[flow] == published[flow]
        # the server holds every ack (settled); one not confirmed to us is an ack whose reply
        # was lost in the failover, never a record that was dropped
        unconfirmed = published[flow] - set(acked[flow])
        assert unconfirmed <= set(ack_errors), sorted(unconfirmed)

    # the restarted node catches up: JetStream makes it leader only once it is current
    for kind, consumer in LEADS:
        info = await make_leader(admin, victim_name, s.stream(kind), consumer)
        if not consumer:
            st = info.state
            assert st.last_seq == n and st.messages == (0 if kind == "TASKS" else n), st
        else:
            assert info.num_pending == 0 and info.num_ack_pending == 0, info
            assert info.ack_floor.stream_seq == n, info
    for b in (admin, learner, actor_pub, *actors, assembler):
        await b.close()


@pytest.mark.integration
def test_routes_refuse_a_node_without_the_route_credential_or_tls(
    cluster: list[NatsServer], tmp_path: Path
) -> None:
    """A node dialling the cluster's route port with a certificate of the right CA but a wrong
    route password is refused by authentication; one without TLS fails the handshake."""
    log = cluster[0].log_path
    seen = len(log.read_text())
    own = (f"127.0.0.1:{cluster[0].cluster.port}",)
    auth = cluster[0].auth
    wrong = dataclasses.replace(auth, passwords={**auth.passwords, natsauth.ROUTE_USER: "x"})
    rogues = [
        NatsServer(tmp_path / "r1", auth=wrong, cluster=Cluster("hrl", free_port(), own, "r1")),
        NatsServer(tmp_path / "r2", cluster=Cluster("hrl", free_port(), own, "r2")),
    ]
    try:
        for rogue in rogues:
            rogue.start()
        deadline = time.monotonic() + 30
        while True:
            new = log.read_text()[seen:]
            if 'authentication error - User "route"' in new and "TLS route handshake" in new:
                break
            assert time.monotonic() < deadline, new[-2000:]
            time.sleep(0.2)
        assert "Authorization Violation" in rogues[0].log_path.read_text()
    finally:
        for rogue in rogues:
            rogue.stop()


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_certificate_made_before_clusters_is_remade_for_routes(tmp_path: Path) -> None:
    """Routes verify both ends, so the server certificate must allow client authentication;
    one made before clusters existed (server authentication only) is remade, once."""
    hosts = ["127.0.0.1", "localhost"]
    _, cert, _ = natsauth.ensure_tls(tmp_path, hosts)
    (tmp_path / "server-hosts.json").write_text(json.dumps(sorted(hosts)))  # the old metadata
    old = cert.read_bytes()
    natsauth.ensure_tls(tmp_path, hosts)
    new = cert.read_bytes()
    assert new != old
    natsauth.ensure_tls(tmp_path, hosts)
    assert cert.read_bytes() == new
    usage = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "extendedKeyUsage"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "TLS Web Server Authentication" in usage and "TLS Web Client Authentication" in usage


@pytest.mark.integration
async def test_replicas_are_raised_never_lowered_and_impossible_counts_are_clear(
    cluster: list[NatsServer], nats_url: str
) -> None:
    """An existing R1 stream is raised to R3 by an admin asking for 3, and kept at 3 by one
    started with the default; 5 replicas on 3 nodes, or 3 on a single server, are one clear
    error each (not a hang, not a silent single copy)."""
    admin = await as_role(cluster, "admin", run="up")
    stream = admin.subjects.stream("SAMPLES")
    assert (await admin.js.stream_info(stream)).config.num_replicas == 1
    for replicas in (3, 1):  # raised, then not lowered by a default connect
        bus = await as_role(cluster, "admin", run="up", replicas=replicas)
        assert (await bus.js.stream_info(stream)).config.num_replicas == 3
        await bus.close()
    await admin.close()
    with pytest.raises(BusError, match="5 replicas need 5 JetStream servers"):
        await as_role(cluster, "admin", run="five", replicas=5, stream_wait_s=1.0)
    with pytest.raises(BusError, match="3 replicas need a JetStream cluster.*single server"):
        await busmod.connect(nats_url, "solo", replicas=3)


@pytest.mark.unit
def test_replica_and_cluster_settings_are_validated() -> None:
    """Config errors name the field and say what would work."""
    bad = {
        "stream replicas must be 1, 3 or 5": (NatsServerConfig, {"stream_replicas": 2}),
        "needs a cluster": (NatsServerConfig, {"stream_replicas": 3}),
        "exceeds the cluster's 3 nodes": (
            NatsServerConfig,
            {
                "cluster_name": "c",
                "stream_replicas": 5,
                "cluster_port": 7001,
                "routes": ["127.0.0.1:7001", "127.0.0.1:7002", "nats-route://127.0.0.1:7003"],
            },
        ),
        "routes need cluster_name": (NatsServerConfig, {"routes": ["h:1"]}),
        "is not HOST:PORT": (
            NatsServerConfig,
            {"cluster_name": "c", "routes": ["nats-route://route:secret@h:7002"]},
        ),
        "nats_stream_replicas = 3 needs an existing NATS cluster": (
            RunConfig,
            {"nats_stream_replicas": 3},
        ),
        "'http://b:4222' is not a nats:// URL": (RunConfig, {"nats": "tls://a:4222,http://b:4222"}),
    }
    for why, (model, values) in bad.items():
        with pytest.raises(ConfigError, match=why):
            load_config(model, overrides=values)
    ok = load_config(
        RunConfig, overrides={"nats": "tls://a:4222, tls://b:4222", "nats_stream_replicas": 3}
    )
    assert ok.nats_stream_replicas == 3
    three = {"cluster_name": "c", "stream_replicas": 3, "routes": ["h1:6222", "h2:6222"]}
    assert load_config(NatsServerConfig, overrides=three).cluster_size() == 3


def cluster_flags(tmp_path: Path, ports: list[int]) -> list[str]:
    """``harnessrl nats`` flags of a 3-replica cluster of nodes routing to ``ports``, sharing
    ``tmp_path/auth`` (made here, as the first node would make it)."""
    natsauth.prepare_server_auth(tmp_path / "auth", ["cl"])
    flags = ["--runs", "cl", "--auth-dir", str(tmp_path / "auth"), "--cluster-name", "c"]
    flags += ["--stream-replicas", "3", "--cluster-wait-s", "600"]
    for p in ports:
        flags += ["--routes", f"127.0.0.1:{p}"]
    return flags


@pytest.mark.integration
def test_nats_command_starts_the_nodes_of_a_cluster(tmp_path: Path) -> None:
    """Three ``harnessrl nats`` sharing one auth folder form a cluster over authenticated TLS
    routes and create the run's streams with 3 replicas; each prints its ready line once the
    cluster holds them, and stops on SIGTERM."""
    ports = [free_port() for _ in range(3)]
    flags = cluster_flags(tmp_path, ports)
    procs = []
    try:
        for i, port in enumerate(ports):
            procs.append(spawn_nats_cli(tmp_path / f"n{i}", *flags, "--cluster-port", str(port)))
        lines = [ready_line(p) for p in procs]
        for port, line in zip(ports, lines, strict=True):
            assert f"of cluster c (routes on port {port}), 3 replica(s)" in line, line
        urls = ",".join(line.split("ready: ")[1].split()[0] for line in lines)
        assert (tmp_path / "auth" / "route.cred").stat().st_mode & 0o077 == 0

        async def check() -> None:
            auth = tmp_path / "auth"
            bus = await busmod.connect(
                urls, "cl", creds=str(auth / "learner.cred"), ca=str(auth / "tls" / "ca.pem")
            )
            info = await bus.js.stream_info(bus.subjects.stream("TASKS"))
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
            await bus.close()

        asyncio.run(check())
    finally:
        for p in procs:
            stop_nats_cli(p)


@pytest.mark.integration
def test_a_node_waiting_for_its_cluster_stops_on_sigterm(tmp_path: Path) -> None:
    """A node whose peers never come waits for them (``--cluster-wait-s``), but SIGTERM ends
    the wait: it stops its server and exits 0 without a ready line."""
    flags = cluster_flags(tmp_path, [free_port() for _ in range(2)])  # nobody listens there
    proc = spawn_nats_cli(tmp_path, *flags, "--cluster-port", str(free_port()))
    ports = tmp_path / "store" / "ports"
    deadline = time.monotonic() + 120
    while not (ports.exists() and any(ports.iterdir())):  # its server is up, JetStream waits
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    stop_nats_cli(proc)
    out, err = proc.communicate()
    assert "ready" not in out and "stopped before it was ready" in err, (out, err)
