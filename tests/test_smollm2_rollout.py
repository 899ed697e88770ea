"""``harnessrl rollout`` on a real model: ``smollm2-135m`` served by ``harnessrl engine``,
mini-swe-agent (unmodified) on a ``workspace`` task, and a hub id resolved offline for the
proxy's tokenizer and template.

The 135M model is no agent: what it answers does not matter here, only that the rollout runs
as a run's would and ends scored, with an exact record: every CallRecord's delta rebuilds its
input (hash-checked), each call continues the previous one exactly (0 TITO misses, 0 false
forks), and every sampled token carries its log-prob. mini-swe-agent drops a reply that was cut
off by the token limit from its history and asks again ("Your previous response reached the
output token limit..."): the next call then extends the previous call's input, not its output,
and the cut-off reply is a leaf of its own, which the tree must show (one leaf per dropped
reply, plus one).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harnessrl.common.bus import connect
from harnessrl.common.models import load_tokenizer
from harnessrl.common.records import CallRecord, unpack_ids
from harnessrl.proxy.tito import ChatRenderer
from tests.harness_env import extends, full_inputs
from tests.smollm2_env import HUB_ID, offline_env
from tests.test_smollm2_engine import engine_process

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine_url():
    with engine_process(["--model", "smollm2-135m"]) as (_, url):
        yield url


async def rollout(argv: list[str], env: dict[str, str] | None = None) -> tuple[dict, float]:
    import os

    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harnessrl.common.cli", "rollout", *argv, "--json", "--quiet",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 900)
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1]), time.monotonic() - start


async def calls_of(nats_url: str, run: str, rollout_id: str) -> list[CallRecord]:
    bus = await connect(nats_url, run)
    try:
        recs = await bus.read_subject(bus.subjects.calls(rollout_id), CallRecord)
    finally:
        await bus.close()
    return sorted(recs, key=lambda r: r.seq)


def check_exact(report: dict, records: list[CallRecord], gen_prompt: int) -> None:
    """Every delta rebuilds its input (hash-checked); each call continues the previous one
    exactly: from its input + sampled output when the harness kept the reply, from its input
    without the generation prompt (``gen_prompt`` ids) when it dropped it; one leaf per dropped
    reply plus one; 0 TITO misses, 0 false forks; every sampled token has its log-prob."""
    tree = report["tree"]
    assert (tree["tito_misses"], tree["false_forks"], tree["dropped_reason"]) == (0, 0, ""), tree
    assert len(records) == report["n_calls"] >= 2
    full = full_inputs(records)
    dropped = 0
    for a, b in zip(records, records[1:], strict=False):
        assert b.parent_seq == a.seq and b.tito_hit, (a.seq, b.seq)
        if not extends(records, a.seq, b.seq):  # the harness dropped a's reply
            assert a.finish_reason == "length"  # (mini-swe-agent does, for a cut-off one)
            n = a.input_len - gen_prompt
            assert b.prefix_len >= n and np.array_equal(full[b.seq][:n], full[a.seq][:n])
            assert b.prefix_len < a.input_len  # (the delta shares up to the next <|im_start|>)
            dropped += 1
    assert tree["n_leaves"] == 1 + dropped
    n_out = 0
    for r in records:
        out = unpack_ids(r.output_ids)
        lp = np.frombuffer(r.output_logprobs, "<f4")
        assert r.status == "ok" and len(out) == len(lp) > 0 and (lp <= 0).all()
        n_out += len(out)
    assert tree["model_tokens"] == n_out


@pytest.mark.harness
async def test_mini_swe_agent_rollout_on_a_workspace_task(
    engine_url: str, nats_url: str, run_name: str, sandbox_root: Path, tmp_path: Path
) -> None:
    """``harnessrl rollout --model smollm2-135m --harness mini-swe-agent`` on
    ``workspace/config_port_update``: scored (status ok, a reward in [0, 1]) and exact."""
    report, seconds = await rollout(
        [
            "--suite", "workspace", "--task", "config_port_update",
            "--harness", "mini-swe-agent", "--model", "smollm2-135m",
            "--engine", engine_url, "--nats", nats_url, "--run", run_name,
            "--sandbox-root", str(sandbox_root), "--max-turns", "3", "--max-new-tokens", "96",
        ]
    )  # fmt: skip
    print(f"mini-swe-agent rollout on smollm2-135m: {seconds:.0f} s, {report['n_calls']} calls")
    assert report["status"] == "ok", report
    assert 0.0 <= report["reward"] <= 1.0 and report["metrics"]
    records = await calls_of(nats_url, run_name, report["rollout_id"])
    check_exact(report, records, len(ChatRenderer(load_tokenizer("smollm2-135m")).gen_ids))
    first = records[0]
    text = unpack_ids(full_inputs(records)[first.seq])
    assert len(text) > 500  # mini-swe-agent's prompt with its bash tool, as the fallback wrote it


CLIENT = r"""
import json, os, urllib.request
base = os.environ["OPENAI_BASE_URL"].rstrip("/")
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
           "Content-Type": "application/json"}
msgs = [{"role": "user", "content": os.environ["HRL_INSTRUCTION"]}]
for i in range(2):
    body = {"model": os.environ["OPENAI_MODEL"], "messages": msgs, "max_tokens": 16}
    req = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(), headers)
    reply = json.loads(urllib.request.urlopen(req, timeout=600).read())["choices"][0]["message"]
    msgs += [{"role": "assistant", "content": reply.get("content") or ""},
             {"role": "user", "content": "And then?"}]
"""


async def test_rollout_with_a_hub_id_offline(
    engine_url: str,
    nats_url: str,
    run_name: str,
    sandbox_root: Path,
    tmp_path: Path,
    smollm2_hf_home: Path,
    smollm2: Path,
) -> None:
    """``--model harnessrl-test/smollm2-135m-dequantized`` (test HF cache, ``HF_HUB_OFFLINE=1``)
    builds the prompts: a two-call client run by the command harness, scored and exact."""
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    report, _ = await rollout(
        [
            "--suite", "workspace", "--task", "config_port_update",
            "--harness-cmd", "python3 /opt/hrl/client.py", "--model", HUB_ID,
            "--engine", engine_url, "--nats", nats_url, "--run", run_name,
            "--sandbox-root", str(sandbox_root),
            "--harness-options", json.dumps({"command": {"ro_binds": [[str(client), "/opt/hrl/client.py"]]}}),
        ],
        env=offline_env(smollm2_hf_home),
    )  # fmt: skip
    assert report["status"] == "ok" and report["n_calls"] == 2, report
    records = await calls_of(nats_url, run_name, report["rollout_id"])
    check_exact(report, records, len(ChatRenderer(load_tokenizer(smollm2)).gen_ids))
