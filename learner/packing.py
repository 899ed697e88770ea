"""Tree packing: lay TreeSamples out in rows so every unique token is computed once.

A row holds one or more trees (or pieces of trees) flattened in DFS preorder. Three facts make
one forward pass over a row equal to running every root-to-leaf branch on its own:

* **Positions** are depths: a token's index along its own root path, so a child node continues
  at its parent's end whatever was laid out between them.
* **Ancestry is an interval.** In DFS preorder the subtree of a node is contiguous, so the
  tokens that have token ``j`` on their root path are exactly ``j .. subtree_end[j] - 1``
  (later tokens of ``j``'s node, then its descendants). Query ``i`` may attend key ``j`` iff
  ``j <= i < subtree_end[j]``. The whole tree attention mask is one int per position; trees
  sharing a row have disjoint intervals, so the mask is block diagonal for free. The dense
  additive mask (CPU, eager/sdpa) and the CUDA FlexAttention ``BlockMask`` are both built
  from ``subtree_end``.
* **Targets are gathered per token, not per position.** Every token except a root's first has
  exactly one predecessor on its path: the previous token of its node or, for a node's first
  token, its parent's last token. A position with several children is therefore the source of
  several targets (one per child); the learner gathers hidden states at ``target_src`` (with
  repeats) before the LM head. By default only loss-mask-1 tokens become targets: environment
  tokens are context, never scored, and never pay for a vocabulary projection.

Invariant (tested against per-branch forwards): each unique token of a TreeSample is a target in
exactly one row, so a loss summed over targets is the branch-expanded *count-once* loss.

**Across samples** (``share_prefixes``): a token's hidden state depends only on the tokens of its
root path, so samples whose paths start alike (every rollout of a harness begins with the same
system prompt and tools; a group's members with the same task prompt) are merged into one forest
first, a radix tree over all their nodes. A merged node remembers its *owners* (sample, node,
offset), and each owner gets its own targets at the shared positions, with its own mask and
rollout log-probs: the per-sample losses are unchanged, the shared context is computed once.

Budget: rows hold at most ``max_tokens`` tokens (a dense mask grows with its square). A tree
larger than that is split at branch points into pieces; each piece repeats its ancestor chain
as context (computed, never a target). That is the only duplicated work and ``PackStats`` counts
it. A single chain longer than the budget cannot be split at a branch point: it gets a row of
its own, over budget, and is counted (``over_budget_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harnessrl.common.records import TreeSample
from harnessrl.common.tree import node_arrays
from harnessrl.learner.config import PackConfig

# ---------------------------------------------------------------------------------------------
# tree views of a TreeSample
# ---------------------------------------------------------------------------------------------


@dataclass
class _Owner:
    """A sample's claim on a node's tokens: they are its ``node``'s from ``offset`` on."""

    sample: int
    node: int
    offset: int
    mask: np.ndarray
    logp: np.ndarray
    first: np.ndarray
    """Per token: the depth of the first token of the run of the sample's scored tokens that it
    belongs to (its *turn*), on its own path; a token's own depth where it is not scored."""


