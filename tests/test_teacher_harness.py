"""Teacher data recorded live through the real, unmodified mini-swe-agent.

``harnessrl teacher-data --harness mini-swe-agent``: each task is a rollout in a bubblewrap
sandbox — mini-swe-agent (installed in the harness cache) behind its own proxy, the scripted
teacher as the model, the toy checker after it — and the record is the token tree the
assembler builds from the proxy's CallRecords. Needs bubblewrap and mini-swe-agent (installed
on first use from PyPI; skips only when neither is possible)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.actors.teacher_data import TeacherDataConfig, tasks_for
from harnessrl.common.models import load_tokenizer, tokenizer_fingerprint
from harnessrl.learner.pretrain import as_sample, encode_file

pytestmark = [pytest.mark.slow, pytest.mark.harness]

REPO = Path(__file__).resolve().parents[1]
TOK = load_tokenizer("tiny-1m")
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def teacher_data(
    out: Path, tmp_path: Path, *families: str, harness: str = "mini-swe-agent", extra=()
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "harnessrl.common.cli", "teacher-data", "--out", str(out)]
    argv += list(extra)
    argv += ["--harness", harness, "--per-family", "1", "--vary-names", "0"]
    argv += ["--model", "tiny-1m", "--concurrency", "2", "--sandbox-root", str(tmp_path / "sb")]
    for f in families:
        argv += ["--family", f]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ)
    )


@pytest.fixture
async def mini_installed() -> None:
    from tests.harness_env import ensure_installed

    await ensure_installed("mini-swe-agent")


async def test_teacher_through_mini_swe_agent_scores_one_with_exact_records(
    tmp_path: Path, mini_installed: None
) -> None:
    """Two toy tasks through the real mini-swe-agent: each scores 1.0 in two calls (the
    family's one-liner through its ``bash`` tool, then its submit command), with 0 TITO
    misses and 0 false forks; the record's tokens are mini-swe-agent's own prompt and the
    teacher's replies, which the warm-start recipe reads back as SFT samples."""
    from tests.conftest import bwrap_or_skip

    await bwrap_or_skip(tmp_path / "probe")
    out = tmp_path / "teacher.jsonl"
    run = teacher_data(out, tmp_path, "copy", "count_word")
    assert run.returncode == 0, run.stderr[-3000:]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["family"] for r in recs} == {"copy", "count_word"}
    cfg = TeacherDataConfig(per_family=1, vary_names=0, families=["copy", "count_word"])
    one_liner = {t.id: t.command for t in tasks_for(cfg)}
    for r in recs:
        assert (r["reward"], r["solved"], r["style"]) == (1.0, True, "shell")
        assert (r["n_calls"], r["tito_misses"], r["false_forks"]) == (2, 0, 0)
        assert r["harness"] == "mini-swe-agent" and r["harness_version"]
        assert r["tokenizer"]["fingerprint"] == tokenizer_fingerprint(TOK)
        text = TOK.decode([i for n in r["nodes"] for i in n["ids"]], skip_special_tokens=False)
        assert f"Please solve this issue: {r['instruction']}" in text  # the harness's prompt
        assert '"name": "bash"' in text.split("\n</tools>")[0]  # the tool it declared
        assert '"returncode": 0' in text  # the harness's JSON wrapping of the tool result
        model = TOK.decode(
            [i for n in r["nodes"] for i, m in zip(n["ids"], n["mask"], strict=True) if m == "1"],
            skip_special_tokens=False,
        )
        assert model.count("<tool_call>") == 2 and model.count("<|im_end|>") == 2
        ran, submitted = model.split("<|im_end|>")[:2]
        assert json.dumps({"command": one_liner[r["task"]]}) in ran  # the one-liner via bash
        assert json.dumps({"command": SUBMIT}) in submitted  # then the submit command, alone
    stats = json.loads(Path(f"{out}.stats.json").read_text())
    assert stats["success_rate"] == 1.0 and stats["kept"] == 2 and stats["tito_misses"] == 0
    assert "rollouts/s" in run.stderr and "load average" in run.stderr
    # started cold (a fresh interpreter per rollout) instead of preloaded: the same tokens,
    # and the harness's CPU (measured inside the sandbox, plus the preloaded fork's) is more
    cold_out = tmp_path / "cold.jsonl"
    cold = teacher_data(cold_out, tmp_path, "copy", "count_word", extra=["--no-harness-preload"])
    assert cold.returncode == 0, cold.stderr[-3000:]
    cold_recs = [json.loads(line) for line in cold_out.read_text().splitlines()]
    by_task = {r["task"]: r for r in cold_recs}
    for r in recs:
        assert r["nodes"] == by_task[r["task"]]["nodes"]
    cold_stats = json.loads(Path(f"{cold_out}.stats.json").read_text())
    assert cold_stats["cpu_s_per_rollout_harness"] > 2.0  # litellm's import alone is seconds
    assert 0.1 < stats["cpu_s_per_rollout_harness"] < cold_stats["cpu_s_per_rollout_harness"]
    # the warm-start recipe reads the recorded trees as they are
    encoded = encode_file(TOK, out)
    for enc, r in zip(encoded, recs, strict=True):
        sample = as_sample(enc, r["task"])
        assert len(sample.nodes) == len(r["nodes"]) and int(enc.mask.sum()) == r["model_tokens"]


