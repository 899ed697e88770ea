"""The warm-start recipe: teacher data through the real reference agent, the token layout of
the SFT samples, the lr schedule, the recipe end to end (``--quick``) with resume, and the
shipped ``tiny-agent`` (checksums, output limit, held-out success)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harnessrl.actors import teacher_data
from harnessrl.actors.harnesses import reference_agent as ra
from harnessrl.common.models import load_tokenizer, render_chat
from harnessrl.common.tasks.model import DEFAULT_MOUNT
from harnessrl.common.tasks.toy import DIRS, FAMILY, INPUTS, OUTPUTS, generate, vary_names
from harnessrl.learner.ds_engine import DeepSpeedConfig, lr_at
from harnessrl.learner.pretrain import encode_conversation, read_conversations

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = DeepSpeedConfig(lr=1.0, lr_warmup_versions=4, lr_decay_versions=15, lr_min_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(20)]
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[4:14], lrs[5:15], strict=True))  # strictly decaying
    assert lrs[9] == pytest.approx(0.55)  # halfway down the cosine
    assert lrs[14:] == pytest.approx([0.1] * 6)
    assert lr_at(DeepSpeedConfig(lr=0.3), 1000) == 0.3  # no schedule: constant


@pytest.mark.unit
@pytest.mark.parametrize("family", ["write_word", "copy", "json_collect"])
def test_teacher_trajectory_is_the_reference_agents_conversation(family: str):
    """The harness's own system prompt (workspace at the sandbox mount), tool schema and
    message echoing; tool results from a real folder; the task is solved."""
    task = next(t for t in generate(0) if t.family.name == family and t.split == "train")
    rec = teacher_data.trajectory(task, style="edit")
    msgs = rec["messages"]
    assert msgs[0] == {
        "role": "system",
        "content": ra.SYSTEM_PROMPT.format(workspace=DEFAULT_MOUNT),
    }
    assert msgs[1] == {"role": "user", "content": task.instruction}
    assert rec["tools"] == ra.TOOLS
    calls = [m["tool_calls"][0]["function"]["name"] for m in msgs if m["role"] == "assistant"]
    assert calls[-1] == "finish" and "write_file" in calls
    tool_results = [m["content"] for m in msgs if m["role"] == "tool"]
    assert any(r.startswith("wrote ") for r in tool_results)  # the agent's own write_file text
    if family != "write_word":
        assert calls[0] in ("read_file", "list_dir")


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILY))
def test_shell_teacher_solves_every_family_through_the_agents_run_tool(family: str):
    """The ``shell`` style: one ``run`` of the family's one-liner (``sh -c`` in the workspace,
    the reference agent's own tool), then ``finish``; the output is exactly the expected one
    (``trajectory`` raises otherwise) on training and held-out tasks alike."""
    tasks = [t for t in generate(0) if t.family.name == family]
    for task in tasks[:3] + [t for t in tasks if t.split == "eval"]:
        rec = teacher_data.trajectory(task, style="shell")
        turns = [m for m in rec["messages"] if m["role"] == "assistant"]
        calls = [m["tool_calls"][0]["function"] for m in turns]
        assert [c["name"] for c in calls] == ["run", "finish"]
        assert json.loads(calls[0]["arguments"]) == {"cmd": task.command}
        (result,) = [m["content"] for m in rec["messages"] if m["role"] == "tool"][:1]
        assert result.startswith("exit code: 0")


@pytest.mark.integration
def test_shell_teacher_command_fails_on_a_wrong_workspace(tmp_path: Path):
    """The check in ``trajectory`` is real: a one-liner that does not produce the expected
    output (here: the input file is missing) is refused, not written as training data."""
    task = next(t for t in generate(0) if t.family.name == "sort_lines")
    task.files.clear()
    with pytest.raises(RuntimeError, match="teacher did not solve"):
        teacher_data.trajectory(task, style="shell")


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILY))
def test_near_miss_teacher_is_wrong_the_same_way_on_every_task(family: str):
    """The ``near_miss`` style runs the family's plausible wrong one-liner through the agent's
    ``run`` tool, then finishes as if it were right. It is a real mistake (the output differs
    from the expected one on every task checked here) and one family-level mistake (the same
    template on every task), which is what lets RL unlearn it on held-out tasks too."""
    fam = FAMILY[family]
    assert fam.near_miss and fam.near_miss != fam.shell
    tasks = [t for t in generate(0) if t.family.name == family][:4]
    for task in tasks:
        rec = teacher_data.trajectory(task, style="near_miss")
        calls = [m["tool_calls"][0]["function"] for m in rec["messages"] if m.get("tool_calls")]
        assert [c["name"] for c in calls] == ["run", "finish"]
        assert json.loads(calls[0]["arguments"]) == {"cmd": fam.command(task.params, True)}
        assert rec["style"] == "near_miss" and rec["solved"] is False, task.id


@pytest.mark.integration
def test_teacher_data_near_miss_share(tmp_path: Path):
    """``near_miss`` sets the share of training trajectories that demonstrate the mistake; the
    held-out split never gets any."""
    out = tmp_path / "t.jsonl"
    cfg = teacher_data.TeacherDataConfig(
        out=out, per_family=10, families=["first_line", "sort_lines"], near_miss=0.5
    )
    assert teacher_data.main(cfg) == 0
    recs = read_conversations(out)
    wrong = [r for r in recs if r["style"] == "near_miss"]
    assert 0 < len(wrong) < len(recs) and not any(r["solved"] for r in wrong)
    assert all(r["solved"] for r in recs if r["style"] == "shell")
    ev = teacher_data.TeacherDataConfig(out=out, split="eval", near_miss=1.0, families=["copy"])
    assert teacher_data.main(ev) == 0
    assert {r["style"] for r in read_conversations(out)} == {"shell"}


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILY))
def test_vary_names_renames_only_the_names(family: str):
    """A renamed task is the same task under other names: its instruction and files use the new
    names (none a built-in one, so never a held-out task), its expected output is unchanged,
    and the shell teacher still solves it through the agent's ``run`` tool."""
    rng = random.Random(0)
    for t in [t for t in generate(0) if t.family.name == family][:3]:
        r = vary_names(t, rng)
        assert r.expected == t.expected and r.family is t.family
        assert r.params["output"] not in OUTPUTS and r.params["output"] in r.instruction
        for key, builtin in (("input", INPUTS), ("dir", DIRS)):
            if key in t.params:
                assert r.params[key] not in builtin and r.params[key] in r.instruction
                assert t.params[key] not in r.instruction.split()
        assert sorted(r.files.values()) == sorted(t.files.values())
        teacher_data.trajectory(r, style="shell")  # raises unless solved


