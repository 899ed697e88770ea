"""``harnessrl eval``: the pool, the table, and a real run (teacher vs a random tiny model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.actors.eval_cmd import EvalConfig, format_table, summarize, task_pool
from harnessrl.common.config import undocumented_fields

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_config_is_documented() -> None:
    assert undocumented_fields(EvalConfig) == []


@pytest.mark.unit
def test_limit_spreads_over_the_pool() -> None:
    """--limit picks tasks across families, not the first few of one."""
    full = task_pool(["toy-eval"])
    some = task_pool(["toy-eval"], limit=6)
    assert len(some) == 6 and len({t.metadata["toy"]["family"] for t in some}) == 6
    assert all(t in full for t in some)


@pytest.mark.unit
def test_summary_and_transfer_matrix() -> None:
    """Means per policy x harness; infrastructure errors are counted apart, timeouts score 0."""
    rows = [
        ("a", "reference", "ok", 1.0),
        ("a", "reference", "ok", 0.5),
        ("a", "codex", "timeout", 0.7),
        ("b", "reference", "sandbox_error", 0.0),
        ("b", "codex", "ok", 1.0),
    ]
    results = [
        {"policy": p, "harness": h, "status": s, "reward": r, "task": "t"} for p, h, s, r in rows
    ]
    s = summarize(results)
    assert s["a"]["reference"] == {"reward": 0.75, "success": 0.5, "n": 2, "errors": 0}
    assert s["a"]["codex"]["reward"] == 0.0
    assert s["b"]["reference"]["n"] == 0 and s["b"]["reference"]["errors"] == 1
    table = format_table(s, ["a", "b"], ["reference", "codex"])
    lines = table.splitlines()
    assert "reference" in lines[0] and "codex" in lines[0]
    assert "0.750 / 0.500 (2)" in lines[2] and "+1err" in lines[3]


@pytest.mark.slow
def test_eval_teacher_and_random_policy(tmp_path: Path) -> None:
    """Two policies, one engine each: the teacher solves every task, a random model none."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    out = tmp_path / "eval.json"
    argv = [sys.executable, "-m", "harnessrl.common.cli", "eval", "--policy", "teacher"]
    argv += ["--policy", "tiny-1m", "--suite", "toy-eval", "--limit", "3", "--n", "1"]
    argv += ["--max-turns", "8", "--max-new-tokens", "256", "--out", str(out)]
    argv += ["--rollout.model", "tiny-1m", "--log-dir", str(tmp_path / "logs")]
    argv += ["--sandbox-root", str(tmp_path / "sandboxes")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tasks"] == 3 and len(report["results"]) == 6
    assert report["summary"]["teacher"]["reference"]["success"] == 1.0
    assert report["summary"]["tiny-1m"]["reference"]["success"] == 0.0
    assert "teacher" in proc.stdout and "tiny-1m" in proc.stdout
    assert list((tmp_path / "sandboxes").iterdir()) == []
