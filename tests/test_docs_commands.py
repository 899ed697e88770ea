"""The command blocks of the docs that a user runs, run as written.

A block is marked in its Markdown page by ``<!-- run: NAME -->`` on the line before its
```` ```bash ```` fence. Each marked block runs with ``bash -e`` in a fresh folder (holding
links to the checkout's ``examples/`` and ``deploy/``, so repository paths resolve) with this
venv's ``harnessrl`` first on ``PATH``; the only edits are those listed in `BLOCKS` — a free
port for a fixed one, a cache folder for a system path — and each must match the block, so a
doc that changes its commands fails here instead of drifting. Then the test checks what the
block printed and left behind. Every process the block starts is in its own session, which is
ended when the block ends or times out.

A marked block missing from `BLOCKS`, or an entry whose block is gone, fails
`test_every_marked_block_is_run`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harnessrl.common.files import free_port

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("README.md")]
)
_MARKED = re.compile(r"^<!-- run: ([\w-]+) -->\n```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)


def marked_blocks() -> dict[str, tuple[Path, str]]:
    """Every marked block of the docs: name -> (page, its text). A name used twice fails."""
    found: dict[str, tuple[Path, str]] = {}
    for page in PAGES:
        for name, body in _MARKED.findall(page.read_text()):
            assert name not in found, f"block {name!r} in {page} and {found[name][0]}"
            found[name] = (page, body)
    return found


@dataclass
class Ran:
    """What a block did."""

    out: str
    cwd: Path
    seconds: float


@dataclass
class Block:
    """How to run one marked block and what to check."""

    check: Callable[[Ran], None]
    timeout_s: float = 300
    subs: dict[str, Callable[[Path], str]] = field(default_factory=dict)
    """Text of the block -> a function of the block's folder giving its replacement."""
    prepare: Callable[[Path], None] | None = None
    """Run before the block (e.g. an install that skips the test where it cannot run)."""


def _port(_: Path) -> str:
    return str(free_port("127.0.0.1"))


def _lines(path: Path, event: str) -> list[dict]:
    out = []
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        if line.get("event") == event:
            out.append(line)
    return out


# ---------------------------------------------------------------------------------------------
# what each block must do
# ---------------------------------------------------------------------------------------------


def check_demo(r: Ran) -> None:
    """The default demo cut short: no SFT phase; RL from the shipped warm start ``tiny-agent``
    reached its 2 steps with live weight sync; then both policies were scored on the same 4
    held-out tasks, and the RL phase's rollouts/s was recorded."""
    from harnessrl.common.models import resolve_model

    out = r.cwd / "runs/demo-quick"
    doc = json.loads((out / "demo.json").read_text())
    assert doc["from_scratch"] is False and doc["phases"]["sft"] == {}
    assert not (out / "sft").exists() and not (out / "sft.toml").exists()
    assert Path(doc["sft_policy"]) == resolve_model("tiny-agent")
    rl = doc["phases"]["rl"]
    assert rl["outcome"] == "done" and rl["version"] == 2 and rl["leftover_pids"] == []
    assert rl["engine_versions"] == {"engine-0": "2"} and doc["rl_rollouts_per_s"] > 0
    row = doc["before_after"]["reference"]
    assert row["before"]["n"] == row["after"]["n"] == 4
    assert "phase 1/2: GRPO from" in r.out and "phase 2/2: held-out" in r.out
    assert "before: tiny-agent" in r.out and "after: GRPO v2" in r.out


def check_fleets(r: Ran) -> None:
    """The learner, started by hand beside the other fleets, took 2 steps on samples the
    actor and assembler produced, and the updater applied version 2 to the engine."""
    run = r.cwd / "runs/fleet"
    steps = _lines(run / "learner/metrics.jsonl", "step")
    assert [s["version"] for s in steps] == [1, 2] and all(s["samples"] > 0 for s in steps)
    assert "applied weight version 2" in (run / "sync.log").read_text()
    for log in run.glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name


def check_example_suite(r: Ran) -> None:
    """Both example tasks pass lint; the reference solution, run as a harness in a sandbox,
    scores 1.0; the policy's rollout through the reference harness is scored."""
    assert "2/2 tasks pass lint" in r.out
    rollouts = r.out.split("rollout manual")[1:]
    assert len(rollouts) == 2
    assert "with command" in rollouts[0] and "reward   1.0000" in rollouts[0]
    assert "with reference" in rollouts[1] and "status   ok" in rollouts[1]


