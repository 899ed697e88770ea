"""A rollout's CallRecords rebuilt into one token-level prefix tree, filtered into a TreeSample.

Building (``assemble``):

1. **Rebuild and verify.** Calls are de-duplicated by ``seq`` and taken in ``seq`` order, whatever
   order they arrived in. Each call's input is rebuilt from its delta,
   ``full = (input_p + output_p)[:prefix_len] + suffix`` (``parent_seq == -1``: the suffix is the
   whole input), and checked against ``input_len`` and ``input_hash``. A parent that is missing or
   not earlier, a ``prefix_len`` outside the parent's tokens, a length or hash mismatch: the whole
   rollout is dropped as ``bad_delta``. Malformed arrays (ids not a multiple of 4 bytes, log-probs
   not one per output token) or two *different* records claiming one ``seq``: ``bad_record``.
2. **One radix tree of every call.** Every call (all labels and statuses) is inserted into one
   token trie: its input, then its output below it. A trie has one path per token sequence, so a
   call lands at the node whose accumulated tokens are the longest prefix of its input whichever
   parent its delta names — a delta only tells us where to *start walking* (the parent's
   position at depth ``prefix_len``), which keeps the cost linear in the rollout's unique tokens
   (plus the suffix bytes each call carries) instead of calls x context: no call is compared with
   all earlier ones, and the hash of the shared prefix is resumed from the parent's saved blake2b
   state (kept at the end of its input and of its output; a delta sharing any other length of
   its parent costs one re-hash of that prefix). Node boundaries fall at branch points and at every call's input end and output end, so
   "the end of call c's input" and "the end of its output" are always ends of nodes.
3. **Filter** (pure functions below, every drop counted by reason in ``TreeCounters.dropped``).
4. **Emit** the retained part of the tree, one root per segment (below).

Definitions the filters use (``path(c) = input(c) + output(c)``):

* **track**: ``main`` calls form the main track. ``subagent``/``compaction``/``aux`` calls are
  dropped with their label as the reason, unless ``export_side_calls`` is on: then each label is a
  track of its own, filtered exactly like ``main``, and exported as extra roots of the *same*
  sample (a separate sample per side conversation would break the learner's invariant that every
  issued rollout ends as exactly one sample or tombstone).
* **candidate**: a call of a track with ``status == "ok"``, ``finish_reason != "abort"`` and at
  least one output token; otherwise dropped as ``error``, ``aborted`` or ``empty_output``. With
  ``drop_truncated``, a reply cut off at the token limit (``finish_reason == "length"``) is
  dropped too (``truncated``; DAPO's overlong filtering, per reply).
* **segment**: a call whose input has no earlier call *of its track* (any status) as a prefix is
  a compaction point / new root and starts a segment; any other call joins the segment of the
  earlier same-track call with the longest such input. Segments are separate trees (roots)
  even when they share a system prompt; all share the rollout's reward and count as one rollout.
* **extended**: call A is extended when a *retained* call B of the same segment with
  ``B.seq > A.seq`` has ``path(A)`` as a prefix of ``input(B)`` (the harness continued from A's
  whole reply).
* **superseded** (a dead leaf): candidate A is dropped as ``superseded`` when a later candidate
  has exactly the same input (a retry or regeneration from the same prefix) and A is not extended.
  Decided in decreasing ``seq`` order, so "retained" in *extended* is already known. The last
  successful call for a given input is therefore always retained, and an earlier one survives
  only if the harness built on it.
* **retained**: every candidate not superseded. Segments keep their longest continuation: a
  compaction never makes the pre-compaction segment's last call dead, since supersession is only
  by a call with the very same input.
* **tree of a segment**: the trie of the paths of its retained calls. A token is a *model* token
  (loss mask 1) when its position lies in the output of a retained call of that segment; it then
  carries the log-prob and weight version of the earliest such call (a later call whose input
  re-contains the tokens — the normal ``input_{i+1} = input_i + output_i + env`` — does not
  change them; nor does a later continuation that regenerated the same tokens). All other tokens
  are *environment* tokens (mask 0, log-prob 0).
* **dropped outputs re-contained**: when a later retained call's input contains tokens that a
  dropped call generated (an aborted partial reply the harness kept, an errored call, a
  side-track answer pasted back), those tokens are environment tokens: we never train on the
  output of a call we dropped, and for the later call they were just context. Tokens only count
  as "the same" at the same position after the same prefix: a sub-agent's answer quoted inside a
  tool result is a different position and is environment anyway. A reply only partly re-used (the
  harness re-rendered its tail differently) is not *extended*: its remaining tokens form a leaf.
* **leaf** / **branch**: a node with no children / a root-to-leaf path. Every leaf ends some
  retained call's ``path``; a retained call whose path is a prefix of another retained path is
  not a leaf. A rollout whose leaves (all segments, all tracks) exceed ``max_branches`` is dropped
  whole as ``too_many_branches``.

Node layout: nodes are emitted per segment in depth-first pre-order with children sorted by
first token (so parents precede children and the output depends only on the retained calls),
each node a maximal run of tokens without a branch point that is either all environment or all
model tokens of one call (one weight version per node). Every retained token belongs to exactly
one node, so a prefix shared by several branches is stored and trained once.

Sample-level outcomes (tombstones, checked in this order): ``rollout_<status>`` for a failed
rollout, ``no_calls``, ``missing_calls`` (a seq below ``result.n_calls`` is absent),
``bad_record``, ``bad_delta``, ``no_model_tokens`` (nothing retained), ``mixed_sampling``
(retained calls sampled with different temperature, top_p or top_k), ``too_many_branches``.
The sample's ``weight_version`` is the oldest among its model nodes (a call's version is its
``weight_version_start``, the older one when the engine swapped weights mid-call). Counters:
``n_calls`` distinct calls of this rollout read (records of other rollouts are ignored),
``tito_misses`` successful calls after the first successful one of their label with
``tito_hit`` false,
``false_forks`` calls that kept part but not all of their turn parent's sampled output (see
``_false_forks``), ``unique_tokens`` tokens in the
nodes, ``expanded_tokens`` the sum of branch lengths, ``model_tokens`` tokens with mask 1.

Large samples are split by nodes (``split_sample``): parts are consecutive slices of the node
list in part order; ``TreeNode.parent`` always indexes the *concatenation* of all parts' nodes,
so a part's first node has global index ``sum(len(p.nodes) for earlier parts)``; every part
carries the full metadata and counters. ``join_parts`` restores the sample.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np

from harnessrl.common.records import (
    CallRecord,
    RolloutResult,
    SamplingParams,
    TreeCounters,
    TreeNode,
    TreeSample,
    encode,
    unpack_f32,
    unpack_ids,
    unpack_u8,
)

__all__ = [
    "MAIN",
    "AssembleOptions",
    "Assembly",
    "Branch",
    "RadixTree",
    "assemble",
    "assemble_detailed",
    "assign_segments",
    "drop_reason",
    "drop_superseded",
    "expand",
    "join_parts",
    "leaves",
    "paths",
    "split_sample",
    "tombstone",
    "track_of",
]

MAIN = "main"
_EMPTY_IDS = np.zeros(0, dtype="<i4")


@dataclass(frozen=True)
class AssembleOptions:
    """Knobs of ``assemble`` (the service fills them from its config)."""

    max_branches: int = 64
    """Drop a rollout whose retained leaves exceed this (``too_many_branches``)."""
    export_side_calls: bool = False
    """Keep ``subagent``/``compaction``/``aux`` calls as extra roots instead of dropping them."""
    drop_truncated: bool = False
    """Drop calls whose reply ran into the token limit (``truncated``): their tokens are not
    trained; where a later call continued from one, they are its context (loss mask 0)."""


class _Reject(Exception):
    """The whole rollout is unusable; ``reason`` becomes the tombstone's ``dropped_reason``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# the radix tree
