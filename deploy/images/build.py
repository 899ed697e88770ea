"""Build the harnessrl images on this machine, offline: no image registry is needed.

    python deploy/images/build.py [--docker-host URL] [--target actor|cpu|prometheus ...]
                                  [--tag local] [--harness NAME ...] [--no-envs]
                                  [--method auto|debootstrap|host] [--cache-dir DIR]

1. **Base**: the docker sandbox backend's own image (``harnessrl.actors.sandbox.docker_image``: a Debian
   userland with python3, bubblewrap, nodejs, ca-certificates, openssl and procps, from the
   rootfs tarball it bootstraps once per machine with debootstrap, or from the host's own
   packages), imported as ``harnessrl-base:<key>``.
2. **Build context** (a temp folder): ``wheels/core`` holds every dependency of ``harnessrl``
   and ``wheels/train`` what the ``train`` extra adds (torch, DeepSpeed, matplotlib and
   theirs), each at the version installed in *this* Python (``pip download`` for the image's
   interpreter, probed from the base; pip finds what this machine already has: its find-links,
   its index, its HTTP cache; DeepSpeed has no wheel on PyPI and is built here once with
   ``DS_BUILD_OPS=0``); ``wheels/hrl`` harnessrl's wheel, built from this checkout;
   ``harnesses/`` the harnesses named with ``--harness`` (installed on this host first,
   ``harnessrl harness install``); ``envs/`` the wheelhouses of the built-in task environments
   (``actors/sandbox/envs.py``), so actors build a task's environment without an index;
   ``prometheus`` the host's binary. Downloads are cached in ``<cache>/images``.
3. **docker build** of ``deploy/images/Dockerfile`` (``Dockerfile.prometheus``) per target with
   ``BASE`` set and network ``none``, each sent only its part of the context (no torch for the
   actor): images ``harnessrl-actor:TAG``, ``harnessrl-cpu:TAG``, ``harnessrl-prometheus:TAG``.
   The GPU image (``Dockerfile.gpu``) needs a registry (CUDA base) and is built with plain
   ``docker build`` on a machine that has one.

Prints one JSON line per image (tag, id, size, seconds, context bytes) and per phase (``base``:
rootfs and import; ``context``: wheels, harnesses, environments). Needs a docker engine
(``DOCKER_HOST``, or ``--docker-host``; ``python -m harnessrl.actors.sandbox.docker_image`` explains the
private one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = Path(__file__).with_name("Dockerfile")
TARGETS = ("actor", "cpu", "prometheus")
IMAGE = {t: f"harnessrl-{t}" for t in TARGETS}
LAYOUT = 1
"""Bump when the wheelhouse recipe changes: cached downloads are then ignored."""


class BuildError(RuntimeError):
    """An image could not be built; the message says which step and why."""


def _run(argv: list[str], what: str, **kw) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=3600, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{what}: {e}") from None
    if p.returncode != 0:
        raise BuildError(f"{what} exited {p.returncode}: {(p.stderr or p.stdout)[-2000:]}")
    return p.stdout


# ---------------------------------------------------------------------------------------------
# wheels
# ---------------------------------------------------------------------------------------------


def project_requirements(extra: str | None = None) -> list[str]:
    """``harnessrl``'s core requirements, or those its ``extra`` adds, from pyproject.toml."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(meta["optional-dependencies"][extra] if extra else meta["dependencies"])


def installed_pins() -> list[str]:
    """``name==version`` of every distribution of this Python but harnessrl and pip (the
    images install what the tests here run against)."""
    pins = {}
    for d in md.distributions():
        name = (d.metadata["Name"] or "").lower()
        if name and name not in ("harnessrl", "pip"):  # pip: the one envs.py pins
            pins[name] = f"{name}=={d.version}"
    return sorted(pins.values())


