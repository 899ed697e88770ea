"""Real harnesses through the real proxy: a two-step task, recorded exactly on NATS.

Each harness runs inside a bubblewrap sandbox and reaches the proxy through the sandbox's
loopback forwarder and the proxy's unix socket (what an actor does). The model is a scripted
engine whose brain reads the prompt it is given — the harness's own tools, rendered by the
chat template — and answers: first a call of the harness's own file-writing tool, then a final
answer. Asserted: the file exists in the workspace, and the CallRecords on a real nats-server
hold two main calls whose second input extends the first call's input + output exactly (a TITO
hit; the delta names the first call as parent with the whole of its path as shared prefix).

Harnesses are installed once into the harness cache (``harnessrl harness install NAME``);
tests skip, saying why, only when a harness is missing and cannot be installed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from harnessrl.common.records import CallRecord, RolloutResult, unpack_ids
from harnessrl.common.tree import assemble, expand
from tests.harness_env import (
    RENDERER,
    ROLLOUT,
    TOKEN,
    WRITE_TEXT,
    WriteThenAnswer,
    extends,
    full_inputs,
    proxy_stack,
    run_harness,
)

pytestmark = pytest.mark.harness

INSTRUCTION = "Create hello.txt containing a greeting."

# harness -> (API it speaks, request path, how it sends the rollout's token)
API = {
    "claude-code": ("messages", "/v1/messages?beta=true", ("x-api-key", TOKEN)),
    "codex": ("responses", "/v1/responses", ("Authorization", f"Bearer {TOKEN}")),
    "opencode": ("chat", "/v1/chat/completions", ("Authorization", f"Bearer {TOKEN}")),
    "mini-swe-agent": ("chat", "/v1/chat/completions", ("Authorization", f"Bearer {TOKEN}")),
    "openclaw": ("chat", "/v1/chat/completions", ("Authorization", f"Bearer {TOKEN}")),
}


async def two_step(name: str, nats_url: str, run_name: str, tmp_path: Path):
    brain = WriteThenAnswer()
    async with proxy_stack(nats_url, run_name, brain, tmp_path) as st:
        run = await asyncio.wait_for(
            run_harness(name, st, tmp_path, INSTRUCTION, read=("hello.txt",)), 280
        )
        records = await st.records()
        return run, records, st.server.requests


def check_transport(name: str, records: list[CallRecord], requests: list[dict]) -> None:
    api, path, (header, value) = API[name]
    posts = [r for r in requests if r["method"] == "POST"]
    assert posts and all(r["path"] == path for r in posts), [r["path"] for r in requests]
    assert all(r["headers"].get(header) == value for r in posts)
    assert all(r["status"] == 200 for r in posts), [r["status"] for r in posts]
    assert len(records) == len(posts)  # every call recorded, nothing else
    assert {r.api for r in records} == {api}


def check_two_main_calls(records: list[CallRecord]) -> tuple[CallRecord, CallRecord]:
    assert [r.seq for r in records] == list(range(len(records)))
    assert all(r.status == "ok" for r in records)
    main = [r for r in records if r.label == "main"]
    assert len(main) == 2, [(r.seq, r.label) for r in records]
    first, second = main
    text = RENDERER.decode(unpack_ids(first.output_ids))
    assert text.startswith("<tool_call>") and text.endswith("<|im_end|>"), text
    assert RENDERER.decode(unpack_ids(second.output_ids)) != text
    return first, second


def check_extension(records: list[CallRecord], first: CallRecord, second: CallRecord) -> None:
    n_path = first.input_len + len(unpack_ids(first.output_ids))
    assert extends(records, first.seq, second.seq)
    assert (second.parent_seq, second.prefix_len) == (first.seq, n_path)
    assert second.tito_hit
    # the assembler, from the same records: one branch, the second call's whole path
    result = RolloutResult(
        rollout_id=ROLLOUT, task_id="hello", group_id="g", k=0, n_calls=len(records)
    )
    sample = assemble(records, result)
    assert not sample.is_tombstone, sample.dropped_reason
    (branch,) = expand(sample)
    path = np.concatenate([full_inputs(records)[second.seq], unpack_ids(second.output_ids)])
    assert np.array_equal(branch.token_ids, path)
    n_out = len(first.output_ids) // 4 + len(second.output_ids) // 4
    assert int(branch.loss_mask.sum()) == n_out == sample.counters.model_tokens


@pytest.mark.integration
@pytest.mark.parametrize("name", ["claude-code", "codex", "opencode", "mini-swe-agent"])
async def test_two_step_task_through_the_proxy(
    name: str, nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """Write a file with the harness's own tool, answer; the second input extends the first."""
    run, records, requests = await two_step(name, nats_url, run_name, tmp_path)
    assert run.returncode == 0, run.tail()
    assert run.files["hello.txt"] == WRITE_TEXT.encode(), run.tail()
    check_transport(name, records, requests)
    first, second = check_two_main_calls(records)
    check_extension(records, first, second)
    if name == "opencode":  # its concurrent session-title request
        assert [r.label for r in records if r.label != "main"] == ["aux"]


@pytest.mark.slow
async def test_openclaw_two_step_task_through_the_proxy(
    nats_url: str, run_name: str, tmp_path: Path
) -> None:
    """OpenClaw writes the file through the proxy; its second input extends the first.

    With its session tools (``session_tools: true``) OpenClaw keeps an "internal context" user
    message at the *end* of every request, so no call would extend the one before it; the
    adapter denies those tools by default, and the message is gone."""
    run, records, requests = await two_step("openclaw", nats_url, run_name, tmp_path)
    assert run.returncode == 0, run.tail()
    assert run.files["hello.txt"] == WRITE_TEXT.encode(), run.tail()
    check_transport("openclaw", records, requests)
    first, second = check_two_main_calls(records)
    last = requests[0]["body"]["messages"][-1]
    assert "OPENCLAW_INTERNAL_CONTEXT" not in str(last["content"])  # the instruction is last
    check_extension(records, first, second)
