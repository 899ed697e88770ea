"""The prefix tree: hand-built cases with exact shapes, and property tests against a brute-force
reference of the retention rules (``common/tree.py`` module docstring) on random call histories."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from harnessrl.common import records as r
from harnessrl.common.tree import (
    MAIN,
    AssembleOptions,
    assemble,
    assemble_detailed,
    expand,
    join_parts,
    leaves,
    paths,
    split_sample,
)
from tests.helpers.trees import RID, Spec, lcp, logprobs_of, make_calls, result_for

pytestmark = pytest.mark.unit


def node_view(s: r.TreeSample) -> list[tuple[int, list[int], list[int], int]]:
    """(parent, ids, mask, weight_version) per node: the exact shape of a tree."""
    return [
        (
            n.parent,
            r.unpack_ids(n.token_ids).tolist(),
            r.unpack_u8(n.loss_mask).tolist(),
            n.weight_version,
        )
        for n in s.nodes
    ]


# ---------------------------------------------------------------------------------------------
# hand-built cases
# ---------------------------------------------------------------------------------------------

X, A, E, B, F, C = [1, 2, 3], [4, 5], [6], [7, 8], [9], [10]


def test_linear_chain_exact_shape() -> None:
    """call i+1 = input_i + output_i + env: output_i stays model tokens of call i."""
    specs = [
        Spec(X, A, wv=3),
        Spec(X + A + E, B, wv=4),
        Spec(X + A + E + B + F, C, wv=5),
    ]
    s = assemble(make_calls(specs), result_for(3))
    assert node_view(s) == [
        (-1, X, [0, 0, 0], -1),
        (0, A, [1, 1], 3),
        (1, E, [0], -1),
        (2, B, [1, 1], 4),
        (3, F, [0], -1),
        (4, C, [1], 5),
    ]
    assert r.unpack_f32(s.nodes[3].logprobs).tolist() == logprobs_of(1, 2)
    assert r.unpack_f32(s.nodes[2].logprobs).tolist() == [0.0]
    c = s.counters
    assert (c.n_calls, c.n_leaves, c.unique_tokens, c.expanded_tokens, c.model_tokens) == (
        3,
        1,
        10,
        10,
        5,
    )
    assert c.dropped == {} and s.weight_version == 3 and s.reward == 0.75
    assert paths(s) == [[0, 1, 2, 3, 4, 5]]


def test_env_free_continuation_and_version_swap() -> None:
    """input_{i+1} == path_i exactly; a mid-call weight swap records the older version."""
    specs = [Spec(X, A, wv=7), Spec(X + A, B, wv=8)]
    s = assemble(make_calls(specs), result_for(2))
    assert node_view(s) == [(-1, X, [0, 0, 0], -1), (0, A, [1, 1], 7), (1, B, [1, 1], 8)]
    assert s.weight_version == 7


def test_retry_supersedes_unless_extended() -> None:
    """Same input, later seq: the earlier reply is dead unless a later call built on it."""
    used_retry = [Spec(X, A), Spec(X, B), Spec(X + B + E, C)]
    s = assemble(make_calls(used_retry), result_for(3))
    assert [v[1] for v in node_view(s)] == [X, B, E, C]
    assert s.counters.dropped == {"superseded": 1} and s.counters.n_leaves == 1

    used_first = [Spec(X, A), Spec(X, B), Spec(X + A + E, C)]
    s = assemble(make_calls(used_first), result_for(3))
    assert node_view(s) == [
        (-1, X, [0, 0, 0], -1),
        (0, A, [1, 1], 0),
        (1, E, [0], -1),
        (2, C, [1], 0),
        (0, B, [1, 1], 0),
    ]
    assert s.counters.n_leaves == 2 and s.counters.dropped == {}


def test_last_retry_wins() -> None:
    specs = [Spec(X, A), Spec(X, B), Spec(X, C)]
    a = assemble_detailed(make_calls(specs), result_for(3))
    assert a.retained == (2,) and a.sample.counters.dropped == {"superseded": 2}
    assert [v[1] for v in node_view(a.sample)] == [X, C]


def test_fork_shares_prefix_once() -> None:
    specs = [Spec(X, A), Spec(X + A + E, B), Spec(X + A + F, C)]
    s = assemble(make_calls(specs), result_for(3))
    assert node_view(s) == [
        (-1, X, [0, 0, 0], -1),
        (0, A, [1, 1], 0),
        (1, E, [0], -1),
        (2, B, [1, 1], 0),
        (1, F, [0], -1),
        (4, C, [1], 0),
    ]
    assert s.counters.unique_tokens == 10 and s.counters.expanded_tokens == 8 + 7


def test_compaction_starts_a_new_root() -> None:
    """A main call extending no earlier main input opens a segment: its own root, same reward."""
    summary = [1, 11, 12]  # shares the "system" token 1 with X, but is a new root
    specs = [
        Spec(X, A),
        Spec(X + A + E, B),
        Spec(X + A + E + B + [13], [14], label="compaction"),
        Spec(summary, C),
        Spec(summary + C + E, F),
    ]
    a = assemble_detailed(make_calls(specs), result_for(5))
    s = a.sample
    roots = [i for i, n in enumerate(s.nodes) if n.parent == -1]
    assert len(roots) == 2 and s.counters.n_leaves == 2
    assert [b.token_ids.tolist() for b in expand(s)] == [X + A + E + B, summary + C + E + F]
    assert s.counters.dropped == {"compaction": 1}
    assert a.segments[3] == a.segments[4] == ("main", 3) and a.segments[1] == ("main", 0)


def test_side_calls_dropped_or_exported() -> None:
    specs = [
        Spec(X, A),
        Spec([20, 21], [22], label="aux"),
        Spec([30], [31], label="subagent"),
        Spec([30, 31, 32], [33], label="subagent"),
        Spec(X + A + E, B),
    ]
    s = assemble(make_calls(specs), result_for(5))
    assert s.counters.dropped == {"aux": 1, "subagent": 2}
    assert [b.token_ids.tolist() for b in expand(s)] == [X + A + E + B]
    s = assemble(make_calls(specs), result_for(5), AssembleOptions(export_side_calls=True))
    assert s.counters.dropped == {}
    branches = [b.token_ids.tolist() for b in expand(s)]
    assert branches == [X + A + E + B, [20, 21, 22], [30, 31, 32, 33]]  # main first


def test_error_aborted_and_empty_calls_dropped() -> None:
    specs = [
        Spec(X, [], status="error"),
        Spec(X, A, status="aborted"),
        Spec(X, B, finish="abort"),
        Spec(X, [], finish="length"),
        Spec(X, C),
    ]
    s = assemble(make_calls(specs), result_for(5))
    assert s.counters.dropped == {"aborted": 2, "empty_output": 1, "error": 1}
    assert [v[1] for v in node_view(s)] == [X, C]


def test_dropped_output_recontained_is_environment() -> None:
    """An aborted reply the harness kept anyway: its tokens are context for the next call."""
    specs = [Spec(X, A, status="aborted"), Spec(X + A + E, B)]
    s = assemble(make_calls(specs), result_for(2))
    assert node_view(s) == [(-1, X + A + E, [0] * 6, -1), (0, B, [1, 1], 0)]


def test_partial_reuse_is_a_fork() -> None:
    """The harness re-rendered the tail of reply A: A keeps its leaf, the next call forks."""
    specs = [Spec(X, A + [5, 5]), Spec(X + A + E, B)]
    s = assemble(make_calls(specs, mode="lcp"), result_for(2))
    assert node_view(s) == [
        (-1, X, [0, 0, 0], -1),
        (0, A, [1, 1], 0),
        (1, [5, 5], [1, 1], 0),
        (1, E, [0], -1),
        (3, B, [1, 1], 0),
    ]


def test_false_forks_and_tito_misses_are_counted_apart() -> None:
    """A call that rewrites part of its parent's sampled output is a false fork (not a miss);
    a failed call is neither a miss nor the first call; a linear chain has neither."""
    partial = [Spec(X, A + [5, 5]), Spec(X + A + E, B)]
    c = assemble(make_calls(partial, mode="lcp"), result_for(2)).counters
    assert (c.false_forks, c.tito_misses, c.n_leaves) == (1, 0, 2)
    linear = [Spec(X, A), Spec(X + A + E, B), Spec(X + A + E + B + E, C)]
    c = assemble(make_calls(linear), result_for(3)).counters
    assert (c.false_forks, c.tito_misses, c.n_leaves) == (0, 0, 1)
    failed_first = [Spec(X, [], status="error", tito=False), Spec(X, A, tito=False)]
    failed_first += [Spec(X + A + E, B, tito=False)]
    c = assemble(make_calls(failed_first), result_for(3)).counters
    assert (c.false_forks, c.tito_misses) == (0, 1)  # only the third call re-rendered
    retry = [Spec(X, A), Spec(X, B)]  # same prompt sampled again: a real fork
    assert assemble(make_calls(retry), result_for(2)).counters.false_forks == 0
    title_first = [Spec([9, 9], [9], label="aux", tito=False), Spec(X, A, tito=False)]
    c = assemble(make_calls(title_first, mode="full"), result_for(2)).counters
    assert c.tito_misses == 0  # the first main call is its track's first, not a miss


def test_truncated_calls_are_counted() -> None:
    """Successful replies cut off at the token limit are counted, retained or not; a failed
    call's finish reason is not the model's."""
    specs = [
        Spec(X, A, finish="length"),
        Spec(X + A + E, B),
        Spec(X + A + E + B + E, C, finish="length"),
        Spec(X + A + E + B + E + C + E, [], status="error", finish="length"),
    ]
    s = assemble(make_calls(specs), result_for(4))
    assert s.counters.truncated_calls == 2
    assert assemble(make_calls(specs[1:2]), result_for(1)).counters.truncated_calls == 0


def test_drop_truncated_keeps_cut_off_replies_as_context_only() -> None:
    """With ``drop_truncated`` a reply cut off at the token limit is not trained: continued
    from, its tokens are the next call's context (mask 0); a truncated leaf disappears."""
    specs = [
        Spec(X, A, finish="length"),
        Spec(X + A + E, B),
        Spec(X + A + E + B + E, C, finish="length"),
    ]
    opts = AssembleOptions(drop_truncated=True)
    s = assemble(make_calls(specs), result_for(3), opts)
    assert node_view(s) == [(-1, X + A + E, [0] * 6, -1), (0, B, [1, 1], 0)]
    assert s.counters.dropped == {"truncated": 2} and s.counters.truncated_calls == 2
    kept = assemble(make_calls(specs), result_for(3))
    assert kept.counters.dropped == {} and kept.counters.model_tokens == len(A + B + C)
    only = assemble(make_calls(specs[:1]), result_for(1), opts)
    assert only.is_tombstone and only.dropped_reason == "no_model_tokens"


