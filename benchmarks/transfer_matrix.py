"""Does training through one harness transfer to the others? The policy x harness matrix.

``python -m benchmarks.transfer_matrix --policy NAME=SOURCE [--policy ...] [--harness H ...]
[--n K] [--keep DIR]``, or ``--summarise EVAL.json`` (same ``--policy`` list) to rebuild the
result from a kept evaluation without running it again, or ``--quick``.

A SOURCE is a finished ``harnessrl demo`` folder (its RL policy, trained through the harnesses
of its ``rl.toml``) or a model, by name or folder (a warm start: trained through none). The
first policy is the baseline, normally the warm start the others were trained from. Run by hand
(each demo is 15-30 minutes of RL; the matrix is ~30 minutes of rollouts on 2 cores).

Every policy goes through every harness in one ``harnessrl eval`` call, so a cell's rollouts
share tasks and sampling seeds across policies (pairs), at the demo's held-out settings
(temperature 1, 4 model turns, the policy's own output limit): ``toy-eval``'s 20 tasks ``n``
times each (default 5: 100 rollouts per cell).

Writes ``transfer_matrix.json``: per cell the success rate with its 95 % Wilson interval, mean
reward, and against the baseline in the same cell the paired outcomes (same task and seed:
``fixed`` succeed only now, ``broken`` only before) with the change's 95 % interval; then the
findings: for a policy trained through one harness, its change on that harness and on each other
one; for a policy trained through several, its change on each against the policy trained
through that harness alone. And the heat map ``docs/images/transfer-matrix.png`` (success, and
the change against the baseline). ``python -m benchmarks.report`` renders the table.

``--quick`` (CI, seconds): the scripted teacher and ``tiny-agent`` through the reference
harness on 4 tasks, once each: the pieces, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, print_table, target, wilson, write_result

NAME = "transfer_matrix"
REPO = RESULTS_DIR.parents[1]
PICTURE = REPO / "docs" / "images" / "transfer-matrix.png"
HARNESSES = ["reference", "mini-swe-agent", "claude-code"]
MIN_N = 100
"""Rollouts per cell the matrix needs to be read at all."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test, seconds")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for NAME.json")
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=SOURCE",
        help="a demo folder or a model; repeat (the first is the baseline)",
    )
    p.add_argument(
        "--harness", action="append", metavar="NAME", help=f"repeat (default {HARNESSES})"
    )
    p.add_argument("--suite", default="toy-eval", help="held-out suite")
    p.add_argument("--n", type=int, default=5, help="rollouts per task, policy and harness")
    p.add_argument("--limit", type=int, default=0, help="tasks, spread over the suite (0: all)")
    p.add_argument("--max-turns", type=int, default=4, help="model turns per rollout (the demo's)")
    p.add_argument("--concurrency", type=int, default=3, help="rollouts at once per policy")
    p.add_argument("--keep", type=Path, help="keep eval.json and the engines' logs here")
    p.add_argument("--summarise", type=Path, metavar="EVAL_JSON", help="report this evaluation")
    p.add_argument("--picture", type=Path, default=PICTURE, help="where the heat map goes")
    return p.parse_args(argv)


def policy_source(spec: str) -> dict[str, Any]:
    """``NAME=SOURCE`` -> the policy to evaluate, what it was trained through and how long."""
    name, sep, source = spec.partition("=")
    if not sep or not name or not source:
        raise SystemExit(f"--policy {spec!r}: expected NAME=SOURCE (a demo folder or a model)")
    folder = Path(source)
    if not (folder / "demo.json").is_file():
        return {"name": name, "policy": source, "trained_through": [], "rl": None}
    doc = json.loads((folder / "demo.json").read_text())
    rl = tomllib.loads((folder / "rl.toml").read_text())["learner"]
    phase = (doc.get("phases") or {}).get("rl") or {}
    return {
        "name": name,
        "policy": doc.get("rl_policy") or doc["sft_policy"],
        "trained_through": list(rl.get("feeder", {}).get("harnesses", ["reference"])),
        "rl": {
            "folder": str(folder),
            "warm_start": doc["sft_policy"],
            "algo": doc["algo"],
            "seed": rl.get("feeder", {}).get("seed", 0),
            "version": phase.get("version"),
            "rollouts": sum((phase.get("results") or {}).values()) or None,
            "rollouts_per_s": doc.get("rl_rollouts_per_s"),
            "minutes": round(doc["timings_s"].get("rl", 0.0) / 60, 1),
        },
    }


