"""Harbor task environments: the part of an ``environment/Dockerfile`` that can be replayed
without Docker (``WORKDIR`` and local ``COPY``/``ADD``), materialised once per content into a
cache folder that becomes the task's starting workspace."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from harnessrl.common.tasks.model import hash_paths

HARBOR_MOUNT = "/app"
"""Workspace mount of a Harbor task whose Dockerfile sets no WORKDIR."""


def _dockerfile_lines(text: str) -> Iterator[str]:
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield (buf + line).strip()
        buf = ""
    if buf.strip():
        yield buf.strip()


def parse_dockerfile(path: Path) -> tuple[str, list[tuple[str, str]], list[str]]:
    """``(workdir, [(context_src, dest_inside)], ignored_instructions)`` of a Dockerfile.

    Only ``WORKDIR`` and local ``COPY``/``ADD`` are replayed; ``RUN`` and the rest are
    returned as ignored (a task that needs them needs the docker sandbox backend).
    """
    workdir, copies, ignored = "/", [], []
    for line in _dockerfile_lines(path.read_text()):
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / rest.strip().strip("\"'"))
        elif op in ("COPY", "ADD"):
            if rest.lstrip().startswith("["):
                try:
                    args = [str(a) for a in json.loads(rest)]
                except json.JSONDecodeError:
                    ignored.append(line)
                    continue
            else:
                args = shlex.split(rest)
            flags = [a for a in args if a.startswith("--")]
            args = [a for a in args if not a.startswith("--")]
            if any(f.startswith("--from") for f in flags) or len(args) < 2:
                ignored.append(line)
                continue
            dest = str(PurePosixPath(workdir) / args[-1]) + ("/" if args[-1].endswith("/") else "")
            if len(args) > 2 and not dest.endswith("/"):
                dest += "/"
            copies += [(src, dest) for src in args[:-1]]
        elif op not in ("FROM", "ENV", "ARG", "LABEL", "USER", "EXPOSE", "CMD", "ENTRYPOINT"):
            ignored.append(line)
    mount = workdir if workdir != "/" else HARBOR_MOUNT
    return mount, copies, ignored


def materialise_harbor_workspace(
    env_dir: Path, mount: str, copies: list[tuple[str, str]]
) -> Path | None:
    """Build (once, in a cache keyed by content) the files COPYd below the WORKDIR."""
    wanted = []
    for src, dest in copies:
        d = PurePosixPath(dest.rstrip("/") or "/")
        if d != PurePosixPath(mount) and PurePosixPath(mount) not in d.parents:
            continue
        rel = d.relative_to(mount)
        host_src = (env_dir / src).resolve()
        if env_dir.resolve() not in (host_src, *host_src.parents) or not host_src.exists():
            continue
        if host_src.is_file() and (dest.endswith("/") or str(rel) == "."):
            rel = rel / host_src.name
        wanted.append((host_src, rel))
    if not wanted:
        return None
    key = hash_paths([("environment", env_dir), (f"mount:{mount}", None)])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "harnessrl/harbor"
    final = cache / key
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=cache))
    for host_src, rel in wanted:
        target = tmp / rel
        if host_src.is_dir():
            shutil.copytree(host_src, target, dirs_exist_ok=True, symlinks=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(host_src, target)
    try:
        os.rename(tmp, final)
    except OSError:  # built meanwhile by someone else
        shutil.rmtree(tmp, ignore_errors=True)
    return final