def test_continuation_credits_earliest_generator() -> None:
    """A later call prefilled with part of an earlier reply: shared tokens keep the first call's
    log-probs; only the new tail belongs to the continuation."""
    specs = [Spec(X, [4, 5, 6], wv=1), Spec(X + [4, 5], [6, 7], wv=2), Spec(X + [4, 5, 6, 7], C)]
    s = assemble(make_calls(specs), result_for(3))
    assert node_view(s)[:3] == [
        (-1, X, [0, 0, 0], -1),
        (0, [4, 5, 6], [1, 1, 1], 1),
        (1, [7], [1], 2),
    ]
    assert r.unpack_f32(s.nodes[1].logprobs).tolist() == logprobs_of(0, 3)
    assert r.unpack_f32(s.nodes[2].logprobs).tolist() == logprobs_of(1, 2)[1:]


def test_non_longest_parent_gives_same_tree() -> None:
    specs = [Spec(X, A), Spec(X + A + E, B), Spec(X + A + E + B + F, C)]
    want = r.encode(assemble(make_calls(specs), result_for(3)))
    for mode in ("full", "lcp", "random"):
        for seed in range(5):
            got = assemble(make_calls(specs, mode, seed), result_for(3))
            assert r.encode(got) == want, (mode, seed)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("status", "rollout_timeout"),
        ("none", "no_calls"),
        ("missing", "missing_calls"),
        ("hash", "bad_delta"),
        ("parent", "bad_delta"),
        ("prefix", "bad_delta"),
        ("logprobs", "bad_record"),
        ("conflict", "bad_record"),
        ("nothing_kept", "no_model_tokens"),
        ("branches", "too_many_branches"),
    ],
)
def test_tombstones(case: str, reason: str) -> None:
    specs = [Spec(X, A), Spec(X + A + E, B), Spec(X + A + F, C)]
    calls = make_calls(specs)
    res = result_for(3)
    opts = AssembleOptions()
    if case == "status":
        res = result_for(3, status="timeout")
    elif case == "none":
        calls, res = [], result_for(0)
    elif case == "missing":
        calls = calls[:2]
    elif case == "hash":
        calls[1].input_hash = r.ids_hash([0])
    elif case == "parent":
        calls[2].parent_seq = 7
    elif case == "prefix":
        calls[2].prefix_len += 1
    elif case == "logprobs":
        calls[1].output_logprobs = b""
    elif case == "conflict":
        calls.append(msgspec.structs.replace(calls[1], finish_reason="length"))
    elif case == "nothing_kept":
        for c in calls:
            c.status = "error"
    elif case == "branches":
        opts = AssembleOptions(max_branches=1)
    s = assemble(calls, res, opts)
    assert s.is_tombstone and s.dropped_reason == reason
    assert s.rollout_id == RID and s.reward == res.reward and s.msg_id() == f"sample:{RID}"


