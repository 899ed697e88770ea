"""The assembler on CallRecords recorded from real harness runs through the real proxy.

Fixtures (``tests/fixtures/calls/<scenario>.msgpack``: a msgpack array of encoded CallRecords,
beside ``<scenario>.json`` describing the run and the shape it assembles into) were recorded by
``test_record_fixture`` below: Claude Code or Codex in a bubblewrap sandbox, the real proxy on a
unix socket, a scripted model (``tests/harness_env.ScenarioBrain``) and a real nats-server.
Re-record with ``HRL_SAVE_CALL_FIXTURES=1 pytest tests/test_assembler_fixtures.py -m harness``.

Scenarios:

* ``claude_code_retry`` — the engine answers Claude Code's second call with HTTP 500 (the
  proxy answers 502); Claude Code retries the same request.
* ``claude_code_compaction`` — a small auto-compact window: Claude Code asks for an
  ``<analysis>``/``<summary>`` compaction, then restarts from the summary (possibly twice).
* ``claude_code_subagent`` — the model calls Claude Code's ``Agent`` tool; the foreground
  sub-agent's calls carry ``x-claude-code-agent-id``.
* ``claude_code_all`` — the three together in one run (full tool set, not ``--bare``).
* ``codex_compaction`` — over ``model_auto_compact_token_limit`` Codex sends its tool-less
  "CONTEXT CHECKPOINT COMPACTION" request and restarts from the handoff summary.

What every fixture must assemble into: one main segment per compaction plus one, each a single
branch (zero false forks: every retained main call's input+output is a prefix of the next
retained main call's input in its segment, so re-rendered history never opens a branch); drops
exactly the errored, sub-agent and compaction calls, by reason; no token of a side call in the
main tree; the same sample whatever the order of the records.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harnessrl.actors.harnesses import default_cache_dir, get_adapter
from harnessrl.common.records import CallRecord, encode
from harnessrl.common.tree import AssembleOptions, Assembly, assemble_detailed
from tests.harness_env import (
    FIXTURES,
    RENDERER,
    SUBTASK,
    WRITE_TEXT,
    ScenarioBrain,
    extends,
    full_inputs,
    leaves_per_root,
    load_calls,
    proxy_stack,
    result_for,
    run_harness,
    save_calls,
    saving_fixtures,
)

MAX_FIXTURE_BYTES = 1 << 20


@dataclass(frozen=True)
class Scenario:
    harness: str
    instruction: str
    brain: dict[str, Any]
    """``ScenarioBrain`` arguments."""
    run: dict[str, Any] = field(default_factory=dict)
    """``run_harness`` arguments."""
    files: tuple[str, ...] = ("hello.txt",)
    """Workspace files the run must leave."""
    needs: tuple[str, ...] = ()
    """Events the run must contain: ``retry``, ``compaction``, ``subagent``."""


_CLAUDE_COMPACT = {
    "context_window": 24000,
    "env": {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "2000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "20"},
}
SCENARIOS = {
    "claude_code_retry": Scenario(
        "claude-code",
        "Create hello.txt containing a greeting.",
        {"steps": 1, "fail_at": 2},
        needs=("retry",),
    ),
    "claude_code_compaction": Scenario(
        "claude-code",
        "Create hello.txt, then numbered step files.",
        {"steps": 11},
        {**_CLAUDE_COMPACT, "max_turns": 30},
        needs=("compaction",),
    ),
    "claude_code_subagent": Scenario(
        "claude-code",
        "Create hello.txt containing a greeting, and have a sub-agent create sub.txt.",
        {"steps": 1, "subagent": True},
        {"options": {"bare": False}},
        files=("hello.txt", "sub.txt"),
        needs=("subagent",),
    ),
    "claude_code_all": Scenario(
        "claude-code",
        "Have a sub-agent create sub.txt, then create hello.txt and numbered step files.",
        {"steps": 8, "fail_at": 2, "subagent": True},
        {
            "options": {"bare": False},
            "context_window": 40000,
            "max_turns": 30,
            "env": {
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "2000",
                "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "54",
            },
        },
        files=("hello.txt", "sub.txt"),
        needs=("retry", "compaction", "subagent"),
    ),
    "codex_compaction": Scenario(
        "codex",
        "Create hello.txt, then numbered step files.",
        {"steps": 5},
        {"context_window": 18700},
        needs=("compaction",),
    ),
}


# ---------------------------------------------------------------------------------------------
# shapes


def shape_of(records: list[CallRecord]) -> dict[str, Any]:
    """What the records are, and what they assemble into (default options and with side calls
    exported)."""
    done = assemble_detailed(records, result_for(records))
    s = done.sample
    assert not s.is_tombstone, s.dropped_reason
    side = assemble_detailed(records, result_for(records), AssembleOptions(export_side_calls=True))
    by_track = Counter(track for track, _ in {side.segments[q] for q in side.retained})
    return {
        "n_calls": s.counters.n_calls,
        "labels": dict(sorted(Counter(r.label for r in records).items())),
        "statuses": dict(sorted(Counter(r.status for r in records).items())),
        "segments": len(leaves_per_root(s)),
        "leaves_per_segment": leaves_per_root(s),
        "n_leaves": s.counters.n_leaves,
        "dropped": dict(s.counters.dropped),
        "retained": list(done.retained),
        "unique_tokens": s.counters.unique_tokens,
        "expanded_tokens": s.counters.expanded_tokens,
        "model_tokens": s.counters.model_tokens,
        "tito_misses": s.counters.tito_misses,
        "side_segments": dict(sorted(by_track.items())),
        "side_n_leaves": side.sample.counters.n_leaves,
    }


def check_invariants(records: list[CallRecord], shape: dict[str, Any], needs: tuple[str, ...]):
    """What any real run must assemble into (see the module docstring)."""
    by_seq = {r.seq: r for r in records}
    labels = Counter(r.label for r in records)
    errors = sum(1 for r in records if r.label == "main" and r.status == "error")
    expected_drops = {"compaction": labels["compaction"], "subagent": labels["subagent"]}
    expected_drops["error"] = errors
    assert shape["dropped"] == {k: v for k, v in expected_drops.items() if v}
    assert shape["segments"] == 1 + labels["compaction"]
    assert shape["leaves_per_segment"] == [1] * shape["segments"]  # zero false forks
    assert shape["n_leaves"] == shape["segments"]
    retained = [by_seq[q] for q in shape["retained"]]
    assert all(r.label == "main" and r.status == "ok" for r in retained)
    model = sum(len(r.output_ids) // 4 for r in retained)
    assert shape["model_tokens"] == model  # side calls' tokens are kept out
    if "retry" in needs:
        assert errors == 1
    if "compaction" in needs:
        assert labels["compaction"] >= 1
    if "subagent" in needs:
        subs = [r for r in records if r.label == "subagent"]
        assert len(subs) >= 2 and all("x-claude-code-agent-id" in r.headers for r in subs)
        assert shape["side_segments"].get("subagent") == 1


def check_chain(records: list[CallRecord], done: Assembly) -> None:
    """Consecutive retained main calls of a segment extend each other exactly."""
    by_seg: dict[Any, list[int]] = {}
    for q in done.retained:
        by_seg.setdefault(done.segments[q], []).append(q)
    for seqs in by_seg.values():
        for a, b in zip(seqs, seqs[1:], strict=False):
            assert extends(records, a, b), f"call {b} does not extend call {a}"


# ---------------------------------------------------------------------------------------------
# the committed fixtures (no harness needed)

NAMES = sorted(SCENARIOS)


def _fixture(name: str) -> tuple[list[CallRecord], dict[str, Any]]:
    if not (FIXTURES / f"{name}.msgpack").exists():
        pytest.fail(f"fixture {name} is missing: record it with HRL_SAVE_CALL_FIXTURES=1")
    return load_calls(name)


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_fixture_assembles_into_expected_shape(name: str) -> None:
    """The recorded calls assemble exactly into the shape recorded beside them."""
    records, expected = _fixture(name)
    assert (FIXTURES / f"{name}.msgpack").stat().st_size < MAX_FIXTURE_BYTES
    assert expected["harness"] == SCENARIOS[name].harness
    shape = shape_of(records)
    assert shape == expected["shape"]
    check_invariants(records, shape, SCENARIOS[name].needs)


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_fixture_has_zero_false_forks(name: str) -> None:
    """Re-rendered history never opens a branch: each retained call extends the previous one."""
    records, _ = _fixture(name)
    done = assemble_detailed(records, result_for(records))
    check_chain(records, done)
    full = full_inputs(records)  # every delta rebuilds to its hash
    assert len(full) == len(records)


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_fixture_assembly_ignores_record_order(name: str) -> None:
    """Shuffled and duplicated records give the very same sample."""
    records, _ = _fixture(name)
    want = encode(assemble_detailed(records, result_for(records)).sample)
    rng = random.Random(name)
    for _ in range(3):
        mixed = records + rng.sample(records, k=min(3, len(records)))
        rng.shuffle(mixed)
        assert encode(assemble_detailed(mixed, result_for(records)).sample) == want


@pytest.mark.unit
def test_side_calls_are_their_own_roots_when_exported() -> None:
    """With export_side_calls the sub-agent conversation is one more root with one branch."""
    records, expected = _fixture("claude_code_subagent")
    opts = AssembleOptions(export_side_calls=True)
    done = assemble_detailed(records, result_for(records), opts)
    subs = [q for q in done.retained if done.segments[q][0] == "subagent"]
    assert subs == [r.seq for r in records if r.label == "subagent" and r.status == "ok"]
    assert done.sample.counters.n_leaves == 2 == expected["shape"]["side_n_leaves"]
    check_chain(records, done)


@pytest.mark.unit
def test_retry_keeps_only_the_successful_attempt() -> None:
    """The call answered 502 and its retry share one input; only the retry is trained."""
    records, _ = _fixture("claude_code_retry")
    (bad,) = [r for r in records if r.status == "error"]
    retry = next(r for r in records if r.seq > bad.seq)
    full = full_inputs(records)
    assert np.array_equal(full[bad.seq], full[retry.seq])
    assert len(bad.output_ids) == 0 and bad.error
    done = assemble_detailed(records, result_for(records))
    assert bad.seq not in done.retained and retry.seq in done.retained


@pytest.mark.unit
def test_compaction_restarts_a_segment() -> None:
    """Each Claude Code compaction request forks the history; the next main call starts a new
    root whose prompt quotes (as environment text) the summary the model wrote."""
    records, _ = _fixture("claude_code_compaction")
    done = assemble_detailed(records, result_for(records))
    for c in (r for r in records if r.label == "compaction"):
        after = next(r for r in records if r.seq > c.seq and r.label == "main")
        assert done.segments[after.seq] == ("main", after.seq)  # opens a segment
        restart = RENDERER.decode(full_inputs(records)[after.seq])
        assert "Primary Request and Intent: write numbered step files." in restart


# ---------------------------------------------------------------------------------------------
# recording (real harnesses)


@pytest.mark.integration
@pytest.mark.harness
@pytest.mark.parametrize("name", NAMES)
async def test_record_fixture(name: str, nats_url: str, run_name: str, tmp_path: Path) -> None:
    """Run the scenario for real; its records must meet the invariants (saved on request)."""
    sc = SCENARIOS[name]
    brain = ScenarioBrain(**sc.brain)
    async with proxy_stack(nats_url, run_name, brain, tmp_path) as st:
        run = await asyncio.wait_for(
            run_harness(sc.harness, st, tmp_path, sc.instruction, read=sc.files, **sc.run), 280
        )
        records = await st.records()
        statuses = [r.get("status") for r in st.server.posts()]
    assert run.returncode == 0, run.tail()
    for f in sc.files:
        assert run.files[f] is not None, (f, run.tail())
    assert run.files["hello.txt"] == WRITE_TEXT.encode()
    if "retry" in sc.needs:
        assert 502 in statuses, statuses
    if "subagent" in sc.needs:
        assert any(SUBTASK in p.first_user() for p, _ in brain.log)
    shape = shape_of(records)
    check_invariants(records, shape, sc.needs)
    check_chain(records, assemble_detailed(records, result_for(records)))
    if saving_fixtures():
        version = get_adapter(sc.harness).installed_version(default_cache_dir())
        meta = {"harness": sc.harness, "harness_version": version, "scenario": name}
        meta |= {"events": brain.events, "run": sc.run, "brain": sc.brain}
        path = save_calls(name, records, {**meta, "shape": shape})
        assert path.stat().st_size < MAX_FIXTURE_BYTES