@pytest.mark.integration
def test_teacher_data_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "t.jsonl"
    cfg = teacher_data.TeacherDataConfig(out=out, per_family=8, families=["copy", "count_lines"])
    assert teacher_data.main(cfg) == 0
    recs = read_conversations(out)
    assert sorted({r["family"] for r in recs}) == ["copy", "count_lines"] and len(recs) == 16
    renamed = [r for r in recs if r["task"].endswith("_renamed")]
    assert 0 < len(renamed) < 16  # vary_names = 0.5 by default
    held = {(t.family.name, t.instruction) for t in generate(0) if t.split == "eval"}
    assert not any((r["family"], r["messages"][1]["content"]) in held for r in recs)
    bad = teacher_data.TeacherDataConfig(out=out, families=["nope"])
    assert teacher_data.main(bad) == 2
    for fields, why in (
        ({"harness": "mini-swe-agnet"}, "did you mean 'mini-swe-agent'"),
        ({"harness": "command"}, "not a model"),
        ({"harness": "mini-swe-agent", "style": "edit"}, "--style edit needs the reference"),
        ({"harness": "mini-swe-agent", "engine": "127.0.0.1:1"}, "--engine must be an http"),
        ({"engine": "http://127.0.0.1:1"}, "add --live for the reference harness"),
    ):
        capsys.readouterr()
        assert teacher_data.main(teacher_data.TeacherDataConfig(out=out, **fields)) == 2
        assert why in capsys.readouterr().err


