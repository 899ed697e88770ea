"""Sandboxes for rollouts: the small contract in `base`, backends `bwrap` (embedded default)
and `docker` (containers on a docker engine), and task environments built for both (`envs`).
Use `make_backend` to pick one by name."""

from __future__ import annotations

from harnessrl.actors.sandbox.base import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)

__all__ = [
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxSpec",
    "make_backend",
]


def make_backend(kind: str = "bwrap", **kwargs) -> SandboxBackend:
    """A sandbox backend by name: ``bwrap`` or ``docker`` (kwargs: see `BwrapBackend`,
    `DockerBackend`)."""
    if kind == "bwrap":
        from harnessrl.actors.sandbox.bwrap import BwrapBackend

        return BwrapBackend(**kwargs)
    if kind == "docker":
        from harnessrl.actors.sandbox.docker import DockerBackend

        return DockerBackend(**kwargs)
    raise ValueError(f"unknown sandbox backend {kind!r} (available: bwrap, docker)")
