"""Benchmark conventions: ``python -m benchmarks.NAME [--quick]`` prints a table and writes
``benchmarks/results/NAME.json`` with its metrics, the baseline measured in the same run, the
targets, the machine and the date. Absolute numbers on shared machines are noisy; ratios against
a same-run baseline are what we track over time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Committed results of full runs."""
QUICK_DIR = RESULTS_DIR / "quick"
"""Where ``--quick`` results go when ``--out`` is left at `RESULTS_DIR` (not committed: CI's
smoke runs must not overwrite the measured full runs)."""


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Common flags: ``--quick`` (under a minute) and ``--out`` (results folder)."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=description)
    p.add_argument("--quick", action="store_true", help="small sizes; finishes in under a minute")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for NAME.json")
    return p.parse_args(argv)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    except ImportError:
        pass
    return info


def write_result(
    name: str,
    metrics: dict[str, Any],
    baseline: dict[str, Any],
    targets: dict[str, Any],
    *,
    ratios: dict[str, float] | None = None,
    quick: bool = False,
    out: Path = RESULTS_DIR,
) -> Path:
    """Write the result JSON; ``targets`` maps a target name to {"value", "target", "met"}.
    A ``quick`` result aimed at `RESULTS_DIR` goes to `QUICK_DIR` instead."""
    if quick and Path(out).resolve() == RESULTS_DIR.resolve():
        out = QUICK_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    doc = {
        "name": name,
        "quick": quick,
        "metrics": metrics,
        "baseline": baseline,
        "ratios": ratios or {},
        "targets": targets,
        "machine": machine_info(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a success rate ``k / n``."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / d
    return (round(max(0.0, mid - half), 4), round(min(1.0, mid + half), 4))


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def target(value: float, bound: float, *, at_least: bool = True) -> dict[str, Any]:
    """A target entry: ``value >= bound`` (or ``<=`` with ``at_least=False``)."""
    met = value >= bound if at_least else value <= bound
    return {"value": round(value, 4), "target": f"{'>=' if at_least else '<='} {bound}", "met": met}


def print_table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    """A plain aligned table on stdout."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


WORDS = [
    "the", "file", "test", "error", "value", "function", "return",
    "module", "import", "class", "config", "path", "line",
]  # fmt: skip
"""Words of agent-ish filler text (the proxy benchmarks' bodies)."""


def spawn_child(target: Any, *args: Any) -> tuple[Any, Any]:
    """``target(conn, *args)`` in a spawned process; returns it and this end of the pipe once
    the child has sent its first message (RuntimeError after 120 s)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, *args), daemon=True)
    proc.start()
    if not here.poll(120):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start")
    return proc, here