# ---------------------------------------------------------------------------------------------


class _Node:
    """A run of tokens with one parent; ``depth`` is the path length before its first token."""

    __slots__ = ("children", "depth", "parent", "tokens")

    def __init__(self, tokens: np.ndarray, depth: int, parent: _Node | None) -> None:
        self.tokens = tokens
        self.depth = depth
        self.parent = parent
        self.children: dict[int, _Node] = {}

    @property
    def end(self) -> int:
        """Path length at this node's last token."""
        return self.depth + len(self.tokens)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RadixTree:
    """A token trie whose positions are referred to by node *ends* only.

    Splitting a node keeps the lower half in the original object, so a reference to "the end of
    node N" stays valid for ever; that is why callers only ever hold node ends.
    """

    def __init__(self) -> None:
        self.root = _Node(_EMPTY_IDS, 0, None)
        self.nodes: list[_Node] = []

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    def release(self) -> None:
        """Break the parent/child reference cycles so the tree is freed at once, not by the GC."""
        for node in self.nodes:
            node.parent = None
            node.children = {}
        self.root.children = {}
        self.nodes = []

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; return the new upper node (``node`` keeps the rest)."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.tokens)
        top = _Node(node.tokens[:at], node.depth, parent)
        parent.children[int(top.tokens[0])] = top
        node.tokens = node.tokens[at:]
        node.depth += at
        node.parent = top
        top.children[int(node.tokens[0])] = node
        self.nodes.append(top)
        return top

    def locate(self, end_node: _Node, depth: int) -> _Node:
        """The node ending at ``depth`` on the path to ``end_node`` (splitting one if needed)."""
        node = end_node
        while node.parent is not None and depth <= node.depth:
            node = node.parent
        if depth == node.end:
            return node
        return self._split(node, depth - node.depth)

    def insert(self, start: _Node, ids: np.ndarray) -> _Node:
        """Walk/extend the trie with ``ids`` below the end of ``start``; return the end node."""
        node, i, n = start, 0, len(ids)
        while i < n:
            child = node.children.get(int(ids[i]))
            if child is None:
                leaf = _Node(ids[i:], node.end, node)
                node.children[int(ids[i])] = leaf
                self.nodes.append(leaf)
                return leaf
            m = _common_prefix(child.tokens, ids[i:])
            if m < len(child.tokens):
                child = self._split(child, m)
            node, i = child, i + m
        return node

    @staticmethod
    def path_ids(node: _Node) -> np.ndarray:
        """Tokens from the root to the end of ``node``."""
        parts = []
        while node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else _EMPTY_IDS


