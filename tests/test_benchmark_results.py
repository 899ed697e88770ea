"""Benchmark results: ``--quick`` smoke runs (what CI runs) never overwrite the committed
results of full runs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import _common

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def test_quick_results_do_not_overwrite_full_ones(tmp_path: Path, monkeypatch) -> None:
    full, quick = tmp_path / "results", tmp_path / "results" / "quick"
    monkeypatch.setattr(_common, "RESULTS_DIR", full)
    monkeypatch.setattr(_common, "QUICK_DIR", quick)
    kept = _common.write_result("b", {"x": 1}, {}, {}, out=full)
    smoke = _common.write_result("b", {"x": 2}, {}, {}, quick=True, out=full)
    assert (kept, smoke) == (full / "b.json", quick / "b.json")
    assert json.loads(kept.read_text())["metrics"] == {"x": 1}
    assert json.loads(smoke.read_text())["quick"] is True
    # an explicit other folder is honoured either way
    other = _common.write_result("b", {}, {}, {}, quick=True, out=tmp_path / "elsewhere")
    assert other == tmp_path / "elsewhere" / "b.json"


def test_quick_results_are_not_committed(tmp_path: Path) -> None:
    """A result a ``--quick`` run writes is ignored by git (CI's smoke runs never dirty the
    checkout); a full run's is not."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    quick = _common.QUICK_DIR / f"probe-{tmp_path.name}.json"
    full = _common.RESULTS_DIR / f"probe-{tmp_path.name}.json"

    def ignored(path: Path) -> bool:
        res = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(path)])
        assert res.returncode in (0, 1), res
        return res.returncode == 0

    assert ignored(quick) and not ignored(full)