def test_foreign_and_duplicate_records_ignored() -> None:
    specs = [Spec(X, A), Spec(X + A + E, B)]
    calls = make_calls(specs)
    other = make_calls([Spec([99], [98])], rid="h-0-1")
    s = assemble(calls + calls[::-1] + other, result_for(2))
    assert r.encode(s) == r.encode(assemble(calls, result_for(2)))


def test_split_and_join_roundtrip() -> None:
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 50_000, 3000).tolist()
    specs = []
    for i in range(6):
        out = rng.integers(0, 50_000, 2000).tolist()
        specs.append(Spec(ctx, out, wv=i))
        ctx = ctx + out + rng.integers(0, 50_000, 1000).tolist()
    specs.append(Spec(specs[2].inp, rng.integers(0, 50_000, 1500).tolist()))  # late regen: kept
    specs.append(Spec(specs[3].path + [1], [2]))  # a fork
    s = assemble(make_calls(specs), result_for(len(specs)))
    parts = split_sample(s, 64 * 1024)
    assert len(parts) > 3 and all(len(r.encode(p)) <= 64 * 1024 for p in parts)
    assert [p.msg_id() for p in parts] == [f"sample:{RID}:{i}" for i in range(len(parts))]
    offset = 0
    for p in parts:  # parents always point at earlier global indices
        assert all(n.parent < offset + i for i, n in enumerate(p.nodes))
        offset += len(p.nodes)
    joined = join_parts(reversed(parts))
    assert joined.n_parts == 1 and joined.counters == s.counters
    want, got = expand(s), expand(joined)
    assert len(want) == len(got) == s.counters.n_leaves == 3
    for w, g in zip(want, got, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(w, g, strict=True))
    assert split_sample(s, 64 * 1024 * 1024) == [s]
    with pytest.raises(ValueError):
        join_parts(parts[1:])