def build_harnessrl_wheel(out: Path, cache: Path) -> None:
    """harnessrl's wheel, built from this checkout."""
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w"]
    with tempfile.TemporaryDirectory(prefix=".src-", dir=cache) as src:
        # a copy: setuptools leaves build/ and *.egg-info in the tree it builds
        for name in ("pyproject.toml", "setup.py", "README.md"):
            shutil.copy2(REPO / name, Path(src) / name)
        skip = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
        for pkg in ("common", "proxy", "actors", "learner"):  # setup.py's harnessrl.*
            shutil.copytree(REPO / pkg, Path(src) / pkg, ignore=skip)
        _run([*pip, str(out), src], "building the harnessrl wheel")


def deepspeed_wheel(cache: Path) -> Path:
    """The folder of DeepSpeed's wheel at this Python's version: pure Python with
    ``DS_BUILD_OPS=0``; PyPI has only its sdist, so it is built once per machine (pip's wheel
    cache serves it when ``deploy/setup.sh`` built it already)."""
    version = md.version("deepspeed")
    done = cache / f"deepspeed-{version}"
    if not list(done.glob("deepspeed-*.whl")):
        tmp = Path(tempfile.mkdtemp(prefix=".ds-", dir=cache))
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        _run([*argv, "-w", str(tmp), f"deepspeed=={version}"], "building the DeepSpeed wheel",
             env=env)  # fmt: skip
        shutil.rmtree(done, ignore_errors=True)
        os.rename(tmp, done)
    return done


def download_wheels(requirements: list[str], target, cache: Path, links: list[Path]) -> Path:
    """A cached folder with ``requirements`` and every dependency (pinned to this Python's
    versions) as wheels for ``target`` (``harnessrl.actors.sandbox.envs.Target``); ``links``: local
    wheels besides the configured find-links (DeepSpeed's)."""
    pins = installed_pins()
    key = hashlib.blake2b(
        json.dumps([LAYOUT, pins, requirements, target.__dict__]).encode(), digest_size=6
    ).hexdigest()
    done = cache / f"wheels-{key}"
    if not (done / "complete").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".wheels-", dir=cache))
        (tmp / "constraints.txt").write_text("\n".join(pins) + "\n")
        argv = [sys.executable, "-m", "pip", "download", "--dest", str(tmp), "--progress-bar"]
        argv += ["off", "--disable-pip-version-check", "--no-input", *target.pip_flags()]
        argv += ["-c", str(tmp / "constraints.txt"), *requirements]
        found = " ".join(filter(None, [os.environ.get("PIP_FIND_LINKS", ""), *map(str, links)]))
        _run(argv, "pip download", env={**os.environ, "PIP_FIND_LINKS": found})
        (tmp / "complete").write_text(f"{time.time()}\n")
        shutil.rmtree(done, ignore_errors=True)
        os.rename(tmp, done)
    return done


def prepare_wheels(out: Path, target, cache: Path, train: bool) -> None:
    """``out/core`` (harnessrl's dependencies and pip), ``out/train`` (what the ``train``
    extra adds, none of core's wheels) and ``out/hrl`` (harnessrl's wheel)."""
    from harnessrl.actors.sandbox.envs import PIP_REQUIREMENT

    for d in ("core", "train", "hrl"):
        (out / d).mkdir(parents=True)
    build_harnessrl_wheel(out / "hrl", cache)
    core = download_wheels([*project_requirements(), PIP_REQUIREMENT], target, cache, [])
    for whl in core.glob("*.whl"):
        shutil.copy2(whl, out / "core" / whl.name)
    if not train:
        return
    ds = deepspeed_wheel(cache)
    extra = download_wheels(project_requirements("train"), target, cache, [ds])
    for whl in extra.glob("*.whl"):
        if not (out / "core" / whl.name).exists():
            shutil.copy2(whl, out / "train" / whl.name)


# ---------------------------------------------------------------------------------------------
# the build context
# ---------------------------------------------------------------------------------------------


async def probe_target(docker, base: str):
    """``harnessrl.actors.sandbox.envs.Target`` of the base image's python3."""
    from harnessrl.actors.sandbox.docker_image import _build_container
    from harnessrl.actors.sandbox.envs import PROBE_CODE, Target

    rc, out, _ = await _build_container(docker, base, ["python3", "-I", "-c", PROBE_CODE], [], {})
    if rc != 0:
        raise BuildError(f"the base image's python3 failed (exit {rc}): {out[-500:]}")
    return Target.parse(out)


