"""``harnessrl harness``: list, install and describe harness adapters.

    harnessrl harness list [--cache-dir DIR] [--json]
    harnessrl harness install NAME [NAME ...] [--cache-dir DIR] [--version V] [--force]
    harnessrl harness show NAME

Installs go to ``<cache-dir>/<name>`` (default ``$HRL_HARNESS_CACHE`` or
``~/.cache/harnessrl/harnesses``); installing is idempotent and safe to run from several
processes at once.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from harnessrl.actors.harnesses import ADAPTERS

    names = ", ".join(ADAPTERS)
    parser.epilog = f"Harnesses: {names}."
    sub = parser.add_subparsers(dest="harness_action", metavar="ACTION", required=True)

    p = sub.add_parser(
        "list",
        help="list harness adapters: installed version, first-request tokens, shipped "
        "policies that speak them",
    )
    _cache_arg(p)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")

    p = sub.add_parser(
        "install",
        help="install harnesses into the cache dir (idempotent)",
        description="Install harnesses (npm/pip) into <cache-dir>/<name>; a no-op when present.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help=f"harness to install ({names})")
    _cache_arg(p)
    p.add_argument("--version", help="pin the harness package version (default: latest)")
    p.add_argument("--force", action="store_true", help="reinstall even when installed")

    p = sub.add_parser("show", help="print an adapter's launch recipe (command, env, files)")
    p.add_argument("name", metavar="NAME", help=f"harness ({names})")


def _cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="install cache (default $HRL_HARNESS_CACHE or ~/.cache/harnessrl/harnesses)",
    )


def main(cfg: object, args: argparse.Namespace) -> int:
    from harnessrl.actors.harnesses import default_cache_dir

    cache_dir = getattr(args, "cache_dir", None) or default_cache_dir()
    action = args.harness_action
    if action == "list":
        return _list(cache_dir, as_json=args.json)
    if action == "install":
        return asyncio.run(_install(args.names, cache_dir, args.version, args.force))
    return _show(args.name)


def _rows(cache_dir: Path) -> list[dict]:
    from harnessrl.actors.harnesses import list_adapters
    from harnessrl.common.models import shipped_harnesses

    spoken = shipped_harnesses()
    rows = []
    for a in list_adapters():
        installed = a.is_installed(cache_dir)
        rows.append(
            {
                "name": a.name,
                "api": a.api,
                "installed": installed,
                "builtin": a.builtin,
                "version": None if a.builtin or not installed else a.installed_version(cache_dir),
                "install_dir": None if a.builtin else str(a.install_dir(cache_dir)),
                "summary": a.summary,
                "first_request_tokens": a.first_request_tokens,
                "first_request_measured_at": a.measured_version or None,
                "spoken_by": sorted(p for p, hs in spoken.items() if a.name in hs),
            }
        )
    return rows


def _first_request(r: dict) -> str:
    """Measured first-request tokens; ``~N@V`` when measured at another version than the one
    installed."""
    n, at = r["first_request_tokens"], r["first_request_measured_at"]
    if n is None:
        return "-"
    if at and r["version"] and r["version"] != at:
        return f"~{n}@{at}"
    return str(n)


def _list(cache_dir: Path, *, as_json: bool) -> int:
    rows = _rows(cache_dir)
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    spoken = {r["name"]: ",".join(r["spoken_by"]) or "-" for r in rows}
    w = max(len("SPOKEN BY"), *(len(b) for b in spoken.values()))  # the column fits its names
    print(
        f"{'NAME':<15} {'API':<10} {'INSTALLED':<10} {'VERSION':<10} {'1ST REQ':>14} "
        f"{'SPOKEN BY':<{w}} INSTALL DIR"
    )
    for r in rows:
        inst = "built-in" if r["builtin"] else "yes" if r["installed"] else "no"
        where = r["install_dir"] or "-"
        print(
            f"{r['name']:<15} {r['api']:<10} {inst:<10} {r['version'] or '-':<10} "
            f"{_first_request(r):>14} {spoken[r['name']]:<{w}} {where}"
        )
    print(
        "1ST REQ: tokens of its first request for a one-line task (system prompt, tools, task;\n"
        "  tiny tokenizer), measured at the version after @ where that is not the installed one."
        "\nSPOKEN BY: shipped policies taught to drive it (their recipe's `harnesses`)."
    )
    return 0


async def _install(names: list[str], cache_dir: Path, version: str | None, force: bool) -> int:
    from harnessrl.actors.harnesses import HarnessInstallError, get_adapter

    status = 0
    for name in names:
        try:
            adapter = get_adapter(name)
        except KeyError as e:
            print(f"harnessrl harness: {e.args[0]}", file=sys.stderr)
            return 2
        if adapter.is_installed(cache_dir) and not force:
            print(f"{name}: already installed in {adapter.install_dir(cache_dir)}")
            continue
        print(f"{name}: installing into {adapter.install_dir(cache_dir)} …", flush=True)
        started = time.monotonic()
        try:
            await adapter.install(cache_dir, version=version, force=force)
        except HarnessInstallError as e:
            print(f"{name}: install failed: {e}", file=sys.stderr)
            status = 1
            continue
        took = time.monotonic() - started
        ver = adapter.installed_version(cache_dir) or "?"
        print(f"{name}: installed version {ver} in {took:.1f}s")
    return status


def _show(name: str) -> int:
    from harnessrl.actors.harnesses import get_adapter

    try:
        adapter = get_adapter(name)
    except KeyError as e:
        print(f"harnessrl harness: {e.args[0]}", file=sys.stderr)
        return 2
    module = sys.modules[type(adapter).__module__]
    print(inspect.cleandoc(module.__doc__ or adapter.summary))
    return 0
