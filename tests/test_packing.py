"""Tree packing: layout invariants, and the count-once equivalence of packed and expanded losses."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from harnessrl.common.records import (
    TreeNode,
    TreeSample,
    pack_f32,
    pack_ids,
    pack_u8,
    unpack_f32,
    unpack_ids,
    unpack_u8,
)
from harnessrl.common.tree import expand as branches
from harnessrl.common.tree import node_arrays
from harnessrl.learner import policy as policy_mod
from harnessrl.learner.losses import LossConfig, norm_weights, policy_loss
from harnessrl.learner.packing import PackConfig, collate, dense_tree_mask, pack
from harnessrl.learner.policy import Policy, load_policy
from tests.helpers.learner import one_torch_thread  # noqa: F401  (autouse)

pytestmark = pytest.mark.unit

VOCAB = 8192


def random_sample(
    rng: np.random.Generator, *, n_nodes: int = 8, max_len: int = 9, roots: int = 1, k: int = 0
) -> TreeSample:
    """A random forest: each node hangs off a random earlier node (or starts a segment)."""
    nodes = []
    for i in range(n_nodes):
        parent = -1 if i < roots else int(rng.integers(0, i))
        n = int(rng.integers(0 if i >= roots else 2, max_len + 1))  # non-roots may be empty
        mask = (rng.random(n) < 0.6).astype(np.uint8)
        if parent < 0:
            mask[0] = 0
        lp = np.where(mask > 0, -rng.random(n) * 3, 0.0)
        nodes.append(
            TreeNode(
                parent=parent,
                token_ids=pack_ids(rng.integers(3, VOCAB, n)),
                logprobs=pack_f32(lp),
                loss_mask=pack_u8(mask),
                weight_version=0,
            )
        )
    return TreeSample(
        rollout_id=f"g-{k}-1", group_id="g", k=k, reward=float(rng.random()), nodes=nodes
    )


def chain_sample(prefix: int, suffixes: list[int], rng: np.random.Generator) -> TreeSample:
    """A prompt node, then branches of the given lengths (all model tokens)."""
    nodes = [TreeNode(parent=-1, token_ids=pack_ids(rng.integers(3, VOCAB, prefix)))]
    for n in suffixes:
        nodes.append(
            TreeNode(
                parent=0,
                token_ids=pack_ids(rng.integers(3, VOCAB, n)),
                logprobs=pack_f32(np.full(n, -1.0)),
                loss_mask=pack_u8(np.ones(n)),
            )
        )
    return TreeSample(rollout_id="c-0-1", group_id="c", k=0, nodes=nodes)


def shared_samples(rng: np.random.Generator, n: int = 6) -> list[TreeSample]:
    """Samples whose roots start alike, as every rollout of one harness does: a common system
    prompt, one of two task prompts, a sample that is another's exact copy, one whose root is
    the bare system prompt, and shared tokens that are model tokens in one sample only."""
    system = rng.integers(3, VOCAB, 6)
    tasks = [rng.integers(3, VOCAB, 4) for _ in range(2)]
    out = []
    for k in range(n):
        base = random_sample(rng, n_nodes=6, max_len=6, roots=1 + k % 2, k=k)
        prefix = np.concatenate([system, tasks[k % 2]]) if k % 3 else system
        root = base.nodes[0]
        pmask = np.zeros(len(prefix), np.uint8)
        if k == 1:
            pmask[-3:] = 1  # scored here, context in the others
        plogp = np.where(pmask > 0, -0.5, 0.0)
        nodes = [
            msgspec.structs.replace(
                root,
                token_ids=pack_ids(np.concatenate([prefix, unpack_ids(root.token_ids)])),
                logprobs=pack_f32(np.concatenate([plogp, unpack_f32(root.logprobs)])),
                loss_mask=pack_u8(np.concatenate([pmask, unpack_u8(root.loss_mask)])),
            ),
            *base.nodes[1:],
        ]
        out.append(msgspec.structs.replace(base, nodes=nodes, rollout_id=f"g-{k}-1"))
    out.append(msgspec.structs.replace(out[0], k=n, rollout_id=f"g-{n}-1", reward=0.25))
    bare = chain_sample(0, [3, 4], rng)
    bare.nodes[0] = TreeNode(parent=-1, token_ids=pack_ids(system))
    out.append(msgspec.structs.replace(bare, k=n + 1, rollout_id=f"g-{n + 1}-1", reward=0.5))
    return out


def scored_keys(sample: TreeSample, s: int) -> set[tuple[int, int, int]]:
    """(sample, node, offset) of every predictable loss-mask-1 token (from the expanded view)."""
    keys = set()
    for br in branches(sample):
        for t in range(1, len(br.token_ids)):
            if br.loss_mask[t]:
                keys.add((s, int(br.node_of[t]), int(br.offset_of[t])))
    return keys


def row_keys(packing) -> list[tuple[int, int, int]]:
    return [
        (int(s), int(n), int(o))
        for r in packing.rows
        for s, n, o in zip(r.sample_index, r.target_node, r.target_offset, strict=True)
    ]


@pytest.mark.parametrize("budget", [4096, 40, 17])
def test_every_scored_token_is_a_target_exactly_once(budget: int) -> None:
    """Across rows, each unique scored token is one target, even when trees are split."""
    rng = np.random.default_rng(budget)
    samples = [random_sample(rng, n_nodes=10, roots=1 + k % 2, k=k) for k in range(5)]
    packing = pack(samples, PackConfig(max_tokens=budget))
    keys = row_keys(packing)
    assert len(keys) == len(set(keys))
    assert set(keys) == set().union(*(scored_keys(s, i) for i, s in enumerate(samples)))
    st = packing.stats
    assert st.expanded_tokens == sum(len(b.token_ids) for s in samples for b in branches(s))
    assert st.target_tokens == len(keys) and st.unpredictable_tokens == 0
    assert st.computed_tokens == st.unique_tokens - st.shared_tokens + st.duplicated_tokens
    assert st.computed_tokens == sum(r.n_tokens for r in packing.rows)
    for r in packing.rows:
        assert r.n_tokens <= budget or st.over_budget_rows > 0


@pytest.mark.parametrize("budget", [4096, 40, 17])
def test_shared_prefixes_are_computed_once(budget: int) -> None:
    """Samples that start alike share their common tokens; every sample still gets each of
    its own scored tokens as one target, with its own mask and rollout log-prob."""
    rng = np.random.default_rng(10 + budget)
    samples = shared_samples(rng)
    shared = pack(samples, PackConfig(max_tokens=budget))
    alone = pack(samples, PackConfig(max_tokens=budget, share_prefixes=False))
    keys = row_keys(shared)
    assert len(keys) == len(set(keys))
    assert set(keys) == set(row_keys(alone))
    assert set(keys) == set().union(*(scored_keys(s, i) for i, s in enumerate(samples)))
    st = shared.stats
    assert st.unique_tokens == alone.stats.unique_tokens and alone.stats.shared_tokens == 0
    # at least the system prompt of every sample but one, and all of the exact copy
    copy = sum(len(unpack_ids(n.token_ids)) for n in samples[-2].nodes)
    assert st.shared_tokens >= 6 * (len(samples) - 1) + copy - 6
    assert st.computed_tokens == st.unique_tokens - st.shared_tokens + st.duplicated_tokens
    assert st.computed_tokens == sum(r.n_tokens for r in shared.rows)
    if budget == 4096:
        assert (
            st.computed_tokens == st.unique_tokens - st.shared_tokens < alone.stats.computed_tokens
        )
    # the exact copy is merged whole: its targets sit on the original's positions
    if budget == 4096:
        (row,) = shared.rows
        at = {}
        for s, n, o, pos in zip(
            row.sample_index, row.target_node, row.target_offset, row.target_pos, strict=True
        ):
            at[(int(s), int(n), int(o))] = int(pos)
        mine = {(n, o): pos for (s, n, o), pos in at.items() if s == len(samples) - 2}
        assert mine and mine == {(n, o): pos for (s, n, o), pos in at.items() if s == 0}


@pytest.mark.parametrize("share", [True, False])
def test_targets_and_positions_match_branches(share: bool) -> None:
    """Each target's id, source token, depth and rollout logp are those of the expanded branch."""
    rng = np.random.default_rng(1)
    samples = [random_sample(rng, n_nodes=12, roots=2, k=k) for k in range(3)]
    samples += shared_samples(rng)
    packing = pack(samples, PackConfig(max_tokens=30, share_prefixes=share))
    expect = {}
    for s, sample in enumerate(samples):
        for br in branches(sample):
            for t in range(1, len(br.token_ids)):
                key = (s, int(br.node_of[t]), int(br.offset_of[t]))
                expect[key] = (br.token_ids[t], br.token_ids[t - 1], t, br.logprobs[t])
    for r in packing.rows:
        for j in range(len(r.target_ids)):
            key = (int(r.sample_index[j]), int(r.target_node[j]), int(r.target_offset[j]))
            tid, prev, depth, lp = expect[key]
            assert r.target_ids[j] == tid == r.input_ids[r.target_pos[j]]
            assert r.input_ids[r.target_src[j]] == prev
            assert r.position_ids[r.target_pos[j]] == depth
            assert r.position_ids[r.target_src[j]] == depth - 1
            assert r.rollout_logp[j] == pytest.approx(lp)
            assert r.loss_mask[j] == 1.0  # only model tokens are targets by default