def eval_config(
    policies: list[dict], args: argparse.Namespace, harnesses: list[str], tokenizer: str = ""
) -> Any:
    """The ``harnessrl eval`` call (``tokenizer``: the scripted teacher's, when it is one)."""
    from harnessrl.actors.eval_cmd import EvalConfig

    keep = args.keep
    return EvalConfig(
        rollout={"model": tokenizer} if tokenizer else {},
        policies=[p["policy"] for p in policies],
        suites=[args.suite],
        harnesses=harnesses,
        n=args.n,
        limit=args.limit,
        concurrency=args.concurrency,
        temperature=1.0,
        max_turns=args.max_turns,
        max_new_tokens=0,
        log_dir=keep / "eval-logs" if keep else None,
        out=keep / "eval.json" if keep else None,
    )


def paired_change(results: list[dict], base: str, other: str, harness: str) -> dict[str, Any]:
    """``other`` against ``base`` on ``harness``, rollouts paired by (task, k) (the demo's
    `paired`, infrastructure errors left out as in the means): counts, the change in success
    and its 95 % interval (normal, on the paired differences)."""
    from harnessrl.common.run.demo import paired

    scored = [
        r if r["status"] == "ok" else {**r, "reward": 0.0}
        for r in results
        if r["status"] in ("ok", "timeout")
    ]
    p = paired({"results": scored}, base, other, harness)
    fixed, broken, n = p["fixed"], p["broken"], sum(p.values())
    if not n:
        return {"pairs": 0, "fixed": 0, "broken": 0, "change": None, "ci95": None}
    d = (fixed - broken) / n
    half = 1.96 * max(0.0, ((fixed + broken) / n - d * d) / n) ** 0.5
    return {
        "pairs": n,
        "fixed": fixed,
        "broken": broken,
        "change": round(d, 4),
        "ci95": (round(d - half, 4), round(d + half, 4)),
    }


def matrix(report: dict[str, Any], policies: list[dict], harnesses: list[str]) -> dict[str, Any]:
    """Per policy and harness: success with its interval, reward, change against the first."""
    base = policies[0]["policy"]
    cells: dict[str, dict[str, Any]] = {}
    for p in policies:
        row = cells.setdefault(p["name"], {})
        for h in harnesses:
            c = report["summary"].get(p["policy"], {}).get(h)
            if c is None:
                continue
            n = int(c["n"])
            row[h] = {
                "success": round(c["success"], 4),
                "ci95": wilson(round(c["success"] * n), n),
                "reward": round(c["reward"], 4),
                "n": n,
                "errors": int(c["errors"]),
            }
            if p["policy"] != base:
                row[h]["vs_baseline"] = paired_change(report["results"], base, p["policy"], h)
    return cells


def _change(cells: dict, name: str, harness: str) -> float | None:
    return ((cells.get(name, {}).get(harness) or {}).get("vs_baseline") or {}).get("change")


def findings(cells: dict, policies: list[dict], harnesses: list[str]) -> list[dict[str, Any]]:
    """What the matrix says about transfer, as numbers (the report writes the sentences)."""
    out: list[dict[str, Any]] = []
    single = {
        p["trained_through"][0]: p["name"] for p in policies if len(p["trained_through"]) == 1
    }
    for p in policies[1:]:
        through = [h for h in p["trained_through"] if h in harnesses]
        if len(p["trained_through"]) == 1 and through:
            own = through[0]
            others = {h: _change(cells, p["name"], h) for h in harnesses if h != own}
            out.append(
                {
                    "kind": "single",
                    "policy": p["name"],
                    "own": own,
                    "own_change": _change(cells, p["name"], own),
                    "other_changes": others,
                }
            )
        elif len(p["trained_through"]) > 1:
            rows = {}
            for h in through:
                alone = single.get(h)
                rows[h] = {
                    "mix_change": _change(cells, p["name"], h),
                    "alone": alone,
                    "alone_change": _change(cells, alone, h) if alone else None,
                }
            out.append({"kind": "mix", "policy": p["name"], "on": rows})
    return out