# ---------------------------------------------------------------------------------------------
# step 1+2: rebuild every call into the tree, verifying deltas
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Call:
    """A verified call and where it sits in the tree."""

    rec: CallRecord
    out_ids: np.ndarray
    out_lp: np.ndarray
    in_end: _Node
    out_end: _Node
    h_in: Any = field(repr=False)
    h_out: Any = field(repr=False)

    @property
    def seq(self) -> int:
        return self.rec.seq

    @property
    def input_len(self) -> int:
        return self.in_end.end

    @property
    def weight_version(self) -> int:
        v = self.rec.weight_version_start
        return v if v >= 0 else self.rec.weight_version_end


def _ids(data: bytes, what: str, seq: int) -> np.ndarray:
    if len(data) % 4:
        raise _Reject("bad_record", f"call {seq}: {what} is {len(data)} bytes, not int32s")
    return unpack_ids(data)


def _hasher(data: bytes = b"") -> Any:
    return hashlib.blake2b(data, digest_size=16)


def _dedupe(calls: Iterable[CallRecord]) -> list[CallRecord]:
    """Calls sorted by seq, one per seq (identical duplicates collapse; conflicting: bad_record)."""
    by_seq: dict[int, CallRecord] = {}
    for c in calls:
        old = by_seq.setdefault(c.seq, c)
        if old is not c and old != c:
            raise _Reject("bad_record", f"two different records claim seq {c.seq}")
    return [by_seq[s] for s in sorted(by_seq)]


