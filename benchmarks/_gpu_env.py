"""What ``benchmarks/gpu_check.py`` needs on a bare GPU machine, carried in one folder.

A lent GPU machine has torch, transformers, triton, numpy, aiohttp, uvloop, msgpack and
prometheus-client, no network, and none of: pydantic (every harnessrl config), msgspec (the
records), xxhash and zstandard (weights digest, record compression), tomli-w, deepspeed (the
learner) and deepspeed's own dependencies. ``prepare(DIR)`` (here, with network) puts their
wheels in ``DIR/wheels`` (the versions installed here, binary ones for CPython 3.10-3.13 on
x86-64 Linux: about 40 MB) with a ``manifest.json``, and builds the check's model into
``DIR/cache``. On the GPU machine ``ensure(DIR)`` installs, with ``pip --no-index --no-deps
--target DIR/site-pyXY``, only the wheels whose modules are missing there, and puts that
folder first on ``sys.path``; ``ensure_harnessrl`` makes ``harnessrl.*`` importable from the
checkout without installing it (a folder of symlinks). Standard library only: this runs before
anything else can be imported.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES = {
    # module: distribution
    "pydantic": "pydantic",
    "pydantic_core": "pydantic-core",
    "annotated_types": "annotated-types",
    "typing_inspection": "typing-inspection",
    "msgspec": "msgspec",
    "xxhash": "xxhash",
    "zstandard": "zstandard",
    "tomli_w": "tomli-w",
    "deepspeed": "deepspeed",
    "hjson": "hjson",
    "cpuinfo": "py-cpuinfo",
    "ninja": "ninja",
    "einops": "einops",
    "psutil": "psutil",
}
"""Modules the check imports that a bare GPU machine may lack, and their distributions."""

NEWER = {"typing_extensions": "typing-extensions"}
"""Installed too when the machine's copy is older than the one carried (pydantic needs a
recent one)."""

BUILT = {"deepspeed"}
"""Distributed as an sdist: built here into a pure-Python wheel (``DS_BUILD_OPS=0``)."""

PYTHONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def prepare(folder: Path, pythons: tuple[str, ...] = PYTHONS, model: str = "tiny-1m") -> Path:
    """Fill ``folder`` for a GPU machine (needs the network and this checkout's venv)."""
    folder = Path(folder)
    wheels = folder / "wheels"
    for old in [wheels, *folder.glob("site-py*")]:  # site-py*: installs of an earlier ensure
        shutil.rmtree(old, ignore_errors=True)
    wheels.mkdir(parents=True)
    dists = {**MODULES, **NEWER}
    pins = {dist: md.version(dist) for dist in dists.values()}
    download = [f"{d}=={v}" for d, v in sorted(pins.items()) if d not in BUILT]
    for py in pythons:
        tag = "cp" + py.replace(".", "")
        args = ["download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
        args += ["--python-version", py, "--implementation", "cp", "--abi", tag]
        args += ["--abi", "abi3", "--abi", "none"]
        for plat in PLATFORMS:
            args += ["--platform", plat]
        res = _pip(*args, *download)
        if res.returncode != 0:
            raise RuntimeError(f"pip download for Python {py} failed: {res.stderr[-1500:]}")
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    for dist in sorted(BUILT):
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        cmd += ["-w", str(wheels), f"{dist}=={pins[dist]}"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"building the {dist} wheel failed: {res.stderr[-1500:]}")
    files = sorted(p.name for p in wheels.glob("*.whl"))
    manifest = {
        "prepared": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "pythons": list(pythons),
        "modules": MODULES,
        "newer": NEWER,
        "pins": pins,
        "wheels": files,
        "bytes": sum((wheels / f).stat().st_size for f in files),
    }
    os.environ["HARNESSRL_CACHE"] = str((folder / "cache").resolve())
    from harnessrl.common.models import resolve_model

    manifest["model"] = {model: str(resolve_model(model).relative_to(folder.resolve()))}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return folder


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def ensure(folder: Path) -> dict[str, object]:
    """Install what the check lacks from ``folder`` (see the module docstring); returns what
    was done. Also points ``HARNESSRL_CACHE`` at ``folder/cache`` when it is not set."""
    folder = Path(folder).resolve()
    manifest = json.loads((folder / "manifest.json").read_text())
    site = folder / f"site-py{sys.version_info.major}{sys.version_info.minor}"
    if site.exists():
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
    pins = manifest["pins"]
    need = sorted(
        {d for m, d in manifest["modules"].items() if importlib.util.find_spec(m) is None}
    )
    for module, dist in manifest["newer"].items():
        try:
            have = md.version(dist)
        except md.PackageNotFoundError:
            have = "0"
        if importlib.util.find_spec(module) is None or _version_tuple(have) < _version_tuple(
            pins[dist]
        ):
            need.append(dist)
    done: dict[str, object] = {"installed": need, "site": str(site), "via": "none"}
    if need:
        site.mkdir(parents=True, exist_ok=True)
        specs = [f"{d}=={pins[d]}" for d in need]
        res = _pip(
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--upgrade",
            "--find-links",
            str(folder / "wheels"),
            "--target",
            str(site),
            *specs,
        )
        if res.returncode == 0:
            done["via"] = "pip"
        else:  # no pip: unpack the wheels that fit this interpreter
            _unpack(folder / "wheels", need, pins, site)
            done["via"] = f"unzip (pip failed: {res.stderr.strip()[-300:]})"
        if str(site) not in sys.path:
            sys.path.insert(0, str(site))
        importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p
    )
    cache = folder / "cache"
    if cache.is_dir():
        os.environ.setdefault("HARNESSRL_CACHE", str(cache))
    missing = [m for m in manifest["modules"] if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"still missing after installing from {folder}: {missing}")
    return done


def _unpack(wheels: Path, dists: list[str], pins: dict[str, str], site: Path) -> None:
    from packaging.tags import sys_tags  # transformers depends on packaging
    from packaging.utils import parse_wheel_filename

    ours = {str(t) for t in sys_tags()}
    for dist in dists:
        norm = dist.replace("-", "_").lower()
        for whl in sorted(wheels.glob("*.whl")):
            name, version, _, tags = parse_wheel_filename(whl.name)
            if name.replace("-", "_") != norm or str(version) != pins[dist]:
                continue
            if ours & {str(t) for t in tags}:
                with zipfile.ZipFile(whl) as z:
                    z.extractall(site)
                break
        else:
            raise RuntimeError(f"no wheel of {dist}=={pins[dist]} for this Python in {wheels}")


def ensure_harnessrl() -> str:
    """``harnessrl.*`` from this checkout: installed already, or a temporary folder holding
    ``harnessrl/{common,proxy,actors,learner}`` as symlinks to the checkout's folders."""
    try:
        import harnessrl.common

        return "installed"
    except ImportError:
        pass
    ns = Path(tempfile.mkdtemp(prefix="hrl-ns-")) / "harnessrl"
    ns.mkdir()
    atexit.register(shutil.rmtree, ns.parent, True)  # unlinks the symlinks, not their targets
    for sub in ("common", "proxy", "actors", "learner"):
        (ns / sub).symlink_to(ROOT / sub, target_is_directory=True)
    sys.path.insert(0, str(ns.parent))
    importlib.invalidate_caches()
    import harnessrl.common  # noqa: F401

    return f"symlinks in {ns.parent}"
