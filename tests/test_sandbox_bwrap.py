"""What only bubblewrap sandboxes have: the proxy forwarder's build and its rlimits, per-sandbox
uids and their sweeps, the warm pool's blanks. What every backend holds (commands, files, the
forwarder's proxying, escapes, limits, lifecycle) is in ``test_sandbox_contract.py``.

Skips only when bubblewrap cannot run here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from harnessrl.actors.sandbox import SandboxError, SandboxSpec
from harnessrl.actors.sandbox.bwrap import BwrapBackend
from tests.helpers.sandboxes import bwrap_or_skip, py, uid_of
from tests.helpers.wait import until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- proxy forwarder


@pytest.fixture(params=["c", "python"])
async def fwd_backend(request: pytest.FixtureRequest, tmp_path: Path):
    """The backend with each forwarder: the compiled one and the Python fallback."""
    be = await bwrap_or_skip(tmp_path / "sandboxes", forwarder=request.param)
    async with be:
        assert be.forwarder_kind == request.param
        yield be


def test_forwarder_choice_and_build_errors(tmp_path: Path):
    """A bad ``forwarder`` is refused; a compiler that fails is a `SandboxError` (``auto``
    then falls back to the Python forwarder, ``c`` raises); a good build is cached."""
    from harnessrl.actors.sandbox.bwrap import build_forwarder

    with pytest.raises(ValueError, match="forwarder"):
        BwrapBackend(tmp_path, forwarder="rust")
    with pytest.raises(SandboxError, match="cannot build"):
        build_forwarder(tmp_path / "fwd", cc="/bin/false")
    if shutil.which("cc"):
        first = build_forwarder(tmp_path / "fwd")
        assert os.access(first, os.X_OK) and build_forwarder(tmp_path / "fwd") == first


async def test_forwarder_auto_falls_back_to_python(tmp_path: Path, monkeypatch):
    """Where no C compiler works, ``auto`` runs the Python forwarder; ``c`` refuses to start."""
    monkeypatch.setenv("CC", "/bin/false")
    auto = await bwrap_or_skip(tmp_path / "a", forwarder_cache_dir=tmp_path / "fa")
    async with auto:
        assert auto.forwarder_kind == "python"
    strict = BwrapBackend(tmp_path / "c", forwarder="c", forwarder_cache_dir=tmp_path / "fc")
    with pytest.raises(SandboxError, match="cannot build"):
        await strict.start()


async def test_rlimits_hold_under_either_forwarder(fwd_backend: BwrapBackend, tmp_path: Path):
    """The launcher sets the sandbox's rlimits under either forwarder (the compiled one sets
    them itself): processes, file size, no core dumps."""
    code = """
        import resource as r
        for x in ("NPROC", "FSIZE", "CORE"):
            print(r.getrlimit(getattr(r, "RLIMIT_" + x))[0])
    """
    spec = SandboxSpec(proxy_socket=tmp_path / "proxy.sock", proxy_port=18080)
    async with await fwd_backend.create(spec) as s:
        lim = await s.run(py(code), timeout=10)
    assert lim.stdout.split() == [b"1024", str(4 * 2**30).encode(), b"0"], lim


@pytest.mark.integration
async def test_forwarder_measures_the_commands_cpu(fwd_backend: BwrapBackend, unix_http: Path):
    """The launcher inside reports the CPU seconds of the command and of the processes it
    waited for (a child that burns CPU counts): bwrap's pid namespace hides them from the
    host's ``RUSAGE_CHILDREN``. A run without the forwarder measures nothing."""
    import resource

    code = """
        import subprocess, sys, time
        subprocess.run([sys.executable, "-c", "t = __import__('time').process_time()\\n"
                        "while __import__('time').process_time() - t < 0.4: pass"])
        t = time.process_time()
        while time.process_time() - t < 0.3:
            pass
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    async with await fwd_backend.create(SandboxSpec(proxy_socket=unix_http)) as s:
        r = await s.run(py(code), timeout=60)
        assert r.returncode == 0, r
        assert r.cpu_s is not None and 0.65 <= r.cpu_s < 5.0, r.cpu_s
        quiet = await s.run(["true"], proxy=False)
        assert quiet.cpu_s is None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert after.ru_utime - before.ru_utime < 0.5  # what the forwarder's report is for


# ---------------------------------------------------------------------- sweeps


POOL_OWNER = """
import asyncio, sys
from harnessrl.actors.sandbox.bwrap import BwrapBackend