# ---------------------------------------------------------------------------------------------
# brute-force reference of the retention rules
# ---------------------------------------------------------------------------------------------


def is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


def reference(specs: list[Spec], opts: AssembleOptions):
    """(retained seqs, segment by seq, dropped Counter), straight from the definitions."""
    n = len(specs)
    track = [s.label if s.label == MAIN or opts.export_side_calls else None for s in specs]
    dropped: Counter[str] = Counter()
    cand = []
    for j, s in enumerate(specs):
        if track[j] is None:
            dropped[s.label] += 1
        elif s.status == "error":
            dropped["error"] += 1
        elif s.status == "aborted" or s.finish == "abort":
            dropped["aborted"] += 1
        elif not s.out:
            dropped["empty_output"] += 1
        else:
            cand.append(j)
    seg: dict[int, tuple[str, int]] = {}
    for j in range(n):
        if track[j] is None:
            continue
        prior = [
            i for i in range(j) if track[i] == track[j] and is_prefix(specs[i].inp, specs[j].inp)
        ]
        if not prior:
            seg[j] = (track[j], j)  # type: ignore[assignment]
        else:
            seg[j] = seg[max(prior, key=lambda i: (len(specs[i].inp), i))]
    kept: set[int] = set()
    for a in sorted(cand, reverse=True):
        extended = any(
            b > a and seg[b] == seg[a] and is_prefix(specs[a].path, specs[b].inp) for b in kept
        )
        later_same = any(b > a and seg[b] == seg[a] and specs[b].inp == specs[a].inp for b in cand)
        if later_same and not extended:
            dropped["superseded"] += 1
        else:
            kept.add(a)
    return sorted(kept), seg, dropped