@dataclass
class _Tree:
    """Decoded arrays and child lists of one TreeSample (a forest: one root per segment), or
    of several merged ones. A node's loss mask and rollout log-probs are its owners': one per
    sample holding its tokens (a single sample's tree has one owner per node)."""

    ids: list[np.ndarray]
    children: list[list[int]]
    roots: list[int]
    owners: list[list[_Owner]]
    missing_logprobs: int = 0
    """Loss-mask-1 tokens without a finite behaviour log-prob, left out (mask 0)."""

    @classmethod
    def of(cls, sample: TreeSample, index: int = 0, drop_missing: bool = True) -> _Tree:
        ids, owners, children, roots = [], [], [[] for _ in sample.nodes], []
        n_missing = 0
        depth_end: list[int] = []
        tail: list[int | None] = []  # run-first depth at a node's end, None outside a run
        for i, node in enumerate(sample.nodes):
            try:
                t, lp, m = node_arrays(node)
            except ValueError as e:
                raise ValueError(f"node {i}: {e}") from None
            missing = (m > 0) & ~np.isfinite(lp)
            n_missing += int(missing.sum())
            if drop_missing and missing.any():  # no behaviour log-prob: IS needs it
                m = np.where(missing, 0, m).astype(m.dtype)
            if node.parent >= i:
                raise ValueError(f"node {i}: parent {node.parent} does not precede it")
            p = node.parent
            d0, inherited = (depth_end[p], tail[p]) if p >= 0 else (0, None)
            first = _run_first(m, d0, inherited)
            depth_end.append(d0 + len(t))
            tail.append((int(first[-1]) if m[-1] else None) if len(t) else inherited)
            ids.append(t)
            owners.append([_Owner(index, i, 0, m, lp, first)])
            if p < 0:
                roots.append(i)
            else:
                children[p].append(i)
        return cls(ids, children, roots, owners, n_missing)

    def n_tokens(self) -> int:
        return sum(len(t) for t in self.ids)

    def size(self, i: int) -> int:
        return len(self.ids[i])

    def preorder(self, top: int, keep: set[int] | None = None) -> list[int]:
        """Nodes of ``top``'s subtree (restricted to ``keep``) in DFS preorder, iteratively."""
        out, stack = [], [top]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(c for c in reversed(self.children[n]) if keep is None or c in keep)
        return out

    def expanded_tokens(self) -> int:
        """Tokens over all root-to-leaf paths (each path counted in full)."""
        depth_end = [0] * len(self.ids)
        total = 0
        for i in range(len(self.ids)):  # parents precede children
            depth_end[i] += self.size(i)
            for c in self.children[i]:
                depth_end[c] = depth_end[i]
            if not self.children[i]:
                total += depth_end[i]
        return total

    def subtree_sizes(self) -> list[int]:
        sub = [self.size(i) for i in range(len(self.ids))]
        for i in range(len(self.ids) - 1, -1, -1):  # children follow parents: reverse is postorder
            for c in self.children[i]:
                sub[i] += sub[c]
        return sub


def _run_first(mask: np.ndarray, d0: int, inherited: int | None) -> np.ndarray:
    """``_Owner.first`` of a node's tokens at depths ``d0...``; ``inherited`` is the run-first
    depth of the run its parent ends in (None when the parent's last token is not scored)."""
    m = np.asarray(mask).astype(bool)
    depth = d0 + np.arange(len(m), dtype=np.int64)
    if not m.any():
        return depth
    starts = m & np.concatenate(([True], ~m[:-1]))
    start_depth = depth[starts]
    if inherited is not None and m[0]:
        start_depth[0] = inherited
    run = np.cumsum(starts) - 1
    return np.where(m, start_depth[np.maximum(run, 0)], depth)