def _rebuild(tree: RadixTree, calls: list[CallRecord]) -> list[_Call]:
    """Insert every call (seq order) into ``tree``, verifying each delta; raise ``_Reject``."""
    built: dict[int, _Call] = {}
    for rec in calls:
        seq = rec.seq
        suffix = _ids(rec.suffix_ids, "suffix_ids", seq)
        out = _ids(rec.output_ids, "output_ids", seq)
        if len(rec.output_logprobs) != 4 * len(out):
            raise _Reject("bad_record", f"call {seq}: logprobs do not match output_ids")
        start, h = _delta_start(tree, built, rec)
        if rec.prefix_len + len(suffix) != rec.input_len:
            raise _Reject("bad_delta", f"call {seq}: rebuilt length != input_len {rec.input_len}")
        h.update(rec.suffix_ids)
        if h.digest() != rec.input_hash:
            raise _Reject("bad_delta", f"call {seq}: rebuilt input does not match input_hash")
        in_end = tree.insert(start, suffix)
        out_end = tree.insert(in_end, out)
        h_out = h.copy()
        h_out.update(rec.output_ids)
        built[seq] = _Call(rec, out, unpack_f32(rec.output_logprobs), in_end, out_end, h, h_out)
    return list(built.values())


def _delta_start(tree: RadixTree, built: dict[int, _Call], rec: CallRecord) -> tuple[_Node, Any]:
    """Tree position after the delta's shared prefix, and the blake2b state of that prefix."""
    if rec.parent_seq == -1:
        if rec.prefix_len != 0:
            raise _Reject("bad_delta", f"call {rec.seq}: prefix_len without a parent")
        return tree.root, _hasher()
    parent = built.get(rec.parent_seq)
    if parent is None or rec.parent_seq >= rec.seq:
        raise _Reject("bad_delta", f"call {rec.seq}: parent {rec.parent_seq} is missing")
    plen = rec.prefix_len
    if not 0 <= plen <= parent.out_end.end:
        raise _Reject("bad_delta", f"call {rec.seq}: prefix_len {plen} beyond its parent")
    start = tree.locate(parent.out_end, plen)
    if plen == parent.out_end.end:
        return start, parent.h_out.copy()
    if plen == parent.input_len:
        return start, parent.h_in.copy()
    return start, _hasher(RadixTree.path_ids(start).tobytes())


# ---------------------------------------------------------------------------------------------
# step 3: filters (pure: inputs in, decisions + drop counts out)
# ---------------------------------------------------------------------------------------------


def track_of(rec: CallRecord, opts: AssembleOptions) -> str | None:
    """The track a call is filtered in, or None when its label keeps it out of the sample."""
    if rec.label == MAIN or opts.export_side_calls:
        return rec.label
    return None


def drop_reason(rec: CallRecord, opts: AssembleOptions) -> str | None:
    """Why a call can never be retained (its drop reason), or None for a candidate."""
    if track_of(rec, opts) is None:
        return rec.label
    if rec.status == "error":
        return "error"
    if rec.status == "aborted" or rec.finish_reason == "abort":
        return "aborted"
    if not rec.output_ids:
        return "empty_output"
    if opts.drop_truncated and rec.finish_reason == "length":
        return "truncated"
    return None


Segment = tuple[str, int]
"""(track, seq of the call that opened it)."""


def assign_segments(calls: Sequence[_Call], opts: AssembleOptions) -> dict[int, Segment]:
    """Segment of every tracked call: joins the deepest earlier same-track input prefix, or opens
    a new one. Walks up from the call's input end to the first marked node (short for TITO hits)."""
    marks: dict[str, dict[_Node, int]] = {}
    seg_of: dict[int, Segment] = {}
    for c in calls:
        track = track_of(c.rec, opts)
        if track is None:
            continue
        marked = marks.setdefault(track, {})
        node: _Node | None = c.in_end
        while node is not None and node not in marked:
            node = node.parent
        seg_of[c.seq] = (track, c.seq) if node is None else seg_of[marked[node]]
        marked[c.in_end] = c.seq
    return seg_of


def drop_superseded(
    candidates: Sequence[_Call], seg_of: dict[int, Segment]
) -> tuple[list[_Call], int]:
    """Candidates minus dead retries (see module docstring), in seq order; and how many died."""
    latest: dict[tuple[Segment, _Node], int] = {}  # same input => same segment, per track
    for c in candidates:
        key = (seg_of[c.seq], c.in_end)
        latest[key] = max(latest.get(key, -1), c.seq)
    extended: dict[Segment, set[_Node]] = {}
    kept: list[_Call] = []
    for c in sorted(candidates, key=lambda c: c.seq, reverse=True):
        below = extended.setdefault(seg_of[c.seq], set())
        if latest[seg_of[c.seq], c.in_end] > c.seq and c.out_end not in below:
            continue
        kept.append(c)
        node: _Node | None = c.in_end
        while node is not None and node not in below:  # mark input(c)'s prefixes: each once
            below.add(node)
            node = node.parent
    kept.reverse()
    return kept, len(candidates) - len(kept)