def check_against_reference(specs: list[Spec], sample: r.TreeSample, opts: AssembleOptions):
    kept, seg, dropped = reference(specs, opts)
    assert sample.counters.dropped == dict(dropped)
    if not kept:
        assert sample.dropped_reason == "no_model_tokens"
        return
    order = sorted({seg[j] for j in kept}, key=lambda s: (s[0] != MAIN, s[1]))
    members = {s: [j for j in kept if seg[j] == s] for s in order}
    want_leaves = sum(
        len({tuple(specs[j].path) for j in ms})
        - len(
            {
                tuple(specs[j].path)
                for j in ms
                if any(
                    len(specs[k].path) > len(specs[j].path)
                    and is_prefix(specs[j].path, specs[k].path)
                    for k in ms
                )
            }
        )
        for ms in members.values()
    )
    if want_leaves > opts.max_branches:
        assert sample.dropped_reason == "too_many_branches"
        return
    assert not sample.is_tombstone, sample.dropped_reason
    nodes = sample.nodes
    roots = [i for i, nd in enumerate(nodes) if nd.parent == -1]
    assert len(roots) == len(order)  # one root per segment with retained calls
    # trie: nodes non-empty, arrays consistent, siblings differ in their first token
    firsts: dict[int, set[int]] = {}
    for i, nd in enumerate(nodes):
        ids = r.unpack_ids(nd.token_ids)
        assert len(ids) > 0 and nd.parent < i
        assert len(nd.logprobs) == 4 * len(ids) and len(nd.loss_mask) == len(ids)
        sib = firsts.setdefault(nd.parent, set())
        if nd.parent >= 0:
            assert int(ids[0]) not in sib
        sib.add(int(ids[0]))
        mask = r.unpack_u8(nd.loss_mask)
        assert mask.min() == mask.max() == (1 if nd.weight_version >= 0 else 0)
    root_of = []
    for i, nd in enumerate(nodes):
        root_of.append(i if nd.parent == -1 else root_of[nd.parent])
    branches = expand(sample)
    unique = 0
    for s, root in zip(order, roots, strict=True):
        ms = members[s]
        got = [b for b, p in zip(branches, paths(sample), strict=True) if root_of[p[0]] == root]
        maximal = {
            tuple(specs[j].path)
            for j in ms
            if not any(
                len(specs[k].path) > len(specs[j].path) and is_prefix(specs[j].path, specs[k].path)
                for k in ms
            )
        }
        assert sorted(tuple(b.token_ids.tolist()) for b in got) == sorted(maximal)
        prefixes = {tuple(specs[j].path[:t]) for j in ms for t in range(1, len(specs[j].path) + 1)}
        unique += len(prefixes)  # every retained token in exactly one node
        for b in got:
            ids = b.token_ids.tolist()
            for t in range(1, len(ids) + 1):
                gen = [
                    j
                    for j in ms
                    if len(specs[j].inp) < t <= len(specs[j].path) and specs[j].path[:t] == ids[:t]
                ]
                assert b.loss_mask[t - 1] == (1 if gen else 0)
                want_lp = (
                    logprobs_of(gen[0], len(specs[gen[0]].out))[t - 1 - len(specs[gen[0]].inp)]
                    if gen
                    else 0.0
                )
                assert b.logprobs[t - 1] == np.float32(want_lp)
    c = sample.counters
    assert c.unique_tokens == unique == sum(len(nd.token_ids) // 4 for nd in nodes)
    assert c.n_leaves == len(branches) == want_leaves == len(leaves(sample))
    assert c.expanded_tokens == sum(len(b.token_ids) for b in branches)
    assert c.model_tokens == sum(int(b.sum()) for b in (r.unpack_u8(nd.loss_mask) for nd in nodes))
    versions = [nd.weight_version for nd in nodes if nd.weight_version >= 0]
    assert sample.weight_version == min(versions)


# ---------------------------------------------------------------------------------------------
# random histories
# ---------------------------------------------------------------------------------------------

KINDS = ["next"] * 4 + ["retry", "same", "fork", "prefill", "compact", "side", "side"]


@st.composite
def histories(draw, max_calls: int = 12) -> list[Spec]:
    """A harness-like history over a 4-token alphabet (so accidental shared prefixes abound):
    linear turns, retries, identical regenerations, forks, continuations, compactions, side
    calls, errors and aborts."""
    tokens = st.integers(0, 3)

    def run(lo: int, hi: int) -> list[int]:
        return draw(st.lists(tokens, min_size=lo, max_size=hi))

    ctx = run(1, 3)
    specs: list[Spec] = []
    mains: list[int] = []
    for _ in range(draw(st.integers(1, max_calls))):
        kind = draw(st.sampled_from(KINDS))
        if kind in ("retry", "same", "fork", "prefill") and not mains:
            kind = "next"
        label, out = "main", (run(1, 3) if draw(st.integers(0, 5)) else [])
        if kind == "next":
            inp = ctx
        elif kind in ("retry", "same", "prefill"):
            p = specs[draw(st.sampled_from(mains))]
            inp = p.inp
            if kind == "same":
                out = list(p.out)
            elif kind == "prefill":
                inp = p.inp + p.out[: draw(st.integers(0, len(p.out)))]
        elif kind == "fork":
            p = specs[draw(st.sampled_from(mains))]
            inp = p.path + run(0, 2)
        elif kind == "compact":
            inp = ctx[:1] + run(1, 3)
        else:
            label = draw(st.sampled_from(["subagent", "compaction", "aux"]))
            inp = draw(st.sampled_from([ctx + run(0, 2), run(1, 3)]))
        status, finish = draw(
            st.sampled_from(
                [("ok", "stop")] * 9
                + [("ok", "length"), ("error", ""), ("aborted", "abort"), ("ok", "abort")]
            )
        )
        if status == "error":
            out = []
        spec = Spec(
            inp, out, label, status, finish, wv=draw(st.integers(0, 3)), tito=draw(st.booleans())
        )
        specs.append(spec)
        if label == MAIN:
            mains.append(len(specs) - 1)
            if draw(st.booleans()):
                ctx = spec.path + run(0, 2)
    return specs


PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_false_forks(specs: list[Spec]) -> int:
    """The definition on full inputs: a successful call keeping some but not all of the output
    of its turn parent (the earlier successful call with the longest proper-prefix input)."""
    forks = 0
    for j, c in enumerate(specs):
        if c.status != "ok":
            continue
        earlier = [p for p in specs[:j] if p.status == "ok" and len(p.inp) < len(c.inp)]
        prefixes = [p for p in earlier if c.inp[: len(p.inp)] == p.inp]
        if not prefixes:
            continue
        p = max(prefixes, key=lambda p: len(p.inp))  # ties: the earliest (max keeps the first)
        shared = lcp(c.inp[len(p.inp) :], p.out)
        forks += 0 < shared < len(p.out)
    return forks


@PROPS
@given(histories(), st.sampled_from(["tito", "lcp", "random", "full"]), st.integers(0, 9))
def test_false_forks_match_the_definition(specs: list[Spec], mode: str, seed: int) -> None:
    """``false_forks`` is the definition's count, whatever delta encoding was chosen."""
    s = assemble(make_calls(specs, mode, seed), result_for(len(specs)))
    assume(not s.dropped_reason)
    assert s.counters.false_forks == reference_false_forks(specs)


@PROPS
@given(
    histories(),
    st.sampled_from(["tito", "lcp", "random", "full"]),
    st.booleans(),
    st.integers(0, 9),
)
def test_matches_reference(specs: list[Spec], mode: str, export: bool, seed: int) -> None:
    """Retained calls, drops, trie shape, branches, masks and log-probs match the definitions,
    whatever (valid) delta encoding the proxy chose."""
    opts = AssembleOptions(export_side_calls=export, max_branches=1000)
    a = assemble_detailed(make_calls(specs, mode, seed), result_for(len(specs)), opts)
    kept, seg, _ = reference(specs, opts)
    assert list(a.retained) == kept
    assert a.segments == seg
    check_against_reference(specs, a.sample, opts)


@PROPS
@given(histories(), st.randoms(use_true_random=False), st.sampled_from(["tito", "lcp", "random"]))
def test_any_order_and_encoding_same_tree(specs: list[Spec], rnd: random.Random, mode: str) -> None:
    """Shuffled, duplicated records and another delta encoding give byte-identical samples."""
    res = result_for(len(specs))
    want = r.encode(assemble(make_calls(specs), res))
    calls = make_calls(specs, mode, rnd.randrange(100))
    calls = calls + rnd.sample(calls, k=rnd.randint(0, len(calls)))
    rnd.shuffle(calls)
    assert r.encode(assemble(calls, res)) == want


@PROPS
@given(histories(), st.data())
def test_bad_delta_is_a_tombstone(specs: list[Spec], data: st.DataObject) -> None:
    calls = make_calls(specs, "lcp")
    j = data.draw(st.integers(0, len(calls) - 1))
    how = data.draw(st.sampled_from(["hash", "parent", "len", "suffix"]))
    c = calls[j]
    if how == "hash":
        c.input_hash = bytes(16)
    elif how == "parent":
        c.parent_seq = len(calls) + 3
    elif how == "len":
        c.input_len += 1
    elif c.suffix_ids:
        ids = r.unpack_ids(c.suffix_ids).copy()
        ids[-1] += 1
        c.suffix_ids = r.pack_ids(ids)
    else:
        c.prefix_len += 1
    s = assemble(calls, result_for(len(calls)))
    assert s.is_tombstone and s.dropped_reason == "bad_delta"


@PROPS
@given(histories())
def test_max_branches(specs: list[Spec]) -> None:
    res = result_for(len(specs))
    full = assemble(make_calls(specs), res, AssembleOptions(max_branches=1000))
    if full.is_tombstone:
        return
    n = full.counters.n_leaves
    same = assemble(make_calls(specs), res, AssembleOptions(max_branches=n))
    assert r.encode(same) == r.encode(full)
    over = assemble(make_calls(specs), res, AssembleOptions(max_branches=n - 1))
    assert over.dropped_reason == "too_many_branches"


@settings(max_examples=40, deadline=None)
@given(histories(max_calls=20), st.integers(4, 40))
def test_split_preserves_expansion(specs: list[Spec], kib: int) -> None:
    s = assemble(make_calls(specs), result_for(len(specs)))
    if s.is_tombstone:
        return
    big = msgspec.structs.replace(s, metrics={"pad": 1.0})
    parts = split_sample(big, kib * 1024)
    joined = join_parts(parts)
    for w, g in zip(expand(big), expand(joined), strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(w, g, strict=True))