def _merge(trees: Sequence[_Tree]) -> _Tree:
    """One forest for many samples' trees: a radix tree over all their nodes, in which token
    paths that are equal from a root are one path. Every merged node lists its owners."""
    out = _Tree([], [], [], [])

    def expand(items: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Items with tokens left; a used-up (or empty) node is replaced by its children."""
        done, stack = [], list(reversed(items))
        while stack:
            t, n, st = stack.pop()
            if len(trees[t].ids[n]) > st:
                done.append((t, n, st))
            else:
                stack.extend((t, c, 0) for c in reversed(trees[t].children[n]))
        return done

    roots = [(t, r, 0) for t, tree in enumerate(trees) for r in tree.roots]
    work: list[tuple[int, list[tuple[int, int, int]]]] = [(-1, expand(roots))]
    while work:
        parent, items = work.pop()
        groups: dict[int, list[tuple[int, int, int]]] = {}
        for t, n, st in items:
            groups.setdefault(int(trees[t].ids[n][st]), []).append((t, n, st))
        for group in groups.values():
            t0, n0, st0 = group[0]
            first = trees[t0].ids[n0][st0:]
            common = len(first)
            for t, n, st in group[1:]:
                rest = trees[t].ids[n][st:]
                m = min(common, len(rest))
                differ = np.flatnonzero(first[:m] != rest[:m])
                common = int(differ[0]) if len(differ) else m
            idx = len(out.ids)
            out.ids.append(first[:common])
            out.owners.append(
                [
                    _Owner(
                        t,
                        n,
                        st,
                        trees[t].owners[n][0].mask[st : st + common],
                        trees[t].owners[n][0].logp[st : st + common],
                        trees[t].owners[n][0].first[st : st + common],
                    )
                    for t, n, st in group
                ]
            )
            out.children.append([])
            (out.roots if parent < 0 else out.children[parent]).append(idx)
            below: list[tuple[int, int, int]] = []
            for t, n, st in group:
                if st + common < len(trees[t].ids[n]):
                    below.append((t, n, st + common))
                else:
                    below.extend((t, c, 0) for c in trees[t].children[n])
            below = expand(below)
            if below:
                work.append((idx, below))
    return out


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


@dataclass
class PackedRow:
    """One row: flattened tokens plus its targets (numpy, host side)."""

    input_ids: np.ndarray
    """[T] int64 token ids in DFS preorder (pieces one after another)."""
    position_ids: np.ndarray
    """[T] int64 depth of each token on its root path."""
    subtree_end: np.ndarray
    """[T] int64: positions ``j .. subtree_end[j]-1`` have token ``j`` on their root path."""
    target_src: np.ndarray
    """[N] int64 position whose output predicts the target (the predecessor on its path)."""
    target_pos: np.ndarray
    """[N] int64 position of the target token itself."""
    target_ids: np.ndarray
    """[N] int64 the target token ids."""
    loss_mask: np.ndarray
    """[N] float32 1 for model tokens (trained), 0 for environment tokens."""
    rollout_logp: np.ndarray
    """[N] float32 log-prob the engine sampled the token with (0 for environment tokens)."""
    advantage: np.ndarray
    """[N] float32 per-token advantage given to ``pack`` (GRPO: the rollout's, shared)."""
    returns: np.ndarray
    """[N] float32 return of the token (the rollout reward; PPO's value target)."""
    sample_index: np.ndarray
    """[N] int64 index into the ``samples`` given to ``pack``."""
    target_node: np.ndarray
    """[N] int64 node index of the target token within its sample."""
    target_offset: np.ndarray
    """[N] int64 index of the target token within its node."""
    baseline_src: np.ndarray
    """[N] int64 position of the state the target's *turn* started from: the predecessor of the
    first token of the run of its sample's scored tokens along its path that the target belongs
    to (one model reply). Always in the row (a piece repeats its ancestor chain), so it does not
    depend on how trees were split. PPO's ``value_baseline = "turn"`` reads ``V`` there. (A
    turn that starts at a root's first token, which nothing precedes: that token's position.)"""
    temperature: np.ndarray | None = None
    """[N] float32 sampling temperature of the target's sample (``pack``'s ``temperatures``): the
    learner's log-probs are of ``softmax(logits / temperature)``, as the engine sampled them.
    None: the policy's own temperature."""
    duplicated: int = 0
    """Context tokens repeated from another piece of the same tree."""
    unpredictable: int = 0
    """Loss-mask-1 tokens left out because nothing precedes them (a segment's first token)."""

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class PackStats:
    """Accounting of one ``pack`` call (counts are tokens unless named otherwise)."""

    unique_tokens: int = 0
    """Tokens of the samples, each counted once."""
    expanded_tokens: int = 0
    """Tokens if every root-to-leaf branch were its own sequence."""
    computed_tokens: int = 0
    """Tokens laid out in rows (= unique - shared + duplicated), padding excluded."""
    duplicated_tokens: int = 0
    """Ancestor tokens repeated because a tree was split at a branch point."""
    shared_tokens: int = 0
    """Tokens of several samples computed once (``share_prefixes``): unique minus merged."""
    target_tokens: int = 0
    """Scored targets."""
    rows: int = 0
    pieces: int = 0
    """Trees or tree pieces placed in rows."""
    split_trees: int = 0
    """Segments (root subtrees) larger than the budget, split at branch points."""
    over_budget_rows: int = 0
    """Rows longer than ``max_tokens`` (an unsplittable chain)."""
    unpredictable_tokens: int = 0
    """Loss-mask-1 tokens with no predecessor (a root's first token): never scored."""
    missing_logprob_tokens: int = 0
    """Loss-mask-1 tokens the engine gave no log-prob (NaN or none recorded): never scored,
    since their importance weight is unknown."""

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Packing:
    rows: list[PackedRow]
    stats: PackStats
    n_samples: int


@dataclass
class _Piece:
    tree: _Tree
    context: list[int]
    """Ancestor chain (root first), repeated context only."""
    owned: list[int]
    """Nodes whose tokens are scored here: whole subtrees hanging below ``context``."""
    n_tokens: int = 0


def _split(
    tree: _Tree, root: int, sub: list[int], budget: int
) -> list[tuple[list[int], list[int]]]:
    """Cut a root subtree into (context chain, owned nodes) pieces of at most ``budget`` tokens.

    Each owned set is a node plus whole child subtrees (or whole subtrees under a shared
    context). Children that do not fit beside their parent move to new pieces that repeat the
    chain down to the parent; a child too large even alone is split the same way, one level down.
    """
    pieces: list[tuple[list[int], list[int]]] = []
    work: list[tuple[int, list[int], int]] = [(root, [], 0)]
    while work:
        top, ctx, ctx_len = work.pop()
        if ctx_len + sub[top] <= budget:
            pieces.append((ctx, tree.preorder(top)))
            continue
        owned, used, rest = [top], ctx_len + tree.size(top), []
        for c in tree.children[top]:
            if used + sub[c] <= budget:
                owned += tree.preorder(c)
                used += sub[c]
            else:
                rest.append(c)
        pieces.append((ctx, owned))
        ctx2, ctx2_len = [*ctx, top], ctx_len + tree.size(top)
        bins: list[tuple[list[int], int]] = []
        for c in sorted(rest, key=lambda c: -sub[c]):
            if ctx2_len + sub[c] > budget:
                work.append((c, ctx2, ctx2_len))
                continue
            for k, (nodes, size) in enumerate(bins):
                if size + sub[c] <= budget:
                    bins[k] = (nodes + tree.preorder(c), size + sub[c])
                    break
            else:
                bins.append((tree.preorder(c), ctx2_len + sub[c]))
        pieces.extend((ctx2, nodes) for nodes, _ in bins)
    return pieces


def _row_of(
    pieces: list[_Piece],
    advantages: np.ndarray,
    rewards: np.ndarray,
    temperatures: np.ndarray | None,
    targets: str,
) -> PackedRow:
    """Flatten pieces into one row: ids, depths, subtree ends and gathered targets."""
    ids, pos, end = [], [], []
    tg: dict[str, list[np.ndarray]] = {k: [] for k in _TARGET_FIELDS}
    offset = duplicated = unpredictable = 0
    for pc in pieces:
        tree, owned = pc.tree, set(pc.owned)
        keep = owned | set(pc.context)
        top = pc.context[0] if pc.context else pc.owned[0]
        order = tree.preorder(top, keep)
        parent: dict[int, int | None] = {top: None}
        for n in order:
            parent.update((c, n) for c in tree.children[n] if c in keep)
        start: dict[int, int] = {}
        last: dict[int, int | None] = {}  # last position of a node (inherited when empty)
        depth_end: dict[int, int] = {}
        # path[d]: position of the token at depth d on the current node's root path. In DFS
        # preorder everything laid out since the node's parent lies deeper than the parent's
        # end, so path[:d0] still holds the node's ancestors when the node is reached.
        path = np.zeros(sum(tree.size(n) for n in order), np.int64)
        for n in order:
            p, size = parent[n], tree.size(n)
            d0 = depth_end[p] if p is not None else 0
            prev = last[p] if p is not None else None
            start[n], depth_end[n] = offset, d0 + size
            last[n] = offset + size - 1 if size else prev
            ids.append(tree.ids[n])
            pos.append(np.arange(d0, d0 + size))
            path[d0 : d0 + size] = np.arange(offset, offset + size)
            if n in owned:
                unpredictable += _targets(tg, tree, n, offset, prev, targets, path)
            else:
                duplicated += size
            offset += size
        sub_end = {n: start[n] + tree.size(n) for n in order}
        for n in reversed(order):  # reverse preorder visits children before parents
            p = parent[n]
            if p is not None:
                sub_end[p] = max(sub_end[p], sub_end[n])
        end.extend(np.full(tree.size(n), sub_end[n], dtype=np.int64) for n in order)
    t = {k: _cat(v, np.float32 if k in ("mask", "logp") else np.int64) for k, v in tg.items()}
    return PackedRow(
        input_ids=_cat(ids, np.int64),
        position_ids=_cat(pos, np.int64),
        subtree_end=_cat(end, np.int64),
        target_src=t["src"],
        target_pos=t["pos"],
        target_ids=t["ids"],
        loss_mask=t["mask"],
        rollout_logp=t["logp"],
        advantage=advantages[t["sample"]].astype(np.float32),
        returns=rewards[t["sample"]].astype(np.float32),
        sample_index=t["sample"],
        target_node=t["node"],
        target_offset=t["offset"],
        baseline_src=t["base"],
        temperature=None if temperatures is None else temperatures[t["sample"]],
        duplicated=duplicated,
        unpredictable=unpredictable,
    )


_TARGET_FIELDS = ("src", "pos", "ids", "mask", "logp", "sample", "node", "offset", "base")


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _targets(
    tg: dict[str, list[np.ndarray]],
    tree: _Tree,
    n: int,
    offset: int,
    prev: int | None,
    targets: str,
    path: np.ndarray,
) -> int:
    """Append node ``n``'s scored tokens, once per owner (source = predecessor position on the
    path; turn baseline = the position before the owner's run-first depth, from ``path``);
    return how many loss-mask-1 tokens had no predecessor (a segment's first token)."""
    lost = 0
    for own in tree.owners[n]:
        mask = own.mask
        k = np.arange(len(mask)) if targets == "all" else np.flatnonzero(mask)
        src = offset + k - 1
        if len(k) and k[0] == 0:
            if prev is None:
                lost += int(mask[0])
                k, src = k[1:], src[1:]
            else:
                src[0] = prev
        for key, value in (
            ("src", src),
            ("pos", offset + k),
            ("ids", tree.ids[n][k]),
            ("mask", mask[k]),
            ("logp", own.logp[k]),
            ("sample", np.full(len(k), own.sample)),
            ("node", np.full(len(k), own.node)),
            ("offset", own.offset + k),
            ("base", path[np.maximum(own.first[k] - 1, 0)]),
        ):
            tg[key].append(value)
    return lost


def pack(
    samples: Sequence[TreeSample],
    config: PackConfig | None = None,
    *,
    advantages: Sequence[float] | np.ndarray | None = None,
    temperatures: Sequence[float] | np.ndarray | None = None,
    drop_missing_logprobs: bool = True,
) -> Packing:
    """Lay ``samples`` out in rows of at most ``config.max_tokens`` tokens.

    ``advantages`` (one per sample, e.g. GRPO's group-normalised value) is copied onto every
    target of that sample; ``returns`` is the sample's reward; ``temperatures`` (one per
    sample; default: the policy's own) is the temperature its targets' log-probs are taken at
    (the one the engine sampled with, for RL). A scored token without a finite behaviour
    log-prob is left out and counted (``drop_missing_logprobs``; SFT, whose loss needs none,
    keeps it). Segments (roots) that fit are
    placed whole, largest first, into the first row with room (first-fit decreasing).
    """
    cfg = config or PackConfig()
    adv = np.zeros(len(samples), np.float32) if advantages is None else np.asarray(advantages)
    if len(adv) != len(samples):
        raise ValueError("one advantage per sample")
    stats = PackStats()
    pieces: list[_Piece] = []
    trees = [_Tree.of(sample, s, drop_missing_logprobs) for s, sample in enumerate(samples)]
    for tree in trees:
        stats.unique_tokens += tree.n_tokens()
        stats.expanded_tokens += tree.expanded_tokens()
        stats.missing_logprob_tokens += tree.missing_logprobs
    if cfg.share_prefixes and len(trees) > 1:
        trees = [_merge(trees)]
        stats.shared_tokens = stats.unique_tokens - trees[0].n_tokens()
    for tree in trees:
        sub = tree.subtree_sizes()
        for root in tree.roots:
            cut = _split(tree, root, sub, cfg.max_tokens)
            stats.split_trees += len(cut) > 1
            for ctx, owned in cut:
                n_tok = sum(tree.size(n) for n in ctx) + sum(tree.size(n) for n in owned)
                pieces.append(_Piece(tree, ctx, owned, n_tok))
    rows_of: list[list[_Piece]] = []
    room: list[int] = []
    for pc in sorted(pieces, key=lambda p: -p.n_tokens):
        for k, free in enumerate(room):
            if pc.n_tokens <= free:
                rows_of[k].append(pc)
                room[k] -= pc.n_tokens
                break
        else:
            rows_of.append([pc])
            room.append(cfg.max_tokens - pc.n_tokens)
    rewards = np.asarray([s.reward for s in samples], np.float32)
    temps = None
    if temperatures is not None:
        temps = np.asarray(temperatures, np.float32)
        if len(temps) != len(samples) or not (temps > 0).all():
            raise ValueError("one temperature > 0 per sample")
    rows = [_row_of(r, adv, rewards, temps, cfg.targets) for r in rows_of]
    stats.rows = len(rows)
    stats.pieces = len(pieces)
    stats.computed_tokens = sum(r.n_tokens for r in rows)
    stats.duplicated_tokens = sum(r.duplicated for r in rows)
    stats.target_tokens = sum(len(r.target_ids) for r in rows)
    stats.over_budget_rows = sum(r.n_tokens > cfg.max_tokens for r in rows)
    stats.unpredictable_tokens = sum(r.unpredictable for r in rows)
    return Packing(rows, stats, len(samples))


# ---------------------------------------------------------------------------------------------
# batches (torch)
# ---------------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """Rows padded to one length, as tensors; targets flattened across rows.

    ``target_src`` indexes the flattened ``[B*T]`` positions. ``attention_mask`` is the float
    additive ``[B,1,T,T]`` tree mask (0 / -inf) or, on CUDA with ``flex=True``, a FlexAttention
    ``BlockMask``. Extra per-target tensors (``old_logp``, ``ref_logp``, ``norm_weight``) are
    filled by the learner.
    """

    input_ids: Any
    position_ids: Any
    subtree_end: Any
    attention_mask: Any
    target_src: Any
    target_ids: Any
    loss_mask: Any
    rollout_logp: Any
    advantage: Any
    returns: Any
    sample_index: Any
    baseline_src: Any = None
    """[N] flat ``[B*T]`` position of each target's turn baseline state (``PackedRow``)."""
    target_temp: Any = None
    """[N] sampling temperature of each target (None: the policy's own)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_targets(self) -> int:
        return int(self.target_ids.shape[0])

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of ``harnessrl.learner.policy.Policy.forward``."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            "target_src": self.target_src,
            "target_ids": self.target_ids,
            "baseline_src": self.baseline_src,
            "target_temp": self.target_temp,
        }


def dense_tree_mask(subtree_end: Any, dtype: Any) -> Any:
    """``[B,1,T,T]`` additive mask: 0 where query i may attend key j (``j <= i < end[j]``)."""
    import torch

    t = subtree_end.shape[-1]
    i = torch.arange(t, device=subtree_end.device)
    allowed = (i[None, None, :] <= i[None, :, None]) & (i[None, :, None] < subtree_end[:, None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=subtree_end.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


def flex_tree_mask(subtree_end: Any) -> Any:  # pragma: no cover - CUDA only
    """FlexAttention ``BlockMask`` with the same ancestry rule (CUDA; O(T) state, no T×T mask).

    Use with ``attn_implementation="flex_attention"``; transformers passes a 4D ``BlockMask``
    through untouched. Rows must be padded to a multiple of the block size (128).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    b, t = subtree_end.shape

    def tree_mod(bi: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv <= q) & (q < subtree_end[bi, kv])

    return create_block_mask(tree_mod, b, None, t, t, device=subtree_end.device)


def collate(
    rows: Sequence[PackedRow],
    *,
    device: Any = "cpu",
    dtype: Any = None,
    flex: bool = False,
    pad_to_multiple: int = 8,
) -> PackedBatch:
    """Pad ``rows`` to one length and build the tree mask (``flex`` only on CUDA)."""
    import torch

    if not rows:
        raise ValueError("no rows")
    mult = 128 if flex else pad_to_multiple
    t = max(r.n_tokens for r in rows)
    t = -(-t // mult) * mult
    b = len(rows)
    ids = np.zeros((b, t), np.int64)
    pos = np.zeros((b, t), np.int64)
    end = np.tile(np.arange(1, t + 1, dtype=np.int64), (b, 1))  # padding attends only itself
    for k, r in enumerate(rows):
        n = r.n_tokens
        ids[k, :n], pos[k, :n], end[k, :n] = r.input_ids, r.position_ids, r.subtree_end
    src = np.concatenate([r.target_src + k * t for k, r in enumerate(rows)])
    base = np.concatenate([r.baseline_src + k * t for k, r in enumerate(rows)])

    def cat(name: str, dt: Any) -> Any:
        return torch.from_numpy(np.concatenate([getattr(r, name) for r in rows])).to(device, dt)

    end_t = torch.from_numpy(end).to(device)
    if flex:  # pragma: no cover - CUDA only
        mask = flex_tree_mask(end_t)
    else:
        mask = dense_tree_mask(end_t, dtype or torch.float32)
    return PackedBatch(
        input_ids=torch.from_numpy(ids).to(device),
        position_ids=torch.from_numpy(pos).to(device),
        subtree_end=end_t,
        attention_mask=mask,
        target_src=torch.from_numpy(src).to(device),
        target_ids=cat("target_ids", torch.long),
        loss_mask=cat("loss_mask", torch.float32),
        rollout_logp=cat("rollout_logp", torch.float32),
        advantage=cat("advantage", torch.float32),
        returns=cat("returns", torch.float32),
        sample_index=cat("sample_index", torch.long),
        baseline_src=torch.from_numpy(base).to(device),
        target_temp=(
            None if any(r.temperature is None for r in rows) else cat("temperature", torch.float32)
        ),
    )