# ---------------------------------------------------------------------------------------------
# step 4: emit the retained trees
# ---------------------------------------------------------------------------------------------


@dataclass
class _SegmentTree:
    """The retained sub-trie of one segment inside the global trie."""

    kids: dict[_Node, list[_Node]]
    credit: dict[_Node, _Call]
    roots: list[_Node]

    def n_leaves(self) -> int:
        return sum(1 for ks in self.kids.values() if not ks)


def _segment_tree(tree: RadixTree, calls: list[_Call]) -> _SegmentTree:
    """Induced sub-trie of ``calls``' paths, and the earliest retained output over each node."""
    induced: set[_Node] = set()
    for c in calls:
        node = c.out_end
        while node is not tree.root and node not in induced:
            induced.add(node)
            node = node.parent  # type: ignore[assignment]
    kids: dict[_Node, list[_Node]] = {}
    for node in induced:
        kids[node] = [ch for _, ch in sorted(node.children.items()) if ch in induced]
    roots = [ch for _, ch in sorted(tree.root.children.items()) if ch in induced]
    credit: dict[_Node, _Call] = {}
    for c in calls:  # seq order: the earliest output over a node wins
        node = c.out_end
        while node is not c.in_end:
            credit.setdefault(node, c)
            node = node.parent  # type: ignore[assignment]
    return _SegmentTree(kids, credit, roots)


def _emit(seg: _SegmentTree, nodes: list[TreeNode]) -> int:
    """Append the segment's nodes (pre-order, merged runs); return its expanded token count."""
    expanded = 0
    stack: list[tuple[_Node, int]] = [(r, -1) for r in reversed(seg.roots)]
    while stack:
        g, parent = stack.pop()
        owner = seg.credit.get(g)
        chain = [g]
        while len(seg.kids[chain[-1]]) == 1 and seg.credit.get(seg.kids[chain[-1]][0]) is owner:
            chain.append(seg.kids[chain[-1]][0])
        nodes.append(_tree_node(chain, owner, parent))
        below = seg.kids[chain[-1]]
        if not below:
            expanded += chain[-1].end
        idx = len(nodes) - 1
        stack.extend((k, idx) for k in reversed(below))
    return expanded


def _tree_node(chain: list[_Node], owner: _Call | None, parent: int) -> TreeNode:
    ids = chain[0].tokens if len(chain) == 1 else np.concatenate([g.tokens for g in chain])
    n = len(ids)
    if owner is None:
        return TreeNode(
            parent=parent,
            token_ids=ids.tobytes(),
            logprobs=bytes(4 * n),
            loss_mask=bytes(n),
            weight_version=-1,
        )
    lo, hi = chain[0].depth - owner.input_len, chain[-1].end - owner.input_len
    return TreeNode(
        parent=parent,
        token_ids=ids.tobytes(),
        logprobs=owner.out_lp[lo:hi].tobytes(),
        loss_mask=b"\x01" * n,
        weight_version=owner.weight_version,
    )


# ---------------------------------------------------------------------------------------------
# assemble
# ---------------------------------------------------------------------------------------------


@dataclass
class Assembly:
    """``assemble``'s sample plus what it decided (for tests, tools and metrics)."""

    sample: TreeSample
    retained: tuple[int, ...] = ()
    """Seqs of retained calls (all tracks), ascending."""
    segments: dict[int, Segment] = field(default_factory=dict)
    """Segment of every tracked call, by seq."""


def tombstone(
    result: RolloutResult, reason: str, counters: TreeCounters | None = None
) -> TreeSample:
    """The sample that says "this rollout yields nothing", with ``reason``."""
    s = _sample(result, [], counters or TreeCounters())
    s.dropped_reason = reason
    return s