def check_command_harness(r: Ran) -> None:
    """The llm CLI, bound into the sandbox, solved the toy task through the proxy."""
    assert "with command" in r.out and "status   ok" in r.out
    assert "reward   1.0000" in r.out
    calls = int(re.search(r"harness  exit 0, (\d+) model calls", r.out).group(1))
    assert calls >= 3  # read, write, finish: every one recorded
    assert "0 TITO misses" in r.out


def check_mini_swe_agent(r: Ran) -> None:
    """A rollout through the real mini-swe-agent was scored with its model calls recorded."""
    assert "with mini-swe-agent" in r.out and "status   ok" in r.out
    assert int(re.search(r"(\d+) model calls", r.out).group(1)) >= 1


# ---------------------------------------------------------------------------------------------
# blocks that need an install
# ---------------------------------------------------------------------------------------------


def _agent_dir(_: Path) -> str:
    from harnessrl.actors.harnesses import default_cache_dir

    return str(default_cache_dir().parent / "examples" / "llm-agent")


def install_llm_agent(_: Path) -> None:
    """Install the example agent where the block will find it; skip when PyPI is out of reach
    (as the real-harness tests do)."""
    res = subprocess.run(
        ["sh", str(REPO / "examples/command-harness/install.sh"), _agent_dir(_)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        pytest.skip(f"could not install the example agent: {res.stderr[-400:]}")


def install_mini_swe_agent(_: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "harnessrl.common.cli", "harness", "install", "mini-swe-agent"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        pytest.skip(f"could not install mini-swe-agent: {res.stderr[-400:]}")


BLOCKS: dict[str, Block] = {
    "demo-quick": Block(check_demo, timeout_s=900),
    "fleets": Block(check_fleets, timeout_s=600, subs={"4222": _port, "30000": _port}),
    "example-suite": Block(check_example_suite, timeout_s=300, subs={"30000": _port}),
    "command-harness": Block(
        check_command_harness,
        timeout_s=300,
        subs={"30000": _port, "/opt/llm-agent": _agent_dir},
        prepare=install_llm_agent,
    ),
    "mini-swe-agent": Block(
        check_mini_swe_agent, timeout_s=300, subs={"30000": _port}, prepare=install_mini_swe_agent
    ),
}
HARNESS_BLOCKS = {"command-harness", "mini-swe-agent"}


@pytest.mark.unit
def test_every_marked_block_is_run() -> None:
    """The marked blocks of the docs and the blocks this module runs are the same set."""
    assert set(marked_blocks()) == set(BLOCKS)


# ---------------------------------------------------------------------------------------------
# running a block
# ---------------------------------------------------------------------------------------------


def _end_session(proc: subprocess.Popen) -> None:
    """SIGTERM to the block's session (what a user's Ctrl-C would stop), SIGKILL after 30 s."""
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def run_block(name: str, cwd: Path) -> Ran:
    page, text = marked_blocks()[name]
    block = BLOCKS[name]
    for old, new in block.subs.items():
        assert old in text, f"{page.name} block {name!r} no longer holds {old!r}: update BLOCKS"
        text = text.replace(old, new(cwd))
    for link in ("examples", "deploy"):
        (cwd / link).symlink_to(REPO / link)
    (cwd / "block.sh").write_text(text)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-e", "block.sh"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=block.timeout_s)
    except subprocess.TimeoutExpired:
        _end_session(proc)
        out, _ = proc.communicate()
        pytest.fail(f"block {name!r} ran past {block.timeout_s} s:\n{out[-4000:]}")
    finally:
        _end_session(proc)
    assert proc.returncode == 0, f"block {name!r} exited {proc.returncode}:\n{out[-4000:]}"
    return Ran(out, cwd, time.monotonic() - t0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.harness] if n in HARNESS_BLOCKS else []) for n in BLOCKS],
)
def test_doc_block_runs(name: str, tmp_path: Path) -> None:
    """The block runs to the end as written and does what its page says."""
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    block = BLOCKS[name]
    if block.prepare is not None:
        block.prepare(tmp_path)
    ran = run_block(name, tmp_path)
    block.check(ran)
    print(f"{name}: {ran.seconds:.0f} s")
