"""Names of the per-platform packages that npm-distributed native harnesses ship in."""

from __future__ import annotations

import platform


def npm_arch() -> str:
    """``x64`` or ``arm64``, as npm names this machine's CPU."""
    m = platform.machine().lower()
    return "arm64" if m in ("aarch64", "arm64") else "x64"


def rust_triple() -> str:
    """The musl target triple Codex's vendored binaries are built for."""
    return "aarch64-unknown-linux-musl" if npm_arch() == "arm64" else "x86_64-unknown-linux-musl"
