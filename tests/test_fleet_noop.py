"""The fleet benchmark's no-op sandbox (``benchmarks/fleet.py``): no isolation, but everything a
rollout runs in it stays inside its own host folder, and the real verifier scores it."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.fleet import NoopBackend
from harnessrl.actors.harnesses.base import LaunchSpec, write_launch_files
from harnessrl.actors.sandbox import SandboxSpec
from harnessrl.actors.verifier import verify
from harnessrl.common.tasks import load_task

pytestmark = pytest.mark.integration

TASK = load_task("toy", "copy_01")


async def test_noop_sandbox_keeps_its_paths_and_the_real_verifier_scores_it(tmp_path: Path):
    """Launch files for ``$HOME`` land in the sandbox's folder (never the host's home), the
    verifier's checker runs for real on the workspace (right output: 1.0, none: 0) with its
    ``/tmp`` in the sandbox's folder too, and destroying the sandbox removes that folder."""
    backend = NoopBackend(tmp_path / "noop")
    await backend.start()
    home = "/home/hrl-fleet-test"
    spec = SandboxSpec(workspace_src=TASK.workspace_dir, workdir=TASK.mount, home=home)
    sb = await backend.create(spec)
    launch = LaunchSpec(["true"], {"HOME": home}, "chat", files={f"{home}/.hrl/i.md": "hi"})
    await write_launch_files(sb, launch)
    assert (sb.state / "home" / ".hrl" / "i.md").read_text() == "hi"
    assert not Path(home).exists()
    assert (await verify(TASK, sb)).reward == 0.0
    expected = TASK.reward_dir / "expected.json"
    await sb.write_file("output.txt", json.loads(expected.read_text())["expected"].encode())
    res = await verify(TASK, sb)
    assert (res.status, res.reward) == ("ok", 1.0)
    staged = [p.name for p in (sb.state / "tmp").iterdir()]  # the verifier's /tmp was ours
    assert any(n.startswith("hrl-reward-") for n in staged), staged
    await backend.close()
    assert list((tmp_path / "noop").iterdir()) == []


def test_actor_raises_its_open_files_limit() -> None:
    """An actor started with the common 1,024 soft limit of open files runs with its hard
    limit (the fleet benchmark measured 1,034 descriptors in one actor at 260 rollouts)."""
    code = (
        "import resource, asyncio\n"
        "from harnessrl.actors import service\n"
        "class Stop(Exception): pass\n"
        "async def connect(*a, **k): raise Stop\n"
        "import harnessrl.common.bus\n"
        "harnessrl.common.bus.connect_service = connect\n"
        "from harnessrl.actors.config import ActorConfig\n"
        "try: asyncio.run(service.serve(ActorConfig(metrics_port=-1)))\n"
        "except Stop: pass\n"
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"hard limit of open files is {hard}: nothing to raise")

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    out = subprocess.run(
        [sys.executable, "-c", code], preexec_fn=low, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[0]) > 1024