@pytest.mark.parametrize(("budget", "share"), [(4096, True), (30, True), (30, False)])
def test_baseline_src_is_the_state_before_the_reply(budget: int, share: bool) -> None:
    """Each target's ``baseline_src`` is, on its own path, the token just before the first
    token of the run of its sample's scored tokens it belongs to (brute force over the expanded
    branches): the context the reply started from. Trees split inside a reply, or merged with
    other samples, give the same state (a piece repeats its ancestor chain)."""
    rng = np.random.default_rng(7 + budget)
    samples = [random_sample(rng, n_nodes=12, roots=2, k=k) for k in range(3)]
    samples += shared_samples(rng)
    packing = pack(samples, PackConfig(max_tokens=budget, share_prefixes=share))
    expect: dict[tuple[int, int, int], tuple[int, int]] = {}
    for s, sample in enumerate(samples):
        for br in branches(sample):
            for t in range(1, len(br.token_ids)):
                if br.loss_mask[t]:
                    j = t
                    while j - 1 >= 0 and br.loss_mask[j - 1]:
                        j -= 1
                    d = max(j - 1, 0)
                    expect[(s, int(br.node_of[t]), int(br.offset_of[t]))] = (d, br.token_ids[d])
    inside, before_row = 0, 0
    for r in packing.rows:
        for j in range(len(r.target_ids)):
            key = (int(r.sample_index[j]), int(r.target_node[j]), int(r.target_offset[j]))
            depth, token = expect[key]
            b, t = int(r.baseline_src[j]), int(r.target_pos[j])
            assert r.position_ids[b] == depth and r.input_ids[b] == token
            assert b <= t < r.subtree_end[b]  # on the target's own path
            inside += depth < r.position_ids[t] - 1
            before_row += not any(
                int(r.target_pos[i]) == b + 1 and r.sample_index[i] == r.sample_index[j]
                for i in range(len(r.target_ids))
            )
    assert inside > 0  # some replies are longer than one token
    if budget == 30:
        assert packing.stats.split_trees > 0 and before_row > 0  # some reply starts are context
    batch = collate(packing.rows)
    width = batch.input_ids.shape[1]
    want = np.concatenate([r.baseline_src + k * width for k, r in enumerate(packing.rows)])
    assert batch.baseline_src.tolist() == want.tolist()