def prepare_context(
    ctx: Path, targets: list[str], target, cache: Path, harnesses: list[str], envs: bool
) -> None:
    """Lay out the build context of ``targets`` in ``ctx`` (`context_members` picks each
    image's part)."""
    rel = "deploy/images/entrypoint.sh"
    (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / rel, ctx / rel)
    for f in ("Dockerfile", "Dockerfile.prometheus"):
        shutil.copy2(DOCKERFILE.with_name(f), ctx / f)
    for d in ("harnesses", "envs"):
        (ctx / d).mkdir()
    if {"actor", "cpu"} & set(targets):
        prepare_wheels(ctx / "wheels", target, cache, train="cpu" in targets)
    if "actor" in targets:
        copy_harnesses(ctx / "harnesses", harnesses)
        if envs:
            copy_env_wheelhouses(ctx / "envs", target)
    if "prometheus" in targets:
        exe = shutil.which("prometheus")
        if exe is None:
            raise BuildError(
                "the prometheus image needs Prometheus here: apt-get install prometheus"
            )
        shutil.copy2(exe, ctx / "prometheus")


def context_members(image: str, rel: str) -> bool:
    """Whether ``rel`` (a path of the prepared context) is sent with ``image``'s build: the
    actor's context has no torch (``wheels/train``); cpu's has the actor's files too (the legacy
    builder builds the actor stage on the way, from the layer cache); Prometheus' only its
    binary."""
    top = rel.split("/", 1)[0]
    if image == "prometheus":
        return rel in (".", "Dockerfile.prometheus", "prometheus")
    return top != "prometheus" and not (image == "actor" and rel.startswith("wheels/train"))


def write_context_tar(ctx: Path, dest: Path, image: str) -> None:
    """``image``'s build context (`context_members`) as an uncompressed tar."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = os.path.normpath(info.name)
        return info if context_members(image, rel) else None

    with tarfile.open(dest, "w") as tf:
        tf.add(ctx, arcname=".", filter=keep)


def copy_harnesses(out: Path, names: list[str]) -> None:
    """Install (when missing) and copy the named harnesses of this host's harness cache."""
    from harnessrl.actors.harnesses import ADAPTERS, default_cache_dir

    cache = default_cache_dir()
    for name in names:
        if name not in ADAPTERS:
            raise BuildError(f"unknown harness {name!r} (harnesses: {', '.join(ADAPTERS)})")
        adapter = ADAPTERS[name]
        if not adapter.is_installed(cache):
            asyncio.run(adapter.install(cache))
        src = adapter.install_dir(cache)
        if src.is_dir():
            shutil.copytree(src, out / src.name, symlinks=True)


def copy_env_wheelhouses(out: Path, target) -> None:
    """The wheelhouse of every built-in task environment with packages, for ``target``, at
    the name an actor's sandbox backend looks for (``<cache>/envs/wheels-<key>``)."""
    from harnessrl.actors.sandbox.envs import env_cache_dir, wheelhouse
    from harnessrl.common.tasks.environments import BUILTIN_ENVS

    for env in BUILTIN_ENVS.values():
        if env.pip:
            src = wheelhouse(env, target, env_cache_dir())
            shutil.copytree(src, out / src.name)


# ---------------------------------------------------------------------------------------------
# docker
# ---------------------------------------------------------------------------------------------


async def docker_build(docker, ctx_tar: Path, target: str, tag: str, base: str) -> dict:
    """``docker build --target TARGET --network none --build-arg BASE=base`` of the context."""
    params = {
        "t": tag,
        "target": target,
        "dockerfile": "Dockerfile.prometheus" if target == "prometheus" else "Dockerfile",
        "buildargs": json.dumps({"BASE": base}),
        "networkmode": "none",
        "rm": "1",
        "forcerm": "1",
    }

    async def chunks():
        with open(ctx_tar, "rb") as f:
            while chunk := await asyncio.to_thread(f.read, 1 << 20):
                yield chunk

    t0 = time.monotonic()
    headers = {"Content-Type": "application/x-tar"}
    async with docker._query(
        "build", "POST", params=params, data=chunks(), headers=headers, timeout=None
    ) as resp:
        tail: list[str] = []
        async for raw in resp.content:
            with contextlib.suppress(ValueError):
                msg = json.loads(raw)
                if "error" in msg:
                    raise BuildError(f"{tag}: {msg['error']}\n" + "".join(tail[-30:]))
                if text := msg.get("stream"):
                    tail.append(text)
                    if re.match(r"Step \d+/\d+", text):
                        print(f"  {tag}: {text.strip()[:150]}", file=sys.stderr, flush=True)
    info = await docker.images.inspect(tag)
    return {"image": tag, "id": info["Id"], "size_bytes": info.get("Size"),
            "built_s": round(time.monotonic() - t0, 1),
            "context_bytes": ctx_tar.stat().st_size}  # fmt: skip


