"""The distribution as a user installs it: one top-level import package (``harnessrl``) from the
wheel, a set-up script that stops when pip fails, and a lock file that covers every dependency."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
# deploy/lock.py is a script, not a package: load it by path.
_spec = importlib.util.spec_from_file_location("harnessrl_lock", REPO / "deploy" / "lock.py")
assert _spec and _spec.loader
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)
_spec = importlib.util.spec_from_file_location("harnessrl_ci", REPO / "deploy" / "check_imports.py")
assert _spec and _spec.loader
check_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_imports)

EXTRAS = ("train", "test")


def requirement_closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """``{canonical name: installed version}`` of every distribution ``root[extras]`` needs,
    transitively, in this environment (markers evaluated here)."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    while todo:
        name, want = todo.pop()
        dist = metadata.distribution(name)
        for line in dist.requires or []:
            req = Requirement(line)
            env_ok = any(
                req.marker is None or req.marker.evaluate({"extra": e}) for e in ("", *want)
            )
            if not env_ok:
                continue
            dep = lock.canonical(req.name)
            if dep == lock.canonical(root) or lock.UNPINNED.match(dep):
                continue
            first = dep not in seen
            try:
                seen[dep] = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                seen[dep] = "(not installed)"
                continue
            if first or req.extras:
                todo.append((req.name, tuple(req.extras)))
    return seen


@pytest.mark.unit
def test_the_lock_pins_every_dependency_at_its_installed_version():
    """deploy/constraints.txt pins each distribution harnessrl[train,test] needs, at the version
    this environment runs: a dependency added to pyproject.toml without ``deploy/lock.py`` (or
    an environment set up without the lock) fails here."""
    pins = lock.parse((REPO / "deploy" / "constraints.txt").read_text())
    needed = requirement_closure("harnessrl", EXTRAS)
    assert len(needed) > 30
    wrong = {n: (v, pins.get(n)) for n, v in needed.items() if pins.get(n) != v}
    assert wrong == {}, "run `.venv/bin/python deploy/lock.py` (installed, pinned)"


@pytest.mark.unit
def test_lock_rendering_round_trips_and_leaves_torch_to_torch_spec():
    pins = {"numpy": "2.1.0", "msgspec": "0.19.0"}
    assert lock.parse(lock.render(pins)) == pins
    for name in ("torch", "triton", "nvidia-cudnn-cu12", "harnessrl", "pip"):
        assert lock.UNPINNED.match(name)
    assert not lock.UNPINNED.match("torchvision") and not lock.UNPINNED.match("numpy")


@pytest.mark.unit
def test_import_check_reports_unresolved_names_but_not_protobufs_generated_ones(tmp_path: Path):
    src = tmp_path / "m.py"
    src.write_text("from tensorboard.compat.proto.summary_pb2 import Summary\nfrom x import Gone\n")

    def diag(line: int, msg: str, rule: str = "reportAttributeAccessIssue") -> dict:
        return {"file": str(src), "message": msg, "rule": rule, "range": {"start": {"line": line}}}

    found = check_imports.import_problems(
        [
            diag(0, '"Summary" is unknown import symbol'),
            diag(1, '"Gone" is unknown import symbol'),
            diag(1, 'Import "nowhere" could not be resolved', "reportMissingImports"),
            diag(1, '"Record" is not a known attribute of module "wandb.proto.x_pb2"'),
            diag(1, "Type of x is partially unknown", "reportUnknownMemberType"),
        ]
    )
    assert found == [
        f'{src}:2: "Gone" is unknown import symbol',
        f'{src}:2: Import "nowhere" could not be resolved',
    ]


@pytest.mark.slow
def test_setup_stops_when_pip_fails(tmp_path: Path):
    """deploy/setup.sh filters pip's output but not its exit status: a failed install ends the
    script with pip's error shown (it used to go on and print the venv as installed)."""
    bad = tmp_path / "constraints.txt"
    bad.write_text("pip==0.0.0\n")  # no such release: the first pip call fails
    env = {
        **os.environ,
        "VENV": str(tmp_path / "venv"),
        "EXTRAS": "test",
        "PIP_CONSTRAINT": str(bad),  # pip reads it on every call, whatever the script passes
    }
    proc = subprocess.run(
        ["bash", "deploy/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "harnessrl installed" not in out
    assert re.search(r"^ERROR: .*pip", out, re.M), out  # pip's own reason, shown


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(tmp_path: Path):
    """The wheel built from this checkout, installed into a fresh venv (dependencies borrowed
    from this environment's site-packages, not its editable harnessrl): ``harnessrl`` is the
    only import package it adds, ``import common`` fails, the CLI and the shipped data work."""
    dist, src = tmp_path / "dist", tmp_path / "src"
    # a copy of the tracked tree: setuptools builds in place, and would leave build/ here
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(dist), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = dist.glob("harnessrl-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"harnessrl"}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # a plain path line: this environment's packages become importable, but the .pth files in
    # it (the editable install's import hook) are not run
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = tmp_path / "elsewhere"
    run.mkdir()

    def py_run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [py, "-c", code], cwd=run, env=env, capture_output=True, text=True, timeout=300
        )

    for bare in ("common", "proxy", "actors", "learner", "benchmarks"):
        assert "ModuleNotFoundError" in py_run(f"import {bare}").stderr
    where = py_run(
        "import harnessrl.common.cli as c, harnessrl.common.models.resolve as r;"
        "print(c.__file__); print(r.SHIPPED['tiny-agent'])"
    )
    assert where.returncode == 0, where.stderr
    cli_file, tiny = where.stdout.split()
    assert Path(cli_file).is_relative_to(site) and Path(tiny).is_relative_to(site)
    assert (Path(tiny) / "config.json").is_file()
    helped = subprocess.run(
        [venv / "bin" / "harnessrl", "--help"], cwd=run, env=env, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "harnessrl" in helped.stdout, helped.stderr
    tasks = subprocess.run(
        [venv / "bin" / "harnessrl", "tasks", "list", "--suite", "toy-eval"],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tasks.returncode == 0 and "copy_eval01" in tasks.stdout, tasks.stderr