@pytest.mark.unit
def test_bad_conversation_file_names_the_line(tmp_path: Path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"messages": []}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a conversation record"):
        read_conversations(f)


@pytest.mark.integration  # the teacher runs its shell commands
def test_recorded_token_trees_are_read_as_they_are(tmp_path: Path):
    """A live record's token tree (``nodes``) becomes the SFT sample node for node, with its
    loss mask; a tree made by another tokenizer, or malformed, is refused, naming the record."""
    from harnessrl.common.models import tokenizer_fingerprint
    from harnessrl.learner.pretrain import as_sample, encode_file

    tok = load_tokenizer("tiny-1m")
    task = next(t for t in generate(0) if t.family.name == "copy" and t.split == "train")
    enc = encode_conversation(tok, teacher_data.trajectory(task)["messages"], ra.TOOLS)
    cut = int(np.argmax(enc.mask))  # a root (the prompt) and a child (the rest)
    nodes = [
        {"parent": -1, "ids": enc.ids[:cut].tolist(), "mask": "0" * cut},
        {
            "parent": 0,
            "ids": enc.ids[cut:].tolist(),
            "mask": "".join(str(int(m)) for m in enc.mask[cut:]),
        },
    ]
    rec = {"task": "t", "family": "copy", "nodes": nodes}
    rec["tokenizer"] = {"name": "tiny-1m", "fingerprint": tokenizer_fingerprint(tok)}
    f = tmp_path / "live.jsonl"
    f.write_text(json.dumps(rec) + "\n")
    (got,) = encode_file(tok, f)
    assert got.ids.tolist() == enc.ids.tolist() and got.mask.tolist() == enc.mask.tolist()
    sample = as_sample(got, "k")
    assert [n.parent for n in sample.nodes] == [-1, 0]
    assert np.frombuffer(sample.nodes[1].loss_mask, np.uint8).tolist() == enc.mask[cut:].tolist()
    for bad, why in (
        ({**rec, "tokenizer": {"name": "other", "fingerprint": "0" * 16}}, "made by other"),
        ({**rec, "nodes": [{**nodes[0], "mask": "0"}]}, "mask not one 0/1 per token"),
        ({**rec, "nodes": [{**nodes[0], "parent": 3}]}, "bad parent"),
        ({**rec, "nodes": [{**nodes[0], "ids": [10**6] * cut}]}, "outside the vocabulary"),
    ):
        f.write_text(json.dumps(rec) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=f"live.jsonl: conversation 2: .*{why}"):
            encode_file(tok, f)


@pytest.mark.unit
def test_sft_sample_layout_is_the_proxys():
    """Prompt deltas masked out, each reply's tokens (through <|im_end|>) in; the ids decode to
    the rendered conversation; the masked-in text is exactly the assistant turns."""
    tok = load_tokenizer("tiny-1m")
    task = next(t for t in generate(0) if t.family.name == "json_field" and t.split == "train")
    rec = teacher_data.trajectory(task, style="edit")
    enc = encode_conversation(tok, rec["messages"], rec["tools"])
    full = render_chat(rec["messages"], tools=rec["tools"])
    assert tok.decode(enc.ids.tolist(), skip_special_tokens=False) == full.removesuffix("\n")
    replies, cur = [], []
    for i, m in zip(enc.ids, enc.mask, strict=True):
        if m:
            cur.append(int(i))
        elif cur:
            replies.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
    replies.append(tok.decode(cur, skip_special_tokens=False))
    n_assistant = sum(m["role"] == "assistant" for m in rec["messages"])
    assert len(replies) == n_assistant
    assert all(r.endswith("<|im_end|>") and "<|im_start|>" not in r for r in replies)
    assert replies[0].startswith("I will read ") and "<tool_call>" in replies[0]
    assert enc.mask[0] == 0 and int(np.sum(enc.mask)) < len(enc.mask) // 2


