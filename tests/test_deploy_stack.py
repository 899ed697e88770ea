"""The compose CPU stack for real: images built here offline (``deploy/images/build.py``), the
fleet of ``deploy/compose/docker-compose.yml`` up with three actors, training through a NATS
node stop, Prometheus seeing every actor, and nothing left after ``down``.

Marked ``stack`` and deselected by default (pyproject's ``addopts``): it takes minutes and
builds images. Run it with ``pytest -m stack tests/test_deploy_stack.py``; ``.ci/run`` does,
after the test command, and fails when it does not pass. It fails, never skips, when docker
cannot start. It uses a private dockerd (root, ``docker.io``; stopped by PID
and its folder removed afterwards) unless ``HRL_TEST_DOCKER_HOST`` names an engine, whose layer
cache then makes the build incremental (only harnessrl's own layers follow a code change).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from harnessrl.actors.sandbox.docker_image import DockerdError, PrivateDockerd
from harnessrl.common.files import free_port

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "deploy" / "compose" / "docker-compose.yml"
STEPS_BEFORE = 3
"""Optimiser steps the stack must reach before a NATS node is stopped..."""
STEPS_DURING = 2
"""...and the further steps it must take with that node down."""

pytestmark = [pytest.mark.stack, pytest.mark.slow]


@pytest.fixture(scope="module")
def docker_url(tmp_path_factory: pytest.TempPathFactory):
    """A docker engine: ``$HRL_TEST_DOCKER_HOST`` or a private dockerd (failing, not skipping,
    when it cannot start)."""
    if url := os.environ.get("HRL_TEST_DOCKER_HOST"):
        yield url
        return
    if shutil.which("dockerd") is None:
        pytest.fail("dockerd is not installed (apt-get install docker.io)")
    daemon = PrivateDockerd(tmp_path_factory.mktemp("stack-dockerd"))
    try:
        daemon.start(timeout=180)
    except DockerdError as e:
        pytest.fail(f"dockerd cannot start here: {e}")
    try:
        yield daemon.url
    finally:
        daemon.stop(remove=True)
    assert not daemon.root.exists(), f"the private dockerd left {daemon.root} behind"


def build_images(env: dict) -> list[dict]:
    """``deploy/images/build.py`` on the engine of ``env``: its JSON lines (phases, images)."""
    res = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "images" / "build.py")],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


class Stack:
    """One compose project on the engine, on free loopback ports."""

    def __init__(self, docker_url: str, tmp: Path) -> None:
        self.project = "hrlt" + uuid.uuid4().hex[:8]
        self.prom_port = free_port()
        ports = {f"HRL_NATS_PORT_{i}": free_port() for i in range(3)}
        ports.update({f"HRL_NATS_ROUTE_PORT_{i}": free_port() for i in range(3)})
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HRL_")},
            **{k: str(v) for k, v in ports.items()},
            "DOCKER_HOST": docker_url,
            "HRL_RUN": "stack",
            "HRL_STEPS": "1000",
            "HRL_STREAM_REPLICAS": "3",
            "HRL_ENGINE_PORT": str(free_port()),
            "HRL_PROMETHEUS_PORT": str(self.prom_port),
            "COMPOSE_HTTP_TIMEOUT": "600",
        }
        self.log = tmp / "compose.log"

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> str:
        argv = ["docker-compose", "-f", str(COMPOSE_FILE), "-p", self.project, *args]
        with open(self.log, "a") as log:
            log.write(f"$ {' '.join(argv)}\n")
            res = subprocess.run(
                argv, env=self.env, capture_output=True, text=True, timeout=timeout
            )
            log.write(res.stdout + res.stderr)
        if check and res.returncode != 0:
            raise AssertionError(f"docker-compose {args[0]} failed: {res.stderr[-3000:]}")
        return res.stdout

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/query?{q}"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["data"]["result"]

    def targets(self, job: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/targets?state=active"
        with urllib.request.urlopen(url, timeout=10) as r:
            active = json.load(r)["data"]["activeTargets"]
        return [t for t in active if t["labels"].get("job") == job]

    def version(self) -> int:
        try:
            res = self.query("max(hrl_learner_version)")
        except OSError:
            return -1
        return int(float(res[0]["value"][1])) if res else -1

    def wait(self, what: str, cond, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(5)
        tail = self.compose("logs", "--tail=40", check=False)
        raise AssertionError(f"timed out waiting for {what}; last logs:\n{tail[-6000:]}")

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        out = []
        for kind in ("container", "volume", "network"):
            argv = ["docker", kind, "ls", "-q", "--filter", label]
            if kind == "container":
                argv = ["docker", "ps", "-aq", "--filter", label]
            res = subprocess.run(argv, env=self.env, capture_output=True, text=True, check=True)
            out += [f"{kind} {x}" for x in res.stdout.split()]
        return out


def docker(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert res.returncode == 0, (args, res.stderr[-3000:])
    return res


def check_images(env: dict, tags: dict[str, str]) -> None:
    """What the built images hold: harnessrl as one import package in both; torch, DeepSpeed
    and the learner only in cpu (the actor image has no torch); the two share the dependency
    layers of their common stage (no venv copied between them)."""

    def python(image: str, code: str) -> subprocess.CompletedProcess:
        argv = ["run", "--rm", "--network", "none", "--entrypoint", "python3", tags[image]]
        return docker(env, *argv, "-c", code, check=False)

    for image in ("actor", "cpu"):
        res = python(image, "import harnessrl.actors, harnessrl.proxy, harnessrl.common")
        assert res.returncode == 0, (image, res.stderr[-2000:])
        res = python(image, "import common")
        assert "ModuleNotFoundError" in res.stderr, (image, res)
    res = python("cpu", "import torch, deepspeed, harnessrl.learner")
    assert res.returncode == 0, res.stderr[-2000:]
    res = python("actor", "import torch")
    assert "ModuleNotFoundError" in res.stderr, res

    def layers(tag: str) -> list[str]:
        out = docker(env, "image", "inspect", "--format", "{{json .RootFS.Layers}}", tag).stdout
        return json.loads(out)

    actor, cpu = layers(tags["actor"]), layers(tags["cpu"])
    shared = len(os.path.commonprefix([actor, cpu]))
    base = os.path.commonprefix([actor, cpu, layers(tags["prometheus"])])
    assert len(base) < shared < min(len(actor), len(cpu)), (len(base), shared, actor, cpu)


@pytest.mark.timeout(900)  # CI's budget for it; 312 s cold here (images 239 s)
def test_compose_cpu_stack_trains_through_a_nats_node_stop(docker_url: str, tmp_path: Path):
    """Build (the images hold what each needs), up with 3 actors, ≥3 steps, a NATS node stopped and training goes on, 3 actor
    targets up in Prometheus, down with nothing left behind."""
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed (apt-get install docker-compose)")
    stack = Stack(docker_url, tmp_path)
    t0 = time.monotonic()
    report = build_images(stack.env)
    built = time.monotonic()
    tags = {
        r["image"].split(":")[0].removeprefix("harnessrl-"): r["image"]
        for r in report
        if "image" in r
    }
    assert {"actor", "cpu", "prometheus"} <= set(tags), report
    check_images(stack.env, tags)
    try:
        stack.compose("up", "-d", "--scale", "actor=3")
        stack.wait(f"{STEPS_BEFORE} steps", lambda: stack.version() >= STEPS_BEFORE, 1500)
        first = time.monotonic()
        stack.wait("3 actor targets up", lambda: len(
            [t for t in stack.targets("hrl-actor") if t["health"] == "up"]) == 3, 300)  # fmt: skip
        up = [t for t in stack.targets("hrl-actor") if t["health"] == "up"]
        assert len({t["labels"]["process"] for t in up}) == 3
        v0 = stack.version()
        stack.compose("stop", "nats-0")
        stack.wait(
            f"{STEPS_DURING} steps with nats-0 stopped",
            lambda: stack.version() >= v0 + STEPS_DURING,
            1500,
        )
        trained = time.monotonic()
    finally:
        stack.compose("down", "-v", "--remove-orphans", "--timeout", "60", check=False)
    assert stack.leftovers() == []
    phases = ", ".join(
        f"{r.get('phase') or r['image']} {r.get('seconds', r.get('total_s', r.get('built_s')))} s"
        for r in report
    )
    print(
        f"\nstack: images {built - t0:.0f} s ({phases}), up to {STEPS_BEFORE} steps "
        f"{first - built:.0f} s, {STEPS_DURING} more with nats-0 stopped "
        f"{trained - first:.0f} s, down {time.monotonic() - trained:.0f} s"
    )
