"""Installed harnesses: npm packages under a prefix, or a pip venv, in ``<cache_dir>/<name>``.

Both kinds are built with `locked_install` (flock + temporary sibling + rename) and record a
manifest (`hrl-install.json`: packages, version, seconds taken). Inside a sandbox the install dir
is bound read-only at ``/opt/hrl/harnesses/<name>``, so every path an adapter puts on a command
line is that mount plus a path relative to the install dir, resolved here on the host first.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, ClassVar

from harnessrl.actors.harnesses.base import (
    HarnessAdapter,
    HarnessInstallError,
    HarnessNotInstalled,
    host_python,
    locked_install,
    read_manifest,
    run_install_step,
)
from harnessrl.actors.harnesses.preload import Preload


class InstalledAdapter(HarnessAdapter):
    """An adapter whose files live in an install dir; resolves them inside and outside."""

    builtin = False

    def is_installed(self, cache_dir: Path) -> bool:
        return read_manifest(self.install_dir(cache_dir)) is not None

    def locate(self, cache_dir: Path, *candidates: str) -> str:
        """The first existing ``candidates`` (relative to the install dir), as seen inside.

        Raises `HarnessNotInstalled` when the harness is not installed or none exists.
        """
        root = self.install_dir(cache_dir)
        if not self.is_installed(cache_dir):
            raise HarnessNotInstalled(
                f"harness {self.name!r} is not installed in {root}; "
                f"run `harnessrl harness install {self.name}`"
            )
        for rel in candidates:
            if (root / rel).exists():
                return f"{self.mount_dir()}/{rel}"
        raise HarnessNotInstalled(f"{self.name}: none of {candidates} in {root}")

    def binds(self, cache_dir: Path) -> list[tuple[Path, str]]:
        return [(self.install_dir(cache_dir), self.mount_dir())]


class NpmAdapter(InstalledAdapter):
    """Installed with ``npm install --prefix <install dir> PACKAGES``."""

    packages: ClassVar[tuple[str, ...]]
    """npm specs installed together; the first is the harness (``version`` pins it)."""
    node_packages: ClassVar[tuple[str, ...]] = ()
    """Installed first, on their own (e.g. a newer Node the harness's install scripts need)."""
    node_bin: ClassVar[str | None] = None
    """Relative path of a Node installed by ``node_packages``, put first on PATH while
    installing the harness (npm picks versions whose ``engines`` match the running Node)."""

    async def install(
        self, cache_dir: Path, *, version: str | None = None, force: bool = False
    ) -> None:
        npm = shutil.which("npm")
        if npm is None:
            raise HarnessInstallError("npm is not on PATH (install Node.js ≥ 18 with npm)")
        main, *rest = self.packages
        specs = [f"{main}@{version or 'latest'}", *rest]

        async def build(tmp: Path) -> dict[str, Any]:
            common = [npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund"]
            env = {"npm_config_update_notifier": "false", "npm_config_loglevel": "error"}
            if self.node_packages:
                await run_install_step([*common, *self.node_packages], cwd=tmp, env=env)
            if self.node_bin:
                node_dir = str((tmp / self.node_bin).parent)
                env["PATH"] = node_dir + os.pathsep + os.environ.get("PATH", "")
            await run_install_step([*common, *specs], cwd=tmp, env=env)
            return {
                "installer": "npm",
                "packages": [*self.node_packages, *specs],
                "version": _npm_version(tmp, main),
            }

        await locked_install(Path(cache_dir), self.name, build, force=force)
        self.locate(Path(cache_dir), *self.check_paths())

    def check_paths(self) -> tuple[str, ...]:
        """Files whose presence shows the install is usable (one must exist)."""
        return (f"node_modules/{self.packages[0]}/package.json",)


def _npm_version(prefix: Path, package: str) -> str | None:
    try:
        return json.loads((prefix / "node_modules" / package / "package.json").read_text())[
            "version"
        ]
    except (OSError, ValueError, KeyError):
        return None


class PipVenvAdapter(InstalledAdapter):
    """Installed with ``python -m venv <install dir>/venv`` then ``pip install PACKAGES``.

    The venv is made from the interpreter the sandbox sees (``/usr/bin/python3``), and the
    harness is started as ``<mount>/venv/bin/python -m MODULE``: Python finds ``pyvenv.cfg``
    next to the (symlinked) interpreter, so the venv works wherever it is bound, unlike its
    console scripts whose shebangs hold the host path.
    """

    packages: ClassVar[tuple[str, ...]]
    dist_name: ClassVar[str]
    """Distribution whose version the manifest records."""
    preload_modules: ClassVar[tuple[str, ...]] = ()
    """Libraries a preloaded start imports ahead (``harnessrl.actors.harnesses.preload``):
    only ones that keep no per-rollout state from their import; empty: always cold."""
    preload_env: ClassVar[tuple[tuple[str, str], ...]] = ()
    """Environment they are imported with: the values every rollout's harness has."""

    def preload(self, cache_dir: Path, entry: str) -> Preload | None:
        """The `Preload` of ``python -m entry`` from this install (None: none declared)."""
        if not self.preload_modules:
            return None
        root = Path(os.path.abspath(self.install_dir(cache_dir)))
        return Preload(
            python=root / "venv" / "bin" / "python",
            entry=entry,
            modules=self.preload_modules,
            env=self.preload_env,
            binds=((root, str(root)),),
        )

    async def install(
        self, cache_dir: Path, *, version: str | None = None, force: bool = False
    ) -> None:
        python = host_python()
        main, *rest = self.packages
        specs = [f"{main}=={version}" if version else main, *rest]

        async def build(tmp: Path) -> dict[str, Any]:
            venv = tmp / "venv"
            await run_install_step([python, "-m", "venv", str(venv)], cwd=tmp)
            vpy = str(venv / "bin" / "python")
            pip = [vpy, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            await run_install_step([*pip, *specs], cwd=tmp, env={"PIP_NO_INPUT": "1"})
            ver = await run_install_step(
                [
                    vpy,
                    "-c",
                    f"import importlib.metadata as m; print(m.version({self.dist_name!r}))",
                ],
                cwd=tmp,
            )
            return {
                "installer": "pip",
                "python": python,
                "packages": specs,
                "version": ver.strip().splitlines()[-1],
            }

        await locked_install(Path(cache_dir), self.name, build, force=force)