@pytest.mark.unit
def test_recipe_records_once_per_harness(tmp_path: Path, monkeypatch):
    """Several harnesses: one teacher-data file per harness and split, a live harness recorded
    with the recipe's model and concurrency, and a file already there (a finished recording)
    is used as it is, not recorded again."""
    from harnessrl.common.config import ConfigError, load_config
    from harnessrl.learner import pretrain_cmd

    cfg = pretrain_cmd.PretrainConfig(
        model="tiny-agent", harnesses=["reference", "claude-code", "reference"], per_family=7
    )
    assert cfg.harnesses == ["reference", "claude-code"]
    runs: list[list[str]] = []
    monkeypatch.setattr(pretrain_cmd.subprocess, "run", lambda argv, check: runs.append(argv))
    (tmp_path / "teacher-eval.jsonl").write_text("")
    paths = [
        pretrain_cmd.teacher_data(cfg, tmp_path, s, h)
        for s in ("train", "eval")
        for h in cfg.harnesses
    ]
    names = [
        "teacher.jsonl",
        "teacher-claude-code.jsonl",
        "teacher-eval.jsonl",
        "teacher-eval-claude-code.jsonl",
    ]
    assert [p.name for p in paths] == names
    assert [r[r.index("--out") + 1] for r in runs] == [
        str(tmp_path / n) for n in names[:2] + names[3:]
    ]
    ref, live, live_eval = runs
    assert "--harness" not in ref and "--near-miss" not in live_eval
    assert live[live.index("--harness") :][:4] == [
        "--harness",
        "claude-code",
        "--model",
        "tiny-agent",
    ]
    assert live[live.index("--per-family") + 1] == "7"
    with pytest.raises(ConfigError, match="at least one harness"):
        load_config(pretrain_cmd.PretrainConfig, None, {"harnesses": []})


@pytest.mark.unit
def test_live_recording_stats_name_where_the_model_ran():
    """A recording's CPU line says what ran in the recording process: the teacher with it,
    not when the model is an engine elsewhere (``--engine``)."""
    from harnessrl.actors.teacher_live import Stats

    assert "teacher" in Stats("mini-swe-agent", tasks=1, concurrency=1).line()
    line = Stats("mini-swe-agent", tasks=1, concurrency=1, teacher=False).line()
    assert "teacher" not in line and "model: an engine" in line


@pytest.mark.slow
def test_recipe_resumes_and_exports(tmp_path: Path, monkeypatch):
    """A short recipe run, then the same with more steps: it resumes at the checkpoint (no step
    done twice) and exports a loadable bf16 folder with checksums and its output limit."""
    import torch

    from harnessrl.common.models import load_model
    from harnessrl.learner import pretrain_cmd

    data = tmp_path / "t.jsonl"
    teacher_data.main(teacher_data.TeacherDataConfig(out=data, per_family=2))
    base = dict(out=tmp_path / "r", data=data, batch=4, eval_every=3, checkpoint_every=3)
    base |= dict(warmup_steps=1, eval_n=0, log_every=1, threads=1)
    assert pretrain_cmd.main(pretrain_cmd.PretrainConfig(steps=3, **base)) == 0
    assert pretrain_cmd.main(pretrain_cmd.PretrainConfig(steps=5, **base)) == 0
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    steps = [int(x["step"]) for x in lines if x["kind"] == "step"]
    assert steps == [1, 2, 3, 4, 5]
    assert lines[-1]["kind"] == "eval" and lines[-1]["n"] == 40
    folder = tmp_path / "r" / "model"
    recipe = json.loads((folder / "harnessrl_recipe.json").read_text())
    assert recipe["steps"] == 5 and recipe["recipe"]["batch"] == 4
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == 128
    sums = dict(reversed(ln.split("  ")) for ln in (folder / "SHA256SUMS").read_text().splitlines())
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(sums)
    model = load_model(folder)
    assert next(model.parameters()).dtype == torch.float32  # bf16 on disk, loaded as asked
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (no dict)
    assert dtypes == {torch.bfloat16}


