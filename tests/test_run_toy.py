"""``deploy/run-toy.toml``, the README's ``harnessrl run`` example, learns as shipped.

GRPO steps only on groups whose rewards differ: a policy that never solves a toy task gives
every group the same reward, the learner drops them all (``zero_variance``) and the run never
takes a step. The shipped file must start from a policy that can act (the warm start
``tiny-agent``, as the demo does) and score exact correctness, so its first batches already
carry signal.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN_TOY = REPO / "deploy" / "run-toy.toml"
STEPS = 2


def _lines(path: Path, event: str) -> list[dict]:
    out = []
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        if line.get("event") == event:
            out.append(line)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_toy_takes_its_first_steps(tmp_path: Path) -> None:
    """The example as the README runs it, cut to two steps and four minutes: both steps are
    taken on groups with reward variance, and the new weights reach the engine."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    out = tmp_path / "toy"
    argv = [sys.executable, "-m", "harnessrl.common.cli", "run", str(RUN_TOY)]
    argv += ["--steps", str(STEPS), "--time-limit-s", "240", "--no-dashboard"]
    argv += ["--drain-timeout-s", "0", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=560, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = _lines(out / "metrics.jsonl", "summary")[-1]
    steps = _lines(out / "metrics.jsonl", "step")
    dropped = summary["dropped"]
    assert not summary["time_limited"], f"no step in 4 minutes; dropped {dropped}"
    assert summary["outcome"] == "done" and summary["version"] == STEPS, summary
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["samples"] > 0 and 0 < s["reward_mean"] < 1 for s in steps), steps
    assert summary["engine_versions"] == {"engine-0": str(STEPS)}
