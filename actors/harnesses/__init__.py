"""Harness adapters: how to install each agent harness and launch it headless in a sandbox.

``get_adapter(name)`` returns a fresh adapter; ``list_adapters()`` lists the built-in ones. The
contract is in `harnessrl.actors.harnesses.base`; every adapter module's docstring gives its exact command
line, environment and config files.

Context window and output limit, one rule for every harness: it is told the engine's real
window ``W`` (``HarnessContext.context_window``) as its model's window, and the run's per-call
``max_new_tokens`` ``O`` (``HarnessContext.max_output_tokens``) as its model's output limit, so
it requests ``max_tokens = O`` and reserves only ``O`` for a reply. Compaction then comes where
the harness's own rule puts it for a real model of that size: never before the input nears
``W - O`` less the harness's own margin. Where the adapter sets the threshold itself (Codex,
reference) it is ``W - max(O, W // 4)``: both check only after a reply, so the reserve also
covers a turn's tool output. Compaction point for W=32,768, O=4,096 (tokens as the proxy
reports them)::

    harness         knobs set                                      compacts once its count
                                                                   reaches (measured: input
                                                                   of the call before)
    claude-code     CLAUDE_CODE_MAX_CONTEXT_TOKENS=W,              W - min(O,20000) - 13000
                    CLAUDE_CODE_AUTO_COMPACT_WINDOW=W,             = 15,672, 48% (15.7k-16.1k;
                    CLAUDE_CODE_MAX_OUTPUT_TOKENS=O                compaction call 17.7k-18.1k)
    codex           model_context_window=W,                        W - max(O, W/4) = 24,576
                    model_auto_compact_token_limit=W-max(O,W/4)    75% (24.2k)
    opencode        limit.context=W, limit.output=O                W - O = 28,672, 87.5% (29.5k)
    openclaw        contextWindow=W, maxTokens=O                   only when the proxy refuses
                                                                   a prompt past W (31.5k)
    reference       --compact-tokens W-max(O,W/4), --max-tokens O  24,576, 75%
    mini-swe-agent  model_kwargs.max_tokens=O                      never (400 past W ends it)
    command         HRL_CONTEXT_WINDOW=W, HRL_MAX_OUTPUT_TOKENS=O  whatever the command does

Before this rule Claude Code asked for 32,000 output tokens against a 32,768 window, and its
threshold (below zero) made it compact after its second call, at 2.1k-4.2k tokens of history.
"""

from __future__ import annotations

import functools
import importlib
from difflib import get_close_matches
from importlib import metadata
from pathlib import Path

from harnessrl.actors.harnesses.base import (
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
    "reference": "harnessrl.actors.harnesses.reference:ReferenceAdapter",
    "claude-code": "harnessrl.actors.harnesses.claude_code:ClaudeCodeAdapter",
    "codex": "harnessrl.actors.harnesses.codex:CodexAdapter",
    "mini-swe-agent": "harnessrl.actors.harnesses.mini_swe_agent:MiniSweAgentAdapter",
    "opencode": "harnessrl.actors.harnesses.opencode:OpencodeAdapter",
    "openclaw": "harnessrl.actors.harnesses.openclaw:OpenclawAdapter",
    "command": "harnessrl.actors.harnesses.command:CommandAdapter",
}

VERSIONLESS = frozenset({"command"})
"""Adapters with no version to record (``command`` runs whatever command line it is given)."""


def get_adapter(name: str) -> HarnessAdapter:
    """The adapter called ``name``; raises KeyError naming the known ones."""
    try:
        target = ADAPTERS[name]
    except KeyError:
        raise KeyError(unknown_harness(name)) from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


def unknown_harness(name: str) -> str:
    """The message for a harness name that is not in the registry: the nearest and all names."""
    near = get_close_matches(name, list(ADAPTERS), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"unknown harness {name!r} ({hint}known: {', '.join(ADAPTERS)})"


def harness_version(adapter: HarnessAdapter, cache_dir: Path) -> str:
    """The version a rollout records for ``adapter``: the installed package's (its install
    manifest), harnessrl's own for the built-in agents that ship with it (``reference``), and
    "" when there is none (`VERSIONLESS`, or an install without a recorded version)."""
    if adapter.name in VERSIONLESS:
        return ""
    if not adapter.builtin:
        return str(adapter.installed_version(Path(cache_dir)) or "")
    return _project_version()


@functools.lru_cache(maxsize=1)
def _project_version() -> str:
    try:
        return metadata.version("harnessrl")
    except metadata.PackageNotFoundError:
        return ""


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
    "harness_version",
    "launch",
    "list_adapters",
    "unknown_harness",
    "write_launch_files",
]