def draw(cells: dict, policies: list[dict], harnesses: list[str], path: Path) -> Path | None:
    """Two heat maps side by side: success per cell, and its change against the baseline."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    names = [p["name"] for p in policies]
    fig = Figure(figsize=(4.2 + 2.6 * len(harnesses), 1.2 + 0.55 * len(names)), dpi=110)
    axes = fig.subplots(1, 2, sharey=True)
    panels = (
        ("held-out success", "success", "viridis", (0.0, 1.0)),
        (f"change against {names[0]} (paired)", "change", "RdBu", (-0.5, 0.5)),
    )
    for ax, (title, what, cmap, (lo, hi)) in zip(axes, panels, strict=True):
        grid, text = [], []
        for name in names:
            row, labels = [], []
            for h in harnesses:
                c = cells.get(name, {}).get(h)
                if c is None:
                    row.append(float("nan"))
                    labels.append("")
                elif what == "success":
                    row.append(c["success"])
                    labels.append(f"{c['success']:.2f}\n[{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]")
                else:
                    v = (c.get("vs_baseline") or {}).get("change")
                    ci = (c.get("vs_baseline") or {}).get("ci95")
                    row.append(float("nan") if v is None else v)
                    labels.append("" if v is None else f"{v:+.2f}\n[{ci[0]:+.2f}, {ci[1]:+.2f}]")
            grid.append(row)
            text.append(labels)
        im = ax.imshow(grid, cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
        for i, labels in enumerate(text):
            for j, label in enumerate(labels):
                ax.text(
                    j,
                    i,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7.5,
                    color="black",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7},
                )
        ax.set_xticks(range(len(harnesses)), harnesses, fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_xlabel("evaluated through", fontsize=8)
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    axes[0].set_ylabel("policy", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _repo_path(path: Path | None) -> str | None:
    if path is None:
        return None
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def quick(out: Path) -> int:
    args = parse(["--quick", "--out", str(out)])
    args.n, args.limit, args.max_turns = 1, 4, 7  # the teacher needs up to 7 turns
    policies = [policy_source("teacher=teacher"), policy_source("tiny-agent=tiny-agent")]
    from harnessrl.actors.eval_cmd import run_eval

    cfg = eval_config(policies, args, ["reference"], tokenizer="tiny-agent")
    t0 = time.monotonic()
    report = run_eval(cfg)
    cells = matrix(report, policies, ["reference"])
    from benchmarks._common import QUICK_DIR

    pic = draw(cells, policies, ["reference"], QUICK_DIR / "transfer-matrix.png")
    teacher = cells["teacher"]["reference"]["success"]
    path = write_result(
        NAME,
        metrics={"cells": cells, "wall_s": round(time.monotonic() - t0, 1)},
        baseline={"teacher_success": teacher},
        targets={"teacher_solves": target(teacher, 1.0), "picture": target(int(bool(pic)), 1)},
        quick=True,
        out=out,
    )
    print(f"results: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.quick:
        return quick(args.out)
    if len(args.policy) < 2:
        raise SystemExit("give at least two --policy NAME=SOURCE (the first is the baseline)")
    harnesses = list(dict.fromkeys(args.harness or HARNESSES))
    policies = [policy_source(s) for s in args.policy]
    names = [p["name"] for p in policies]
    if len(set(names)) < len(names) or len({p["policy"] for p in policies}) < len(policies):
        raise SystemExit("--policy: every NAME and every policy must differ")
    t0 = time.monotonic()
    if args.summarise:
        report = json.loads(args.summarise.read_text())
    else:
        from harnessrl.actors.eval_cmd import run_eval

        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
        report = run_eval(eval_config(policies, args, harnesses))
    cells = matrix(report, policies, harnesses)
    found = findings(cells, policies, harnesses)
    rows = []
    for p in policies:
        for h in harnesses:
            c = cells[p["name"]].get(h)
            if c is None:
                continue
            vs = c.get("vs_baseline")
            rows.append(
                (
                    p["name"],
                    "+".join(p["trained_through"]) or "-",
                    h,
                    f"{c['success']:.3f} {c['ci95']}",
                    "" if not vs else f"{vs['change']:+.3f} {vs['ci95']}",
                    "" if not vs else f"{vs['fixed']}/{vs['broken']}",
                    c["n"],
                )
            )
    print_table(
        f"held-out {args.suite}: policy x harness (95 % intervals)",
        rows,
        ("policy", "trained through", "harness", "success", "change", "fixed/broken", "n"),
    )
    pic = draw(cells, policies, harnesses, args.picture)
    print(f"heat map: {pic or 'matplotlib is not installed'}")
    min_n = min((c["n"] for row in cells.values() for c in row.values()), default=0)
    path = write_result(
        NAME,
        metrics={
            "suite": args.suite,
            "harnesses": harnesses,
            "policies": policies,
            "cells": cells,
            "findings": found,
            "n_per_task": report["n"],
            "tasks": report["tasks"],
            "eval_seconds": report.get("seconds"),
            "wall_s": round(time.monotonic() - t0, 1),
            "picture": _repo_path(pic),
        },
        baseline={"policy": names[0], "cells": cells[names[0]]},
        targets={
            "rollouts_per_cell": target(min_n, MIN_N),
            "policies": target(len(policies), 4),
            "harnesses": target(len(harnesses), 3),
        },
        out=args.out,
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
