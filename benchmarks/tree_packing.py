"""Tree packing vs branch expansion: tokens computed and forward+backward step time.

Workload: rollouts with 4 branches whose shared prefix is 80% of each branch (a long agent
context, then 4 different continuations). Packed: each tree in one row with the tree mask, every
unique token computed once. Baseline, same run: every root-to-leaf branch as its own sequence
(what a learner without packing runs), through the model's own causal attention. Both score the
same model tokens (count-once for packed; the baseline scores shared model tokens once per
branch, as a plain per-branch learner would) and run one row per forward on fp32 CPU: packed rows
with ``tree_sdpa`` (sdpa over only the key blocks the tree mask allows), branches with sdpa's own
causal kernel.
Layouts are timed interleaved rollout by rollout; the speedup is the median over rounds of the
same-round time ratio, and the table also shows each layout's best round (shared machines are
noisy; one intra-op thread). Without ``--quick`` a second baseline runs the branches through
the same float-mask path as packing (same kernel, same code).

Targets: computed tokens / unique tokens <= 1.05; step-time speedup >= 0.7 x the token
reduction (expanded tokens / computed tokens).

Second workload, **prefixes shared across samples** (``PackConfig.share_prefixes``): a batch of
chain rollouts that all start with the same harness system prompt and tools (as every rollout of
one harness does; the demo's reference harness prompt is ~570 tokens), each followed by its own
task and turns. Shared: the batch merged into one forest, the prompt computed once; baseline,
same run: each sample laid out on its own (``share_prefixes=False``), same kernel. Target: step
speedup >= 0.7 x the token reduction.

    python -m benchmarks.tree_packing [--quick]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks._common import parse_args, print_table, target, write_result


def make_rollout(rng: Any, prefix: int, suffix: int, branches: int, k: int) -> Any:
    """A prompt + alternating model/tool turns as the shared prefix, then ``branches`` model
    continuations of ``suffix`` tokens."""
    import numpy as np

    from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8

    def node(parent: int, n: int, model: bool) -> TreeNode:
        return TreeNode(
            parent=parent,
            token_ids=pack_ids(rng.integers(3, 8000, n)),
            logprobs=pack_f32(np.full(n, -2.0) if model else np.zeros(n)),
            loss_mask=pack_u8(np.full(n, int(model))),
            weight_version=0,
        )

    turn = prefix // 4
    nodes = [node(-1, prefix - 3 * turn, False)]  # prompt
    for model in (True, False, True):
        nodes.append(node(len(nodes) - 1, turn, model))
    trunk = len(nodes) - 1
    nodes += [node(trunk, suffix, True) for _ in range(branches)]
    return TreeSample(rollout_id=f"b-{k}-1", group_id="b", k=k, reward=float(k % 2), nodes=nodes)


def as_branches(samples: list[Any]) -> list[Any]:
    """Each root-to-leaf branch as its own one-chain sample."""
    from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8
    from harnessrl.common.tree import expand as branches

    out = []
    for s in samples:
        for b in branches(s):
            chain = TreeNode(
                parent=-1,
                token_ids=pack_ids(b.token_ids),
                logprobs=pack_f32(b.logprobs),
                loss_mask=pack_u8(b.loss_mask),
            )
            out.append(TreeSample(rollout_id=s.rollout_id, group_id="b", k=s.k, nodes=[chain]))
    return out


def run_once(policy: Any, batches: list[Any], causal: bool) -> float:
    """Seconds of forward+backward over all ``batches`` (one row each)."""
    t0 = time.perf_counter()
    for b in batches:
        inputs = b.model_inputs()
        if causal:  # the model's own causal attention (sdpa is_causal), no custom mask
            inputs["attention_mask"] = None
        out = policy(**inputs)
        (-(out.logprobs * b.loss_mask).sum() / len(b.loss_mask)).backward()
    dt = time.perf_counter() - t0
    policy.zero_grad(set_to_none=True)
    return dt


def step_times(
    policy: Any, layouts: dict[str, tuple[list[list[Any]], bool]], reps: int
) -> dict[str, list[float]]:
    """Per round, forward+backward seconds of each layout over all rollouts.

    Layouts are interleaved rollout by rollout (packed rows of rollout 0, its branches, ...,
    then rollout 1), so load from other processes on a shared machine hits every layout alike;
    one warm-up round is discarded."""
    names = list(layouts)
    n_rollouts = len(layouts[names[0]][0])
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 1):
        round_t = dict.fromkeys(names, 0.0)
        for r in range(n_rollouts):
            for name in names:
                groups, causal = layouts[name]
                round_t[name] += run_once(policy, groups[r], causal)
        if rep:
            for name in names:
                times[name].append(round_t[name])
    return times


def make_chain(rng: Any, system: Any, own: int, k: int) -> Any:
    """One linear rollout: the shared ``system`` prompt, then ``own`` tokens of its own
    (task prompt, model turns and tool results alternating)."""
    import numpy as np

    from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8

    ids = np.concatenate([system, rng.integers(3, 8000, own)])
    mask = np.zeros(len(ids), np.uint8)
    turn = own // 6
    for start in range(len(system) + turn, len(ids), 2 * turn):  # every other turn is a reply
        mask[start : start + turn] = 1
    node = TreeNode(
        parent=-1,
        token_ids=pack_ids(ids),
        logprobs=pack_f32(np.where(mask > 0, -2.0, 0.0)),
        loss_mask=pack_u8(mask),
    )
    return TreeSample(rollout_id=f"s-{k}-1", group_id="s", k=k, nodes=[node])


def shared_prefix(args: Any, policy: Any) -> dict[str, Any]:
    """Step time of a batch that shares a system prompt, merged vs laid out per sample."""
    import numpy as np

    from harnessrl.learner.packing import PackConfig, collate, pack

    n, system_len, own, reps = (8, 576, 320, 3) if not args.quick else (6, 384, 160, 2)
    rng = np.random.default_rng(1)
    system = rng.integers(3, 8000, system_len)
    samples = [make_chain(rng, system, own, k) for k in range(n)]
    budget = 8192
    merged = pack(samples, PackConfig(max_tokens=budget))
    alone = pack(samples, PackConfig(max_tokens=budget, share_prefixes=False))
    assert merged.stats.shared_tokens == (n - 1) * system_len
    layouts = {
        "shared": ([[collate(merged.rows)]], False),
        "per_sample": ([[collate(alone.rows)]], False),
    }
    t = step_times(policy, layouts, reps)
    speedup = statistics.median(a / m for a, m in zip(t["per_sample"], t["shared"], strict=True))
    reduction = alone.stats.computed_tokens / merged.stats.computed_tokens
    print_table(
        f"shared prefix: {n} rollouts, system prompt {system_len} + {own} own tokens each",
        [
            ("merged (share_prefixes)", merged.stats.computed_tokens, f"{min(t['shared']):.3f}"),
            ("per sample", alone.stats.computed_tokens, f"{min(t['per_sample']):.3f}"),
        ],
        ("layout", "tokens computed", "best fwd+bwd s"),
    )
    print(f"token reduction {reduction:.2f}x  speedup {speedup:.2f}x")
    return {
        "rollouts": n,
        "system_tokens": system_len,
        "own_tokens": own,
        "computed_tokens": merged.stats.computed_tokens,
        "baseline_computed_tokens": alone.stats.computed_tokens,
        "token_reduction": reduction,
        "step_speedup": speedup,
        "shared_step_s_rounds": t["shared"],
        "per_sample_step_s_rounds": t["per_sample"],
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import numpy as np
    import torch

    from harnessrl.learner.packing import PackConfig, collate, pack
    from harnessrl.learner.policy import load_policy

    torch.manual_seed(0)
    torch.set_num_threads(1)  # on shared CPUs a second intra-op thread mostly waits at barriers
    if args.quick:
        model, n_rollouts, prefix, suffix, reps = "tiny-8m", 2, 512, 128, 3
    else:
        model, n_rollouts, prefix, suffix, reps = "tiny-8m", 2, 1024, 256, 4
    rng = np.random.default_rng(0)
    samples = [make_rollout(rng, prefix, suffix, 4, k) for k in range(n_rollouts)]
    tree_len, branch_len = prefix + 4 * suffix, prefix + suffix  # one tree / one branch per row
    packing = pack(samples, PackConfig(max_tokens=tree_len))
    expanded = pack(as_branches(samples), PackConfig(max_tokens=branch_len))
    st = packing.stats
    assert expanded.stats.computed_tokens == st.expanded_tokens
    assert expanded.stats.rows == 4 * n_rollouts and st.rows == n_rollouts
    packed_groups = [
        [collate([r]) for r in pack([s], PackConfig(max_tokens=tree_len)).rows] for s in samples
    ]
    branch_groups = [
        [collate([r]) for r in pack(as_branches([s]), PackConfig(max_tokens=branch_len)).rows]
        for s in samples
    ]

    policy = load_policy(model, attn_implementation="tree_sdpa")
    layouts = {"packed": (packed_groups, False), "expanded": (branch_groups, True)}
    if not args.quick:  # the same-kernel baseline: branches through the float-mask path
        layouts["expanded_mask"] = (branch_groups, False)
    t = step_times(policy, layouts, reps)
    shared = shared_prefix(args, policy)

    def speedup_of(name: str) -> float:  # median over rounds of the same-round ratio
        return statistics.median(e / p for e, p in zip(t[name], t["packed"], strict=True))

    computed_over_unique = st.computed_tokens / st.unique_tokens
    reduction = expanded.stats.computed_tokens / st.computed_tokens
    speedup = speedup_of("expanded")
    labels = {"expanded": "expanded (causal)", "expanded_mask": "expanded (float mask)"}
    rows = [
        (
            "packed (tree mask)",
            st.computed_tokens,
            len(packing.rows),
            f"{min(t['packed']):.3f}",
            "1.00",
        )
    ]
    rows += [
        (
            label,
            expanded.stats.computed_tokens,
            len(expanded.rows),
            f"{min(t[k]):.3f}",
            f"{speedup_of(k):.2f}",
        )
        for k, label in labels.items()
        if k in t
    ]
    print_table(
        f"tree packing: {model}, {n_rollouts} rollouts x 4 branches, prefix {prefix} + {suffix}",
        rows,
        ("layout", "tokens computed", "rows", "best fwd+bwd s", "packed speedup (median)"),
    )
    targets = {
        "computed_over_unique": target(computed_over_unique, 1.05, at_least=False),
        "speedup_over_0.7x_reduction": target(speedup / (0.7 * reduction), 1.0),
        "shared_prefix_speedup_over_0.7x_reduction": target(
            shared["step_speedup"] / (0.7 * shared["token_reduction"]), 1.0
        ),
    }
    print(
        f"\ncomputed/unique {computed_over_unique:.3f}  token reduction {reduction:.2f}x  "
        f"speedup {speedup:.2f}x  (target >= {0.7 * reduction:.2f}x)"
    )
    ratios = {
        "computed_over_unique": computed_over_unique,
        "token_reduction": reduction,
        "step_speedup": speedup,
        "shared_prefix_token_reduction": shared["token_reduction"],
        "shared_prefix_step_speedup": shared["step_speedup"],
    }
    if "expanded_mask" in t:
        ratios["step_speedup_vs_float_mask_baseline"] = speedup_of("expanded_mask")
    path = write_result(
        "tree_packing",
        metrics={
            "model": model,
            "rollouts": n_rollouts,
            "prefix_tokens": prefix,
            "suffix_tokens": suffix,
            "unique_tokens": st.unique_tokens,
            "computed_tokens": st.computed_tokens,
            "packed_step_s": min(t["packed"]),
            "packed_step_s_rounds": t["packed"],
            "pack_stats": st.as_dict(),
            "shared_prefix": shared,
        },
        baseline={
            "layout": "every branch its own sequence, model's causal attention (sdpa)",
            "computed_tokens": expanded.stats.computed_tokens,
            "expanded_step_s": min(t["expanded"]),
            "expanded_step_s_rounds": t["expanded"],
            "expanded_float_mask_step_s_rounds": t.get("expanded_mask"),
        },
        targets=targets,
        ratios=ratios,
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
