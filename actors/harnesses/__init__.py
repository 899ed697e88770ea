"""Harness adapters: how to install each agent harness and launch it headless in a sandbox.

``get_adapter(name)`` returns a fresh adapter; ``list_adapters()`` lists the built-in ones. The
contract is in `actors.harnesses.base`; every adapter module's docstring gives its exact command
line, environment and config files.
"""

from __future__ import annotations

import importlib

from actors.harnesses.base import (
    HarnessAdapter,
    HarnessContext,
    HarnessInstallError,
    HarnessNotInstalled,
    LaunchSpec,
    default_cache_dir,
    launch,
    write_launch_files,
)

#: name → "module:Class"; modules are imported on first use.
ADAPTERS: dict[str, str] = {
    "reference": "actors.harnesses.reference:ReferenceAdapter",
    "claude-code": "actors.harnesses.claude_code:ClaudeCodeAdapter",
    "codex": "actors.harnesses.codex:CodexAdapter",
    "mini-swe-agent": "actors.harnesses.mini_swe_agent:MiniSweAgentAdapter",
    "opencode": "actors.harnesses.opencode:OpencodeAdapter",
    "openclaw": "actors.harnesses.openclaw:OpenclawAdapter",
    "command": "actors.harnesses.command:CommandAdapter",
}


def get_adapter(name: str) -> HarnessAdapter:
    """The adapter called ``name``; raises KeyError naming the known ones."""
    try:
        target = ADAPTERS[name]
    except KeyError:
        raise KeyError(f"unknown harness {name!r}; known: {', '.join(ADAPTERS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


def list_adapters() -> list[HarnessAdapter]:
    """One adapter of each built-in harness, in registry order."""
    return [get_adapter(n) for n in ADAPTERS]


__all__ = [
    "ADAPTERS",
    "HarnessAdapter",
    "HarnessContext",
    "HarnessInstallError",
    "HarnessNotInstalled",
    "LaunchSpec",
    "default_cache_dir",
    "get_adapter",
    "launch",
    "list_adapters",
    "write_launch_files",
]
