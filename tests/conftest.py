"""Shared fixtures: a real nats-server per test session, a fresh run name per test,
bubblewrap sandbox backends (skipped where bwrap cannot run) and a docker engine with the
sandbox image (skipped where dockerd cannot run).

Task environments (``actors/sandbox/envs.py``) are built into the default cache
(``$HARNESSRL_CACHE/envs``, as the docker rootfs and the tiny models are), so a session and the
sessions after it pay a build once; a docker environment image once per session engine."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from pathlib import Path

import pytest

from harnessrl.actors.sandbox.bwrap import BwrapBackend
from harnessrl.actors.sandbox.docker_image import DockerdError, PrivateDockerd, ensure_image
from harnessrl.common.natsd import NatsServer


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


async def bwrap_or_skip(root: Path, **kwargs) -> BwrapBackend:
    """A bubblewrap backend with its state under ``root`` (``kwargs``: see `BwrapBackend`);
    skips the test where bwrap cannot run (the probe says why)."""
    be = BwrapBackend(root, **kwargs)
    reason = await be.probe()
    if reason is not None:
        pytest.skip(f"bubblewrap not usable here: {reason}")
    return be


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


def procs_with(marker: str) -> list[int]:
    """Host pids whose environment or command line contains ``marker``."""
    found, needle = [], marker.encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        for f in ("environ", "cmdline"):
            try:
                if needle in Path(f"/proc/{d}/{f}").read_bytes():
                    found.append(int(d))
                    break
            except OSError:
                pass
    return found
