"""Benchmark results: ``--quick`` smoke runs (what CI runs) never overwrite the committed
results of full runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import _common


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


def test_quick_folder_is_not_committed() -> None:
    ignored = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().split()
    rel = _common.QUICK_DIR.relative_to(_common.RESULTS_DIR.parents[1]).as_posix() + "/"
    if rel not in ignored:
        pytest.fail(f"{rel} is not in .gitignore")
