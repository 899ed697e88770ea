"""Each real harness on a multi-turn workspace task, recorded through the real proxy.

Fixtures ``tests/fixtures/calls/<harness>_workspace.msgpack`` (a msgpack array of encoded
CallRecords) and ``<harness>_workspace.json`` (the run and the shape it assembles into) were
recorded by ``test_record_workspace`` below: the harness binary in a bubblewrap sandbox, the real
proxy on a unix socket, a scripted model (``WorkspaceBrain``) and a real nats-server. Re-record
with ``HRL_SAVE_CALL_FIXTURES=1 pytest tests/test_harness_fixtures.py -m harness``.

The scripted task, the same for every harness (its own tools, read from the prompt):

1. write ``notes.txt`` (its file-writing tool, else its shell)  — reply ends on ``<|im_end|>``
2. list the workspace (``ls``)                                   — ends on ``<|endoftext|>``
3. read ``notes.txt`` (its file-reading tool, else ``cat``)      — ends on ``<|im_end|>``
4. write ``result.txt`` (the line count, via its shell)          — ends on ``<|endoftext|>``
5. finish: a final answer (mini-swe-agent: its submit command)   — ends on ``<|endoftext|>``

The step is the number of tool results in the prompt, so a harness that re-asks (a retry, a
format error) gets the same answer. Tool-less calls (opencode's session title) get a short text,
after ``AUX_DELAY_S``, so that they overlap the first main call (as against a real engine).
A turn that ended on ``<|endoftext|>`` keeps that sampled token in the next prompt, followed by
the template's turn end, so the conversation stays one branch.

What every fixture must assemble into (always checked, no harness needed): a sample (no
tombstone, in particular no ``bad_delta``); exactly one leaf per segment; zero false forks;
every record carries the harness's adapter name and version; the same sample whatever the
order of the records. ``tito_misses`` is 0 where the history is unchanged: one segment, each
call extending the previous one exactly. OpenClaw with its session tools (``session_tools:
true``, off by default) is the exception (``history="edited"``): it moves its runtime-context
message ("Active exec sessions", "Active Subagents") to the end of every request, so every call
is a miss and a segment of its own; as the adapter configures it by default it is unchanged.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harnessrl.actors.harnesses import default_cache_dir, get_adapter
from harnessrl.common.records import CallRecord, encode, unpack_ids
from harnessrl.common.tree import AssembleOptions, Assembly, assemble_detailed
from harnessrl.proxy.scripted import Reply
from tests.harness_env import (
    FIXTURES,
    RENDERER,
    SUBMIT,
    TOKENIZER,
    Brain,
    Prompt,
    extends,
    full_inputs,
    leaves_per_root,
    load_calls,
    proxy_stack,
    result_for,
    run_harness,
    save_calls,
    saving_fixtures,
    shell_call,
    tool_call,
    write_call,
)

MAX_FIXTURE_BYTES = 1 << 20
AUX_DELAY_S = 1.5
"""How long a tool-less call (opencode's session title) takes to answer: long enough that the
harness's first main call starts while it is in flight, as it does against a real engine."""
IM_END, ENDOFTEXT = 2, 0
NOTES = "alpha\nbeta\ngamma\n"
INSTRUCTION = (
    "Write notes.txt with three lines (alpha, beta, gamma), list the workspace, read "
    "notes.txt back, then write its line count to result.txt."
)


@dataclass(frozen=True)
class Scenario:
    harness: str
    run: dict[str, Any] = field(default_factory=dict)
    """``run_harness`` arguments."""
    history: str = "kept"
    """``kept``: every request repeats the earlier ones verbatim and appends to them (one
    segment, every call after the first a TITO hit). ``edited``: the harness rewrites earlier
    requests (OpenClaw moves its runtime-context message to the end of every request), so every
    call is a TITO miss and starts a segment of its own (still no false fork)."""


SCENARIOS = {
    "mini_swe_agent_workspace": Scenario("mini-swe-agent"),
    "opencode_workspace": Scenario("opencode"),
    "openclaw_workspace": Scenario("openclaw"),
    # with the tools whose state OpenClaw reports in a runtime-context message it moves to the
    # end of every request (``process``, ``sessions_spawn``): an edited history
    "openclaw_session_tools_workspace": Scenario(
        "openclaw", run={"options": {"session_tools": True}}, history="edited"
    ),
    "claude_code_workspace": Scenario("claude-code"),
    "codex_workspace": Scenario("codex"),
}
NAMES = sorted(SCENARIOS)
FILES = ("notes.txt", "result.txt")


def expected_misses(records: list[CallRecord], sc: Scenario) -> int:
    n_main = sum(1 for r in records if r.label == "main")
    return 0 if sc.history == "kept" else n_main - 1


# ---------------------------------------------------------------------------------------------
# the scripted model


def read_call(p: Prompt, path: str) -> str | None:
    """A call of the harness's file-reading tool (Claude Code's ``Read``, opencode's and
    OpenClaw's ``read``) for ``path``, else ``cat`` with its shell tool."""
    for name in ("Read", "read"):
        props = (p.tools.get(name) or {}).get("properties") or {}
        key = next((k for k in ("file_path", "filePath", "path") if k in props), None)
        if key:
            return tool_call(name, {key: path if key == "path" else f"/workspace/{path}"})
    return shell_call(p, f"cat {path}", f"read {path}")


class WorkspaceBrain(Brain):
    """The five-step workspace task of the module docstring."""

    STOPS = (IM_END, ENDOFTEXT, IM_END, ENDOFTEXT, ENDOFTEXT)

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def decide(self, p: Prompt) -> Any:
        if not p.tools:
            self.events.append("aux")
            return Reply(text="Workspace notes", delay=AUX_DELAY_S)
        step = min(p.n_tool_results, len(self.STOPS) - 1)
        self.events.append(f"main-{step}")
        if step == 0:
            text = write_call(p, "notes.txt", NOTES)
        elif step == 1:
            text = shell_call(p, "ls -la", "list the workspace")
        elif step == 2:
            text = read_call(p, "notes.txt")
        elif step == 3:
            text = shell_call(p, "wc -l < notes.txt > result.txt", "count lines")
        elif SUBMIT.split()[1] in p.system + p.first_user():
            text = shell_call(p, SUBMIT)  # mini-swe-agent ends on its submit command
        else:
            text = "Done: notes.txt has 3 lines and result.txt holds the count."
        assert text is not None, f"no usable tool among {sorted(p.tools)}"
        ids = list(TOKENIZER.encode(text, add_special_tokens=False))
        return Reply(ids=[*ids, self.STOPS[step]])


# ---------------------------------------------------------------------------------------------
# shapes


def overlaps(records: list[CallRecord]) -> list[list[int]]:
    """Pairs of calls (seqs) that were in flight at the same time."""
    rs = sorted(records, key=lambda r: r.seq)
    return [
        [a.seq, b.seq]
        for i, a in enumerate(rs)
        for b in rs[i + 1 :]
        if b.t_start < a.t_end and a.t_start < b.t_end
    ]


def endoftext_turns(records: list[CallRecord]) -> list[int]:
    """Main calls whose sampled output ended on ``<|endoftext|>``."""
    return [
        r.seq
        for r in records
        if r.label == "main" and r.status == "ok" and unpack_ids(r.output_ids)[-1:] == [ENDOFTEXT]
    ]


def shape_of(records: list[CallRecord]) -> dict[str, Any]:
    """What the records are, and what they assemble into (default options and with side calls
    exported)."""
    done = assemble_detailed(records, result_for(records))
    s = done.sample
    side = assemble_detailed(records, result_for(records), AssembleOptions(export_side_calls=True))
    return {
        "dropped_reason": s.dropped_reason,
        "n_calls": s.counters.n_calls,
        "labels": dict(sorted(Counter(r.label for r in records).items())),
        "statuses": dict(sorted(Counter(r.status for r in records).items())),
        "leaves_per_segment": leaves_per_root(s),
        "n_leaves": s.counters.n_leaves,
        "dropped": dict(s.counters.dropped),
        "retained": list(done.retained),
        "unique_tokens": s.counters.unique_tokens,
        "expanded_tokens": s.counters.expanded_tokens,
        "model_tokens": s.counters.model_tokens,
        "tito_misses": s.counters.tito_misses,
        "false_forks": s.counters.false_forks,
        "side_n_leaves": side.sample.counters.n_leaves,
        "endoftext_turns": endoftext_turns(records),
        "out_of_order": [r.seq for r in records if r.t_end > min_later_end(records, r)],
        "overlapping": overlaps(records),
    }


def min_later_end(records: list[CallRecord], r: CallRecord) -> float:
    """The earliest end among the calls that began after ``r`` (inf when none)."""
    return min((o.t_end for o in records if o.seq > r.seq), default=float("inf"))


def check_chain(records: list[CallRecord], done: Assembly) -> None:
    """Consecutive retained main calls of a segment extend each other exactly."""
    by_seg: dict[Any, list[int]] = {}
    for q in done.retained:
        by_seg.setdefault(done.segments[q], []).append(q)
    for seqs in by_seg.values():
        for a, b in zip(seqs, seqs[1:], strict=False):
            assert extends(records, a, b), f"call {b} does not extend call {a}"


def check_invariants(records: list[CallRecord], shape: dict[str, Any], sc: Scenario) -> None:
    """What any real run of the workspace task must assemble into (the module docstring); the
    ``tito_misses`` counter is checked on its own (``test_workspace_tito_misses``)."""
    assert shape["dropped_reason"] == "", shape["dropped_reason"]  # no bad_delta, no tombstone
    assert shape["false_forks"] == 0
    assert {r.harness for r in records} == {sc.harness}
    assert all(r.harness_version for r in records)
    assert all(r.parent_seq < r.seq for r in records)  # a delta names an earlier call
    labels = Counter(r.label for r in records)
    assert set(labels) <= {"main", "aux"}, labels
    assert labels["main"] >= 4, labels  # several sequential tool-using turns
    assert shape["dropped"] == ({"aux": labels["aux"]} if labels["aux"] else {})
    assert all(r.status == "ok" for r in records)
    main = [r for r in records if r.label == "main"]
    assert shape["retained"] == [r.seq for r in main]  # every turn kept, none superseded
    assert shape["model_tokens"] == sum(len(r.output_ids) // 4 for r in main)
    assert shape["endoftext_turns"], "no turn ended on <|endoftext|>"
    pairs = list(zip(main, main[1:], strict=False))
    if sc.history == "kept":  # one branch: each turn extends the previous one exactly
        assert shape["leaves_per_segment"] == [1]
        for a, b in pairs:
            assert extends(records, a.seq, b.seq), f"call {b.seq} does not extend call {a.seq}"
            assert b.tito_hit and b.parent_seq == a.seq
            assert b.prefix_len == a.input_len + len(a.output_ids) // 4
    else:  # every call its own segment, each one branch; the deltas still share the prefix
        assert shape["leaves_per_segment"] == [1] * len(main)
        for a, b in pairs:
            assert not extends(records, a.seq, b.seq) and not b.tito_hit
            assert b.parent_seq == a.seq and 0 < b.prefix_len <= a.input_len


def check_record_order(records: list[CallRecord]) -> None:
    """Shuffled and duplicated records give the very same sample."""
    want = encode(assemble_detailed(records, result_for(records)).sample)
    rng = random.Random(len(records))
    for _ in range(3):
        mixed = records + rng.sample(records, k=min(3, len(records)))
        rng.shuffle(mixed)
        assert encode(assemble_detailed(mixed, result_for(records)).sample) == want


# ---------------------------------------------------------------------------------------------
# the committed fixtures (no harness needed)

COUNTERS = ("tito_misses", "false_forks")
"""Counters checked by their own tests, not by the recorded shape (a fixed counting bug must
not need a re-recorded fixture)."""


def _fixture(name: str) -> tuple[list[CallRecord], dict[str, Any]]:
    if not (FIXTURES / f"{name}.msgpack").exists():
        pytest.fail(f"fixture {name} is missing: record it with HRL_SAVE_CALL_FIXTURES=1")
    return load_calls(name)


@pytest.mark.unit
def test_every_workspace_fixture_has_a_scenario() -> None:
    assert sorted(p.stem for p in FIXTURES.glob("*_workspace.msgpack")) == NAMES


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_workspace_fixture_assembles_into_expected_shape(name: str) -> None:
    """The recorded calls assemble exactly into the shape recorded beside them, which meets the
    invariants: a sample (no ``bad_delta``), one leaf per segment, zero false forks."""
    records, expected = _fixture(name)
    assert (FIXTURES / f"{name}.msgpack").stat().st_size < MAX_FIXTURE_BYTES
    sc = SCENARIOS[name]
    assert expected["harness"] == sc.harness
    assert {r.harness_version for r in records} == {expected["harness_version"]}
    shape = shape_of(records)
    drop = set(COUNTERS)
    assert {k: v for k, v in shape.items() if k not in drop} == {
        k: v for k, v in expected["shape"].items() if k not in drop
    }
    check_invariants(records, shape, sc)


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_workspace_tito_misses(name: str) -> None:
    """``tito_misses`` is 0 on an unchanged history (and one per call after the first where
    the harness edits it); ``false_forks`` is 0."""
    records, _ = _fixture(name)
    counters = assemble_detailed(records, result_for(records)).sample.counters
    assert counters.false_forks == 0
    assert counters.tito_misses == expected_misses(records, SCENARIOS[name])


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_workspace_fixture_is_one_chain(name: str) -> None:
    """Every delta rebuilds to its hash; each retained call of a segment extends the previous."""
    records, _ = _fixture(name)
    assert len(full_inputs(records)) == len(records)
    check_chain(records, assemble_detailed(records, result_for(records)))


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_workspace_fixture_keeps_endoftext(name: str) -> None:
    """A turn that stopped on ``<|endoftext|>`` keeps it; the next prompt goes on with the
    template's whole turn end (``<|im_end|>\\n``), then the new turns."""
    records, _ = _fixture(name)
    if SCENARIOS[name].history != "kept":
        pytest.skip("the harness rewrites its history: no prompt extends an earlier output")
    full = full_inputs(records)
    by_seq = {r.seq: r for r in records}
    main = [r.seq for r in records if r.label == "main"]
    eot = [q for q in endoftext_turns(records) if q != main[-1]]
    assert eot
    for q in eot:
        nxt = by_seq[main[main.index(q) + 1]]
        path = len(full[q]) + len(by_seq[q].output_ids) // 4
        assert full[nxt.seq][path - 1] == ENDOFTEXT
        tail = RENDERER.decode(full[nxt.seq][path : path + 2])
        assert tail == "<|im_end|>\n", tail


@pytest.mark.unit
@pytest.mark.parametrize("name", NAMES)
def test_workspace_fixture_assembly_ignores_record_order(name: str) -> None:
    """Shuffled and duplicated records give the very same sample."""
    check_record_order(_fixture(name)[0])


@pytest.mark.unit
def test_opencode_title_call_is_aux_and_out_of_order() -> None:
    """opencode's background title request is an ``aux`` call, made first and answered last:
    the main calls that began while it was in flight name no unfinished call as delta parent,
    and it is dropped from the main track."""
    records, _ = _fixture("opencode_workspace")
    (aux,) = [r for r in records if r.label == "aux"]
    main = [r for r in records if r.label == "main"]
    assert aux.seq < main[0].seq and aux.t_end > main[0].t_end  # overlaps, finishes later
    during = [r for r in main if r.t_start < aux.t_end]
    assert len(during) >= 2
    assert all(r.parent_seq != aux.seq for r in during)
    done = assemble_detailed(records, result_for(records))
    assert aux.seq not in done.retained
    assert shape_of(records)["out_of_order"] == [aux.seq]


# ---------------------------------------------------------------------------------------------
# recording (real harnesses)


@pytest.mark.slow
@pytest.mark.harness
@pytest.mark.parametrize("name", NAMES)
async def test_record_workspace(name: str, nats_url: str, run_name: str, tmp_path: Path) -> None:
    """Run the workspace task for real; its records must meet the invariants (saved on
    request)."""
    sc = SCENARIOS[name]
    brain = WorkspaceBrain()
    async with proxy_stack(nats_url, run_name, brain, tmp_path) as st:
        version = get_adapter(sc.harness).installed_version(default_cache_dir()) or ""
        st.recorder.register(st.rollout, sc.harness, version)
        run = await asyncio.wait_for(
            run_harness(sc.harness, st, tmp_path, INSTRUCTION, read=FILES, **sc.run), 280
        )
        records = await st.records()
    assert run.returncode == 0, run.tail()
    assert run.files["notes.txt"] == NOTES.encode(), run.tail()
    assert (run.files["result.txt"] or b"").strip() == b"3", run.tail()
    assert {r.harness_version for r in records} == {version}
    shape = shape_of(records)
    check_invariants(records, shape, sc)
    assert shape["tito_misses"] == expected_misses(records, sc)
    check_chain(records, assemble_detailed(records, result_for(records)))
    check_record_order(records)
    if saving_fixtures():
        meta = {"harness": sc.harness, "harness_version": version, "scenario": name}
        meta |= {"events": brain.events, "run": sc.run}
        meta |= {"history": sc.history, "instruction": INSTRUCTION}
        path = save_calls(name, records, {**meta, "shape": shape})
        assert path.stat().st_size < MAX_FIXTURE_BYTES