async def test_live_recording_resumes_after_a_crash(tmp_path: Path, mini_installed: None) -> None:
    """A partial file with one finished record and a torn line: the next run keeps the record,
    drops the torn line, records only the missing task and completes the file."""
    from tests.conftest import bwrap_or_skip

    await bwrap_or_skip(tmp_path / "probe")
    first = tmp_path / "first.jsonl"
    assert teacher_data(first, tmp_path, "first_line").returncode == 0
    (done,) = first.read_text().splitlines()
    out = tmp_path / "teacher.jsonl"
    Path(f"{out}.part").write_text(done + "\n" + '{"task": "torn')
    run = teacher_data(out, tmp_path, "first_line", "copy")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[0] == done and len(lines) == 2
    assert json.loads(lines[1])["family"] == "copy"
    stats = json.loads(Path(f"{out}.stats.json").read_text())
    assert (stats["skipped"], stats["rollouts"]) == (1, 1)


# harness -> its shell tool and that tool's command parameter, as its request declares them
OTHERS = {
    "claude-code": ("Bash", "command"),
    "codex": ("exec_command", "cmd"),
    "opencode": ("bash", "command"),
    "openclaw": ("exec", "command"),
}


@pytest.mark.parametrize("harness", sorted(OTHERS))
async def test_teacher_through_each_real_harness(tmp_path: Path, harness: str) -> None:
    """The same teacher through the other real harnesses: the task (found in whichever user
    message holds it: Codex sends its environment context first) solved with the harness's
    own shell tool, then a plain answer that ends its turn; exact records."""
    from tests.conftest import bwrap_or_skip
    from tests.harness_env import ensure_installed

    await ensure_installed(harness)
    await bwrap_or_skip(tmp_path / "probe")
    out = tmp_path / "teacher.jsonl"
    run = teacher_data(out, tmp_path, "count_word", harness=harness)
    assert run.returncode == 0, run.stderr[-3000:]
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (r["reward"], r["tito_misses"], r["false_forks"]) == (1.0, 0, 0)
    (task,) = tasks_for(TeacherDataConfig(per_family=1, vary_names=0, families=["count_word"]))
    model = TOK.decode(
        [i for n in r["nodes"] for i, m in zip(n["ids"], n["mask"], strict=True) if m == "1"],
        skip_special_tokens=False,
    )
    tool, key = OTHERS[harness]
    call = f'{{"name": "{tool}", "arguments": {json.dumps({key: task.command})}}}'
    assert model.startswith(f"<tool_call>\n{call}\n</tool_call><|im_end|>"), model[:300]
    assert model.endswith(f"Wrote {task.params['output']}.<|im_end|>")  # the final answer