async def main():
    be = BwrapBackend(sys.argv[1], pool_size=2, sweep_on_start=False)
    await be.start()
    await be.pool.wait_full()
    print(*(b.path for b in be.pool._ready), flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def test_sweep_removes_a_dead_pools_blanks_and_spares_a_live_pools(
    backend: BwrapBackend,
):
    """Blanks made ahead by a pool are kept while their pool lives (even when old), removed by
    sweep once it died; a closed pool leaves nothing behind."""
    owner = subprocess.Popen(
        [sys.executable, "-c", POOL_OWNER, str(backend.root)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 30)
        dead = [Path(x) for x in line.decode().split()]
    finally:
        owner.kill()
        owner.wait()
    live = BwrapBackend(backend.root, pool_size=2, sweep_on_start=False)
    await live.start()
    await live.pool.wait_full()
    blanks = [b.path for b in live.pool._ready]
    for d in dead + blanks:  # older than any create in progress
        os.utime(d, (time.time() - 600, time.time() - 600))
    assert len(dead) == 2 and all(d.is_dir() for d in dead + blanks)
    assert await backend.sweep() == 2
    assert not any(d.exists() for d in dead) and all(b.is_dir() for b in blanks)
    sb = await live.create(SandboxSpec(owner="pooled"))
    assert sb.state_dir.name.startswith("pooled-")
    await sb.destroy()
    await live.close()
    assert sorted(p.name for p in backend.root.iterdir()) == []


async def test_sweep_kills_processes_left_under_a_dead_sandbox_uid(backend: BwrapBackend):
    """Root mode: anything still running as a dead sandbox's own uid is killed by sweep."""
    if backend.mode != "root":
        pytest.skip("per-sandbox uids exist in root mode only")
    marker = f"hrl-sweep-uid-{uuid.uuid4().hex}"
    s = await backend.create(SandboxSpec(owner="doomed"))
    uid, state = s.uid, s.state_dir
    stray = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "300"],
        env={"HRL_TEST_MARKER": marker},
        start_new_session=True,
    )
    try:
        await until(lambda: uid_of(stray.pid) == uid, 10, "setpriv to switch to the uid")
        # the owner "dies": its flocks go away, nothing is cleaned up
        os.close(s._lock_fd)
        os.close(s._uid_fd)
        backend._live.discard(s)
        assert await backend.sweep() == 1
        assert not state.exists()
        assert await asyncio.wait_for(asyncio.to_thread(stray.wait), 5) == -signal.SIGKILL
    finally:
        stray.kill()
        stray.wait()


async def test_sweep_spares_a_live_sandbox_given_a_dead_ones_uid(tmp_path: Path):
    """A dead owner's uid lock is free at once: another actor's new sandbox may get that uid
    before the dead state is swept. Sweep then removes the state but kills nothing: the
    processes under that uid are the live sandbox's."""
    # two actors sharing a uid range and its lock dir (private to this test)
    shared = {"uid_lock_dir": tmp_path / "uids", "uid_base": 2_100_000_000 + os.getpid() % 1000}
    dying = await bwrap_or_skip(tmp_path / "dying", **shared)
    if dying.mode != "root":
        pytest.skip("per-sandbox uids exist in root mode only")
    other = await bwrap_or_skip(tmp_path / "other", **shared)
    async with dying, other:
        s = await dying.create(SandboxSpec(owner="doomed"))
        uid, state = s.uid, s.state_dir
        os.close(s._lock_fd)  # the owner dies: both its flocks go away
        os.close(s._uid_fd)
        dying._live.discard(s)
        live = await other.create(SandboxSpec(owner="alive"))
        assert live.uid == uid  # the lowest free uid: the one the dead sandbox had
        running = asyncio.create_task(live.run(["sleep", "30"], timeout=60))
        try:
            await until(
                lambda: any(uid_of(p.name) == uid for p in Path("/proc").glob("[0-9]*")),
                10,
                "the live sandbox's command to run as the uid",
            )
            assert await dying.sweep() == 1
            assert not state.exists()
            await asyncio.sleep(0.3)  # a window for a wrong kill to land in
            assert not running.done()  # not killed from outside
        finally:
            await live.destroy()
            with contextlib.suppress(BaseException):
                await running


async def test_sweep_survives_entries_that_vanish_while_it_looks(
    backend: BwrapBackend, monkeypatch: pytest.MonkeyPatch
):
    """Another process's create renames or removes its ``.new-`` folder between the sweep's
    listing and its look at the entry (two actors, or an eval beside a run, share the root):
    the sweep skips the entry instead of failing the process that is starting."""
    import harnessrl.actors.sandbox.bwrap as bwrap_mod

    gone = [backend.root / f".new-{os.getpid()}-vanish", backend.root / "vanished-sandbox"]
    real = os.scandir

    def racing_scandir(path=".", *args):
        if Path(path) != backend.root:  # os.scandir is the os module's: others pass through
            return real(path, *args)
        for d in gone:
            d.mkdir(parents=True, exist_ok=True)
        entries = list(real(path))
        for d in gone:  # the owner finished its create (rename) or destroy meanwhile
            os.rmdir(d)
        return iter(entries)

    monkeypatch.setattr(bwrap_mod.os, "scandir", racing_scandir)
    assert await backend.sweep() == 0