def test_tree_mask_is_ancestry() -> None:
    """Query i sees key j iff j is on i's root path (brute force over node parents)."""
    rng = np.random.default_rng(2)
    samples = [random_sample(rng, n_nodes=7, roots=2, k=k) for k in range(3)]
    packing = pack(samples, PackConfig(max_tokens=4096))
    assert packing.stats.rows == 1
    row = packing.rows[0]
    batch = collate([row], pad_to_multiple=16)
    mask = batch.attention_mask[0, 0]
    t = row.n_tokens
    # rebuild ancestry: a token's path = earlier tokens whose interval holds it
    ok = torch.isfinite(mask)
    for i in range(t):
        path = [j for j in range(i + 1) if row.subtree_end[j] > i]
        assert ok[i, :t].nonzero().flatten().tolist() == path
        assert row.position_ids[i] == len(path) - 1  # depth = ancestors on the path
    for i in range(t, mask.shape[0]):  # padding sees only itself
        assert ok[i].nonzero().flatten().tolist() == [i]


def test_dense_mask_block_diagonal() -> None:
    """Two chains in one row never see each other."""
    end = torch.tensor([[3, 3, 3, 5, 5]])
    m = torch.isfinite(dense_tree_mask(end, torch.float32))[0, 0]
    assert m.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_split_at_branch_points_counts_duplicates() -> None:
    """A tree over budget is split per branch; only the shared prefix is recomputed."""
    rng = np.random.default_rng(3)
    sample = chain_sample(20, [10, 10, 10, 10], rng)
    whole = pack([sample], PackConfig(max_tokens=60))
    assert whole.stats.duplicated_tokens == 0 and whole.stats.rows == 1
    assert whole.stats.unique_tokens == 60 and whole.stats.expanded_tokens == 120
    split = pack([sample], PackConfig(max_tokens=40))
    # piece 1: prefix + 2 branches (40); piece 2: prefix again + 2 branches
    assert split.stats.split_trees == 1
    assert split.stats.duplicated_tokens == 20
    assert split.stats.computed_tokens == 80
    assert all(r.n_tokens <= 40 for r in split.rows)