async def build(
    docker_url: str | None,
    targets: list[str],
    tag: str,
    *,
    harnesses: list[str],
    envs: bool,
    method: str,
    cache_dir: Path | None,
) -> list[dict]:
    import aiodocker

    from harnessrl.actors.sandbox.docker_image import PACKAGES, ensure_image, image_cache_dir

    cache = image_cache_dir(cache_dir).parent / "images"
    cache.mkdir(parents=True, exist_ok=True)
    # the sandbox image's rootfs (one debootstrap per machine for both), tagged by its packages
    # so that an engine's older base is never taken for it
    pkg_key = hashlib.blake2b(" ".join(PACKAGES).encode(), digest_size=4).hexdigest()
    base = f"harnessrl-base:{pkg_key}"
    t0 = time.monotonic()
    out = [await ensure_image(docker_url, base, cache_dir=cache_dir, method=method)]
    out.append({"phase": "base", "seconds": round(time.monotonic() - t0, 1)})
    async with aiodocker.Docker(url=docker_url) as docker:
        target = await probe_target(docker, base)
        with tempfile.TemporaryDirectory(prefix=".ctx-", dir=cache) as tmp:
            ctx = Path(tmp) / "ctx"
            ctx.mkdir()
            t0 = time.monotonic()
            await asyncio.to_thread(prepare_context, ctx, targets, target, cache, harnesses, envs)
            out.append({"phase": "context", "seconds": round(time.monotonic() - t0, 1)})
            for t in targets:
                t0 = time.monotonic()
                ctx_tar = Path(tmp) / f"{t}.tar"
                await asyncio.to_thread(write_context_tar, ctx, ctx_tar, t)
                res = await docker_build(docker, ctx_tar, t, f"{IMAGE[t]}:{tag}", base)
                ctx_tar.unlink()
                out.append({**res, "context_bytes": res.pop("context_bytes"),
                            "total_s": round(time.monotonic() - t0, 1)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="build.py", description="build the harnessrl images here, offline"
    )
    p.add_argument("--docker-host", default=None, help="engine URL (default: $DOCKER_HOST)")
    p.add_argument(
        "--target",
        dest="targets",
        action="append",
        choices=TARGETS,
        help="image to build (repeat; default: all three)",
    )
    p.add_argument("--tag", default="local", help="tag of the images (default: local)")
    p.add_argument(
        "--harness",
        dest="harnesses",
        action="append",
        default=[],
        metavar="NAME",
        help="harness to install into the actor image (repeat; the built-in reference harness "
        "needs none)",
    )
    p.add_argument("--no-envs", action="store_true", help="leave the task environments out")
    p.add_argument(
        "--method",
        default="auto",
        choices=("auto", "debootstrap", "host"),
        help="how the base rootfs is made (harnessrl.actors.sandbox.docker_image)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="rootfs cache (images/ beside)")
    args = p.parse_args(argv)
    from harnessrl.actors.sandbox.docker_image import ImageError

    try:
        res = asyncio.run(
            build(
                args.docker_host,
                args.targets or list(TARGETS),
                args.tag,
                harnesses=args.harnesses,
                envs=not args.no_envs,
                method=args.method,
                cache_dir=args.cache_dir,
            )
        )
    except (BuildError, ImageError) as e:
        print(f"build.py: {e}", file=sys.stderr)
        return 1
    for r in res:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