def _sample(result: RolloutResult, nodes: list[TreeNode], counters: TreeCounters) -> TreeSample:
    return TreeSample(
        rollout_id=result.rollout_id,
        group_id=result.group_id,
        k=result.k,
        attempt=result.attempt,
        group_size=result.group_size,
        issued_version=result.issued_version,
        task_id=result.task_id,
        suite=result.suite,
        harness=result.harness,
        is_eval=result.is_eval,
        reward=result.reward,
        metrics=dict(result.metrics),
        nodes=nodes,
        counters=counters,
        rollout_status=result.status,
    )


def assemble(
    calls: Iterable[CallRecord], result: RolloutResult, opts: AssembleOptions | None = None
) -> TreeSample:
    """Rebuild ``result``'s calls into one filtered TreeSample (or a tombstone with the reason)."""
    return assemble_detailed(calls, result, opts).sample


def _sampled_with(rec: CallRecord) -> tuple[float, float, int]:
    """What a call's log-probs depend on (temperature, top_p, top_k; not its token limit)."""
    s = rec.sampling
    return (s.temperature, s.top_p, s.top_k)


def _tito_misses(recs: list[CallRecord]) -> int:
    """Successful calls, after the first successful one of their track (label), whose input
    was fully re-rendered (a title request before the first main call is no miss of it)."""
    seen: set[str] = set()
    misses = 0
    for c in recs:
        if c.status == "ok":
            misses += c.label in seen and not c.tito_hit
            seen.add(c.label)
    return misses


def _false_forks(built: list[_Call]) -> int:
    """Calls that continue an earlier call's conversation but keep only part of its output.

    For each successful call C, its *turn parent* P is the earlier successful call with the
    longest input that is a proper prefix of C's input. C is a false fork when, after P's
    input, C shares at least one but not all of P's output tokens: C kept P's reply, yet the
    ids differ from what was sampled (a re-rendered turn end, a re-encoded reply), leaving a
    dead-end branch. Read off the tree (node ends are stable positions), so it does not depend
    on how deltas were encoded and costs a few parent hops per call.
    """
    opened: dict[int, _Call] = {}  # id(input end node) -> the earliest call ending its input there
    forks = 0
    for c in sorted((c for c in built if c.rec.status == "ok"), key=lambda c: c.seq):
        node, parent = c.in_end.parent, None
        while node is not None and parent is None:
            parent = opened.get(id(node))
            node = node.parent
        if parent is not None and len(parent.out_ids):
            output_nodes = set()
            n = parent.out_end
            while n is not parent.in_end:
                output_nodes.add(id(n))
                n = n.parent
            n = c.in_end
            while n is not parent.in_end and id(n) not in output_nodes:
                n = n.parent
            shared = n.end - parent.in_end.end
            forks += 0 < shared < len(parent.out_ids)
        opened.setdefault(id(c.in_end), c)
    return forks


def assemble_detailed(
    calls: Iterable[CallRecord], result: RolloutResult, opts: AssembleOptions | None = None
) -> Assembly:
    """``assemble``, also returning which calls were retained and the segments."""
    opts = opts or AssembleOptions()
    counters = TreeCounters()
    if result.status != "ok":
        return Assembly(tombstone(result, f"rollout_{result.status}", counters))
    mine = [c for c in calls if c.rollout_id == result.rollout_id]
    try:
        recs = _dedupe(mine)
        counters.n_calls = len(recs)
        counters.tito_misses = _tito_misses(recs)
        counters.truncated_calls = sum(
            c.status == "ok" and c.finish_reason == "length" for c in recs
        )
        if not recs:
            raise _Reject("no_calls")
        have = {c.seq for c in recs}
        if any(s not in have for s in range(result.n_calls)):
            raise _Reject("missing_calls", f"{len(have)} of {result.n_calls} calls present")
        tree = RadixTree()
        try:
            built = _rebuild(tree, recs)
            counters.false_forks = _false_forks(built)
            return _filter_and_emit(tree, built, result, opts, counters)
        finally:
            tree.release()
    except _Reject as e:
        return Assembly(tombstone(result, e.reason, counters))