@pytest.mark.slow
def test_quick_recipe_cli(tmp_path: Path):
    """``harnessrl pretrain --quick`` end to end as a process: data, SFT, export."""
    dist = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist}  # not this process's group
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harnessrl.common.cli",
            "pretrain",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported" in proc.stderr and (tmp_path / "model" / "SHA256SUMS").exists()
    assert (tmp_path / "teacher.jsonl").exists() and (tmp_path / "checkpoints" / "latest").exists()


@pytest.mark.unit
def test_shipped_model_checksums_are_checked(tmp_path: Path, monkeypatch):
    from harnessrl.common.models import resolve, resolve_model

    shipped = resolve.SHIPPED["tiny-agent"]
    if not (shipped / "SHA256SUMS").exists():
        pytest.skip("tiny-agent is not built in this checkout")
    copy = tmp_path / "tiny-agent"
    shutil.copytree(shipped, copy)
    monkeypatch.setitem(resolve.SHIPPED, "tiny-agent", copy)
    monkeypatch.setattr(resolve, "_VERIFIED", set())
    assert resolve_model("tiny-agent") == copy
    assert resolve.model_max_new_tokens("tiny-agent") == 128
    (copy / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    monkeypatch.setattr(resolve, "_VERIFIED", set())
    with pytest.raises(ValueError, match="does not match SHA256SUMS"):
        resolve_model("tiny-agent")


N_PER_TASK = 3


def eval_as_recorded(
    tmp_path: Path, policy: str, harness: str, n: int, rec: dict, timeout: float
) -> dict:
    """``harnessrl eval`` of a shipped policy on its record's suite and temperature through
    ``harness``, ``n`` rollouts per task: the policy's summary cell."""
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "harnessrl.common.cli", "eval", "--policy", policy]
        + ["--suite", rec["suite"], "--harness", harness, "--n", str(n)]
        + ["--temperature", str(rec["temperature"]), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["summary"][policy][harness]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shipped_warm_start_holds_its_recorded_success(tmp_path: Path):
    """The committed policy, evaluated as its recipe evaluated it (every held-out task,
    temperature 1, seed 0, the real reference harness in a sandbox) but with 3 rollouts per
    task (120), scores no lower than its recorded success minus 0.1. The recipe records its
    success over 12 per task (480), so the record's own noise is small (sd 0.02) next to this
    eval's (sd 0.04 at p = 0.3)."""
    from harnessrl.common.models import resolve_model

    recorded = json.loads((resolve_model("tiny-agent") / "harnessrl_recipe.json").read_text())
    rec = recorded["held_out_success"]
    got = eval_as_recorded(tmp_path, "tiny-agent", "reference", N_PER_TASK, rec, timeout=840)
    assert got["n"] == rec["n"] // rec["n_per_task"] * N_PER_TASK
    assert got["success"] >= rec["success"] - 0.1, (got, rec)
    # while the recorded success is under 0.1 the line above cannot fail; the mean reward
    # (0.58 recorded, 0.5 of it for any non-empty output; a random or broken policy scores
    # ~0) keeps the check meaningful
    assert got["reward"] >= rec["reward"] - 0.1, (got, rec)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shipped_harness_policy_drives_claude_code(tmp_path: Path):
    """``tiny-agent-harness`` through the real, unmodified Claude Code (installed on first use)
    as its recipe evaluated it, with 2 rollouts per held-out task (80): it solves tasks
    (``tiny-agent``, never taught Claude Code's tools, solves none) and scores no lower than its
    recorded success minus 0.15 (2.5 sd of this eval's and the record's noise together at
    p = 0.3), nor its mean reward minus 0.12."""
    from harnessrl.common.models import resolve_model

    meta = json.loads((resolve_model("tiny-agent-harness") / "harnessrl_recipe.json").read_text())
    assert {"mini-swe-agent", "claude-code"} <= set(meta["harnesses"])
    rec = meta["held_out_by_harness"]["claude-code"]
    got = eval_as_recorded(tmp_path, "tiny-agent-harness", "claude-code", 2, rec, timeout=570)
    assert got["n"] == 80 and got["errors"] == 0, got
    assert got["success"] > 0.1 and got["success"] >= rec["success"] - 0.15, (got, rec)
    assert got["reward"] >= rec["reward"] - 0.12, (got, rec)
