"""The transfer matrix's arithmetic (``benchmarks.transfer_matrix``): paired changes and their
intervals, the findings, demo folders as policies, the heat map and the report's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks import transfer_matrix as tm

pytestmark = pytest.mark.unit

HARNESSES = ["reference", "claude-code"]


def rollouts(policy: str, harness: str, outcomes: list[bool], status: str = "ok") -> list[dict]:
    return [
        {
            "policy": policy,
            "harness": harness,
            "task": f"t{i // 2}",
            "k": i % 2,
            "status": status,
            "reward": 1.0 if ok else 0.0,
        }
        for i, ok in enumerate(outcomes)
    ]


def eval_report(results: list[dict]) -> dict:
    from harnessrl.actors.eval_cmd import summarize

    return {"summary": summarize(results), "results": results, "n": 2, "tasks": 2}


POLICIES = [
    {"name": "warm", "policy": "/m/warm", "trained_through": [], "rl": None},
    {"name": "cc", "policy": "/m/cc", "trained_through": ["claude-code"], "rl": None},
    {"name": "ref", "policy": "/m/ref", "trained_through": ["reference"], "rl": None},
    {"name": "mix", "policy": "/m/mix", "trained_through": HARNESSES, "rl": None},
]


def test_paired_change_counts_pairs_by_task_and_seed() -> None:
    before = [True, False, False, False, True, False, False, False]
    after = [True, True, True, False, False, False, True, False]  # 3 fixed, 1 broken
    results = rollouts("a", "reference", before) + rollouts("b", "reference", after)
    c = tm.paired_change(results, "a", "b", "reference")
    assert (c["pairs"], c["fixed"], c["broken"]) == (8, 3, 1)
    assert c["change"] == pytest.approx(0.25)
    # variance of the paired differences: (3 + 1) / 8 - 0.25^2 = 0.4375, over 8 pairs
    half = 1.96 * (0.4375 / 8) ** 0.5
    assert c["ci95"] == pytest.approx((0.25 - half, 0.25 + half), abs=1e-4)
    # another harness, or infrastructure errors, are not pairs
    results += rollouts("b", "claude-code", after) + rollouts("a", "claude-code", before, "error")
    assert tm.paired_change(results, "a", "b", "claude-code")["pairs"] == 0


def test_matrix_and_findings_say_where_training_helped() -> None:
    base = [False, False, True, False]
    results = []
    for h in HARNESSES:
        results += rollouts("/m/warm", h, base)
    # cc: better on claude-code only; ref: better on reference only; mix: better on both, less
    results += rollouts("/m/cc", "claude-code", [True, True, True, True])
    results += rollouts("/m/cc", "reference", base)
    results += rollouts("/m/ref", "reference", [True, True, True, False])
    results += rollouts("/m/ref", "claude-code", [False, False, False, False])
    results += rollouts("/m/mix", "reference", [True, False, True, False])
    results += rollouts("/m/mix", "claude-code", [True, True, True, False])
    cells = tm.matrix(eval_report(results), POLICIES, HARNESSES)
    assert "vs_baseline" not in cells["warm"]["reference"]
    assert cells["cc"]["claude-code"]["success"] == 1.0
    assert cells["cc"]["claude-code"]["ci95"][1] == 1.0
    assert cells["cc"]["claude-code"]["vs_baseline"]["change"] == 0.75
    assert cells["ref"]["claude-code"]["vs_baseline"]["change"] == -0.25
    found = {f["policy"]: f for f in tm.findings(cells, POLICIES, HARNESSES)}
    assert found["cc"] == {
        "kind": "single",
        "policy": "cc",
        "own": "claude-code",
        "own_change": 0.75,
        "other_changes": {"reference": 0.0},
    }
    assert found["ref"]["other_changes"] == {"claude-code": -0.25}
    mix = found["mix"]["on"]
    assert mix["claude-code"] == {"mix_change": 0.5, "alone": "cc", "alone_change": 0.75}
    assert mix["reference"] == {"mix_change": 0.25, "alone": "ref", "alone_change": 0.5}
    assert "warm" not in found


def test_a_demo_folder_is_its_rl_policy(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "demo.json").write_text(
        json.dumps(
            {
                "sft_policy": "/models/warm",
                "rl_policy": str(demo / "rl/learner/weights/v000000090"),
                "algo": "grpo",
                "timings_s": {"rl": 1717.3},
                "rl_rollouts_per_s": 1.37,
                "phases": {"rl": {"version": 90, "results": {"ok": 2350, "timeout": 2}}},
            }
        )
    )
    (demo / "rl.toml").write_text(
        '[learner.feeder]\nharnesses = ["claude-code", "mini-swe-agent"]\nseed = 2\n'
    )
    p = tm.policy_source(f"mix={demo}")
    assert p["policy"].endswith("v000000090")
    assert p["trained_through"] == ["claude-code", "mini-swe-agent"]
    assert p["rl"]["rollouts"] == 2352 and p["rl"]["seed"] == 2 and p["rl"]["minutes"] == 28.6
    assert tm.policy_source("warm=tiny-agent-harness") == {
        "name": "warm",
        "policy": "tiny-agent-harness",
        "trained_through": [],
        "rl": None,
    }
    with pytest.raises(SystemExit, match="NAME=SOURCE"):
        tm.policy_source(str(demo))


def test_heat_map_and_report_table(tmp_path: Path, monkeypatch) -> None:
    base = [False, True]
    results = rollouts("/m/warm", "reference", base) + rollouts("/m/warm", "claude-code", base)
    results += rollouts("/m/cc", "reference", base) + rollouts("/m/cc", "claude-code", [True] * 2)
    policies = POLICIES[:2]
    cells = tm.matrix(eval_report(results), policies, HARNESSES)
    pic = tm.draw(cells, policies, HARNESSES, tmp_path / "m.png")
    assert pic is not None and pic.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = {
        "suite": "toy-eval",
        "harnesses": HARNESSES,
        "policies": policies,
        "cells": cells,
        "findings": tm.findings(cells, policies, HARNESSES),
        "n_per_task": 1,
        "tasks": 2,
    }
    monkeypatch.setattr(report, "load", lambda name: {"metrics": metrics})
    text = report.transfer_matrix()
    assert "| `cc` | claude-code |" in text
    # its own harness in bold, the other plain; 1 fixed, 0 broken on claude-code
    assert "**+0.50 [" in text and "1/0" in text
    assert (
        "- `cc` (trained through claude-code): +0.50 on claude-code; elsewhere reference +0.00."
        in text
    )
