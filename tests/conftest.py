"""Shared fixtures: a real nats-server per test session, a fresh run name per test."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from common.natsd import NatsServer


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