def _filter_and_emit(
    tree: RadixTree,
    built: list[_Call],
    result: RolloutResult,
    opts: AssembleOptions,
    counters: TreeCounters,
) -> Assembly:
    dropped: Counter[str] = Counter()
    candidates = []
    for c in built:
        reason = drop_reason(c.rec, opts)
        if reason is None:
            candidates.append(c)
        else:
            dropped[reason] += 1
    seg_of = assign_segments(built, opts)
    retained, n_dead = drop_superseded(candidates, seg_of)
    if n_dead:
        dropped["superseded"] = n_dead
    counters.dropped = dict(sorted(dropped.items()))
    by_seg: dict[Segment, list[_Call]] = {}
    for c in retained:
        by_seg.setdefault(seg_of[c.seq], []).append(c)
    order = sorted(by_seg, key=lambda s: (s[0] != MAIN, s[1]))
    segs = [_segment_tree(tree, by_seg[s]) for s in order]
    done = Assembly(_sample(result, [], counters), tuple(c.seq for c in retained), seg_of)
    if not retained:
        done.sample = tombstone(result, "no_model_tokens", counters)
        return done
    used = {_sampled_with(c.rec) for c in retained}
    if len(used) > 1:  # one rollout, one behaviour distribution: the learner takes one
        done.sample = tombstone(result, "mixed_sampling", counters)
        return done
    counters.n_leaves = sum(s.n_leaves() for s in segs)
    if counters.n_leaves > opts.max_branches:
        done.sample = tombstone(result, "too_many_branches", counters)
        return done
    nodes: list[TreeNode] = []
    counters.expanded_tokens = sum(_emit(s, nodes) for s in segs)
    counters.unique_tokens = sum(len(n.token_ids) // 4 for n in nodes)
    counters.model_tokens = sum(len(n.token_ids) // 4 for n in nodes if n.weight_version >= 0)
    done.sample.nodes = nodes
    first = retained[0].rec.sampling
    done.sample.sampling = SamplingParams(
        temperature=first.temperature,
        top_p=first.top_p,
        top_k=first.top_k,
        max_new_tokens=max(c.rec.sampling.max_new_tokens for c in retained),
    )
    done.sample.weight_version = min(
        (n.weight_version for n in nodes if n.weight_version >= 0), default=-1
    )
    return done


# ---------------------------------------------------------------------------------------------
# views for the learner
# ---------------------------------------------------------------------------------------------


class Branch(NamedTuple):
    """One root-to-leaf path of a TreeSample as a plain sequence: the branch-expanded view a
    non-packing learner would run, and the reference the packed forms are tested against."""

    token_ids: np.ndarray
    """int32 token ids."""
    logprobs: np.ndarray
    """float32 rollout log-probs (0 where ``loss_mask`` is 0)."""
    loss_mask: np.ndarray
    """uint8, 1 on model tokens."""
    nodes: list[int]
    """Node indices from root to leaf."""
    node_of: np.ndarray
    """Per token: the node it belongs to."""
    offset_of: np.ndarray
    """Per token: its index within that node."""


def leaves(sample: TreeSample) -> list[int]:
    """Indices of nodes without children, ascending."""
    has_child = [False] * len(sample.nodes)
    for n in sample.nodes:
        if n.parent >= 0:
            has_child[n.parent] = True
    return [i for i, h in enumerate(has_child) if not h]


def paths(sample: TreeSample) -> list[list[int]]:
    """Every root-to-leaf path as node indices (root first), one per leaf in index order."""
    out = []
    for leaf in leaves(sample):
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = sample.nodes[i].parent
        out.append(path[::-1])
    return out


def node_arrays(node: TreeNode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A node's (int32 ids, float32 log-probs, uint8 loss mask). An empty mask means zeros (an
    environment-only node); empty log-probs mean zeros there, and NaN where the mask is 1: a
    scored token without a behaviour log-prob is marked missing, never given ``log mu = 0``
    (the learner leaves it out). Raises ``ValueError`` when the lengths disagree."""
    ids = unpack_ids(node.token_ids)
    n = len(ids)
    mask = unpack_u8(node.loss_mask) if node.loss_mask else np.zeros(n, np.uint8)
    if node.logprobs:
        lp = unpack_f32(node.logprobs)
    elif len(mask) == n:
        lp = np.where(mask > 0, np.float32(np.nan), np.float32(0.0))
    else:
        lp = np.zeros(n, np.float32)
    if len(lp) != n or len(mask) != n:
        raise ValueError("logprobs/loss_mask length differ from token_ids")
    return ids, lp, mask


def expand(sample: TreeSample) -> list[Branch]:
    """The branch-expanded view: one ``Branch`` per leaf, in leaf index order."""
    arrays = [node_arrays(n) for n in sample.nodes]
    out = []
    for path in paths(sample):
        ids, lp, mask = ([arrays[i][j] for i in path] for j in range(3))
        out.append(
            Branch(
                token_ids=np.concatenate(ids),
                logprobs=np.concatenate(lp),
                loss_mask=np.concatenate(mask),
                nodes=path,
                node_of=np.concatenate(
                    [np.full(len(x), i) for i, x in zip(path, ids, strict=True)]
                ),
                offset_of=np.concatenate([np.arange(len(x)) for x in ids]),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# splitting very large samples
# ---------------------------------------------------------------------------------------------

_BYTES_PER_TOKEN = 9  # int32 id + float32 log-prob + uint8 mask
_NODE_OVERHEAD = 96  # msgpack keys and headers of one TreeNode
_PART_MARGIN = 4096


def _chunk_nodes(nodes: list[TreeNode], max_tokens: int) -> list[TreeNode]:
    """Cut nodes longer than ``max_tokens`` into parent->child chains (same paths, same order)."""
    if all(len(n.token_ids) // 4 <= max_tokens for n in nodes):
        return nodes
    out: list[TreeNode] = []
    new_index: list[int] = []
    for n in nodes:
        parent = new_index[n.parent] if n.parent >= 0 else -1
        ids, lp, mask = n.token_ids, n.logprobs, n.loss_mask
        for lo in range(0, len(ids) // 4, max_tokens):
            hi = lo + max_tokens
            out.append(
                TreeNode(
                    parent=parent,
                    token_ids=ids[4 * lo : 4 * hi],
                    logprobs=lp[4 * lo : 4 * hi],
                    loss_mask=mask[lo:hi],
                    weight_version=n.weight_version,
                )
            )
            parent = len(out) - 1
        new_index.append(parent)
    return out


def split_sample(sample: TreeSample, max_bytes: int) -> list[TreeSample]:
    """Split ``sample`` into parts whose encoding stays under ``max_bytes`` (see module doc).

    A sample that already fits is returned as is (one part). Nodes too big for one part are first
    cut into chains, which leaves every path and therefore ``expand`` unchanged.
    """
    if sample.is_tombstone or len(encode(sample)) <= max_bytes:
        return [sample]
    head = len(encode(msgspec.structs.replace(sample, nodes=[])))
    budget = max_bytes - head - _PART_MARGIN
    if budget < 64 * _BYTES_PER_TOKEN:
        raise ValueError(f"max_bytes {max_bytes} leaves no room for nodes")
    nodes = _chunk_nodes(sample.nodes, (budget - _NODE_OVERHEAD) // _BYTES_PER_TOKEN)
    groups: list[list[TreeNode]] = [[]]
    used = 0
    for n in nodes:
        size = len(n.token_ids) + len(n.logprobs) + len(n.loss_mask) + _NODE_OVERHEAD
        if groups[-1] and used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(n)
        used += size
    return [
        msgspec.structs.replace(sample, nodes=g, part=i, n_parts=len(groups))
        for i, g in enumerate(groups)
    ]


def join_parts(parts: Iterable[TreeSample]) -> TreeSample:
    """Reassemble ``split_sample``'s parts (any order) into one sample; ValueError if incomplete."""
    got = sorted(parts, key=lambda p: p.part)
    if not got:
        raise ValueError("no parts")
    n = got[0].n_parts
    if [p.part for p in got] != list(range(n)) or any(p.n_parts != n for p in got):
        raise ValueError(f"parts {[p.part for p in got]} of {n} do not make a whole sample")
    if len({p.rollout_id for p in got}) != 1:
        raise ValueError("parts of different rollouts")
    nodes = [node for p in got for node in p.nodes]
    return msgspec.structs.replace(got[0], nodes=nodes, part=0, n_parts=1)