def test_unsplittable_chain_gets_its_own_row() -> None:
    """A chain longer than the budget is kept whole and counted over budget."""
    rng = np.random.default_rng(4)
    sample = chain_sample(30, [20], rng)
    packing = pack([sample], PackConfig(max_tokens=32))
    assert packing.stats.over_budget_rows == 1
    assert sum(len(r.target_ids) for r in packing.rows) == 20


def test_segment_first_token_is_unpredictable() -> None:
    """A scored token with nothing before it cannot be a target; it is counted instead."""
    sample = TreeSample(
        rollout_id="u-0-1",
        group_id="u",
        k=0,
        nodes=[
            TreeNode(
                parent=-1,
                token_ids=pack_ids([5, 6]),
                logprobs=pack_f32([-1.0, -1.0]),
                loss_mask=pack_u8([1, 1]),
            ),
            TreeNode(parent=-1, token_ids=pack_ids([]), loss_mask=b""),
            TreeNode(
                parent=1,
                token_ids=pack_ids([7, 8]),
                logprobs=pack_f32([-1.0, 0.0]),
                loss_mask=pack_u8([1, 0]),
            ),
        ],
    )
    packing = pack([sample], PackConfig(targets="all"))
    assert packing.stats.unpredictable_tokens == 2
    assert row_keys(packing) == [(0, 0, 1), (0, 2, 1)]


def test_small_trees_share_rows() -> None:
    rng = np.random.default_rng(5)
    samples = [chain_sample(5, [3, 3], rng) for _ in range(6)]
    packing = pack(samples, PackConfig(max_tokens=33))
    assert packing.stats.rows == 2
    assert packing.stats.duplicated_tokens == 0


# ---------------------------------------------------------------------------------------------
# count-once equivalence with a real model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_policy() -> Policy:
    policy = load_policy(
        "tiny-1m", attn_implementation="tree_sdpa", value_head=True, temperature=0.7
    )
    torch.manual_seed(0)
    with torch.no_grad():  # sharper than the near-uniform init, so gradients are not tiny
        for name, p in policy.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "value_head" in name:
                p.normal_(0.0, 0.5)
    return policy


def expanded_outputs(policy: Policy, samples: list[TreeSample]) -> dict:
    """Per-branch forwards with the model's own causal mask; the first branch owns a token."""
    out: dict[tuple[int, int, int], tuple] = {}
    for s, sample in enumerate(samples):
        for br in branches(sample):
            ids = torch.from_numpy(br.token_ids.astype(np.int64))[None]
            n = ids.shape[1]
            if n < 2:
                continue
            o = policy(ids, torch.arange(n)[None], None, torch.arange(n - 1), ids[0, 1:])
            for t in range(1, n):
                key = (s, int(br.node_of[t]), int(br.offset_of[t]))
                if br.loss_mask[t] and key not in out:
                    j = t  # the turn's baseline: V before the first token of t's scored run
                    while j - 1 >= 0 and br.loss_mask[j - 1]:
                        j -= 1
                    base = o.values[max(j - 1, 0)]
                    out[key] = (o.logprobs[t - 1], o.entropy[t - 1], o.values[t - 1], base)
    return out


def _loss(cfg: LossConfig, logp, ent, values, tg: dict, old, baselines=None) -> torch.Tensor:
    loss, _ = policy_loss(
        cfg,
        logp=logp,
        old_logp=old,
        entropy=ent,
        values=values,
        baselines=baselines,
        returns=tg["returns"],
        rollout_logp=tg["rollout_logp"],
        loss_mask=tg["loss_mask"],
        norm_weight=tg["norm_weight"],
        advantage=None if cfg.algo == "ppo" else tg["advantage"],
        sample_index=tg["sample_index"],
    )
    return loss


