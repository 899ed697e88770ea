"""A nats-server that requires role credentials and TLS, for tests of trust on the bus: the
server (module-scoped fixture), a fresh run of it per test, and clients of each role.
``tests/conftest.py`` loads this module as a plugin, so every test module can ask for the
``secure_server`` and ``run`` fixtures."""

from __future__ import annotations

import itertools
import sys

import pytest

from harnessrl.common import bus as busmod
from harnessrl.common import natsauth
from harnessrl.common.bus import STREAMS, Bus
from harnessrl.common.natsd import NatsServer

RUNS = [f"sec{i}" for i in range(12)]
HRL = [sys.executable, "-m", "harnessrl.common.cli"]
_next_run = itertools.count()


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory: pytest.TempPathFactory):
    """One nats-server requiring role credentials and TLS (a generated CA) for runs ``RUNS``."""
    store = tmp_path_factory.mktemp("nats-secure")
    auth = natsauth.prepare_server_auth(store / "auth", RUNS, tls=True)
    srv = NatsServer(store, auth=auth).start()
    yield srv
    srv.stop()


@pytest.fixture
async def run(secure_server: NatsServer) -> str:
    """A run of the secure server whose streams the admin created (fresh per test)."""
    name = RUNS[next(_next_run) % len(RUNS)]
    admin = await as_role(secure_server, "admin", name)
    for kind in STREAMS:
        await admin.purge(kind)
    await admin.close()
    return name


def actor_creds(i: int = 0) -> str:
    """The user of actor ``i``'s own credential (``<auth>/actors/actor-<i>.cred``)."""
    return f"actor-{i}"


async def as_role(srv: NatsServer, role: str, run: str, **kw) -> Bus:
    return await busmod.connect(
        srv.url, run, name=f"test {role}", creds=srv.creds(role), ca=srv.ca, **kw
    )