def _grads(policy: Policy) -> dict[str, torch.Tensor]:
    g = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize(
    ("seed", "attn", "algo", "budget", "shared"),
    [
        (0, "eager", "grpo", 4096, False),
        (1, "sdpa", "ppo", 4096, False),
        (2, "eager", "ppo", 24, False),
        (9, "eager", "ppo-turn", 24, False),
        (10, "tree_sdpa", "ppo-turn", 40, True),
        (3, "sdpa", "grpo", 24, False),
        (4, "tree_sdpa", "ppo", 4096, False),
        (5, "tree_sdpa", "grpo", 24, False),
        (6, "eager", "grpo", 4096, True),
        (7, "tree_sdpa", "ppo", 4096, True),
        (8, "sdpa", "ppo", 40, True),
    ],
)
def test_packed_equals_expanded_count_once(
    base_policy: Policy,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    attn: str,
    algo: str,
    budget: int,
    shared: bool,
) -> None:
    """Packed loss and gradients equal the branch-expanded count-once loss (fp32, 1e-5), also
    with prefixes shared across samples."""
    monkeypatch.setattr(policy_mod, "TREE_BLOCK", 8)  # small blocks: skipping really happens
    policy = base_policy
    policy.lm.set_attn_implementation(attn)
    policy.entropy_grad = True  # the loss below has an entropy bonus
    rng = np.random.default_rng(seed)
    if shared:
        samples = shared_samples(rng)
    else:
        samples = [random_sample(rng, n_nodes=7, max_len=8, roots=1 + k % 2, k=k) for k in range(4)]
    adv = rng.normal(size=len(samples)).astype(np.float32)
    cfg = LossConfig(
        algo="ppo" if algo == "ppo-turn" else algo,
        value_baseline="turn" if algo == "ppo-turn" else "token",
        norm="sequence" if budget < 100 else "token",
        entropy_coef=0.01,
    )
    packing = pack(samples, PackConfig(max_tokens=budget), advantages=adv)
    if budget < 100:
        assert packing.stats.duplicated_tokens > 0 and packing.stats.rows > 1
    assert (packing.stats.shared_tokens > 0) == shared

    batch = collate(packing.rows)
    out = policy(**batch.model_inputs())
    keys = row_keys(packing)
    assert len(keys) == len(set(keys))  # every scored token is one target, once
    ref = expanded_outputs(policy, samples)
    assert set(keys) == set(ref)
    # a fixed pi_old a little away from pi, per token, so ratios move and some clip
    old_of = {k: float(ref[k][0]) + float(rng.normal(0, 0.3)) for k in sorted(ref)}
    tg = {
        "returns": batch.returns,
        "rollout_logp": batch.rollout_logp,
        "loss_mask": batch.loss_mask,
        "advantage": batch.advantage,
        "sample_index": batch.sample_index,
        "norm_weight": torch.from_numpy(
            norm_weights(batch.sample_index.numpy(), batch.loss_mask.numpy(), cfg.norm)
        ),
    }
    old = torch.tensor([old_of[k] for k in keys])
    packed_loss = _loss(cfg, out.logprobs, out.entropy, out.values, tg, old, out.baselines)
    packed_loss.backward()
    g_packed = _grads(policy)

    # the expanded side from the branches alone: each scored token of each sample once, its
    # sample's reward, advantage and rollout log-prob, normalised over those tokens
    exp_keys = sorted(ref)
    s_idx = np.array([k[0] for k in exp_keys])
    node_lp = [[node_arrays(n)[1] for n in s.nodes] for s in samples]
    exp_tg = {
        "returns": torch.tensor([samples[s].reward for s, _, _ in exp_keys]),
        "rollout_logp": torch.tensor([float(node_lp[s][n][o]) for s, n, o in exp_keys]),
        "loss_mask": torch.ones(len(exp_keys)),
        "advantage": torch.from_numpy(adv[s_idx]),
        "sample_index": torch.from_numpy(s_idx),
        "norm_weight": torch.from_numpy(norm_weights(s_idx, np.ones(len(s_idx)), cfg.norm)),
    }
    logp, ent, val, base = (torch.stack([ref[k][i] for k in exp_keys]) for i in range(4))
    order = [keys.index(k) for k in exp_keys]
    torch.testing.assert_close(logp, out.logprobs.detach()[order], rtol=0, atol=1e-5)
    torch.testing.assert_close(val, out.values.detach()[order], rtol=0, atol=1e-5)
    torch.testing.assert_close(base, out.baselines.detach()[order], rtol=0, atol=1e-5)
    exp_old = torch.tensor([old_of[k] for k in exp_keys])
    exp_loss = _loss(cfg, logp, ent, val, exp_tg, exp_old, base)
    exp_loss.backward()
    g_exp = _grads(policy)

    assert abs(float(packed_loss.detach()) - float(exp_loss.detach())) < 1e-5
    assert g_packed.keys() == g_exp.keys()
    scale = max(float(g.abs().max()) for g in g_exp.values())
    assert scale > 1e-4  # the comparison is not vacuous
    for name in g_exp:  # absolute, and relative to the largest gradient entry
        torch.testing.assert_close(g_packed[name], g_exp[name], rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(g_packed[name] / scale, g_exp[name] / scale, rtol=0, atol=1e-5)
