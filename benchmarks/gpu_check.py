"""GPU check: harnessrl's model-running parts on one GPU, in one command, in under 4 minutes.

What it checks (each a row of one pass/fail table with its time; JSON in
``benchmarks/results/gpu_check.json``):

* ``tree_attention``: the learner's packed tree forward with FlexAttention (a ``BlockMask``
  built from the tree's ancestry intervals) equals the same rows through SDPA with the dense
  tree mask and a plain causal forward of every root-to-leaf branch (fp32; log-probs and
  gradients). Where FlexAttention is not available (the CPU), the block-sparse ``tree_sdpa``
  stands in for it.
* ``engine``: the embedded engine (``harnessrl engine``, SGLang's API) on CUDA serves a GRPO
  group of tree-shaped rollouts (a shared prompt, two branches each, one continuing after
  environment tokens) with log-probs; each sampled token's log-prob equals a separate forward
  of the model on the same device.
* ``learner``: those rollouts packed as trees, one GRPO step of the DeepSpeed learner on CUDA
  (bf16, ZeRO-2, FlexAttention): its log-probs on the rollout tokens match the engine's
  (bf16 against fp32), the loss and gradient norm are finite, the weights move.
* ``weights``: the learner's new weights reach the engine by the path a run uses (``stream``:
  safetensors chunks on the bus, a ``WeightUpdater`` writes the folder and calls the engine's
  ``/update_weights_from_disk`` with the version; the bus is the in-memory one): the engine
  reports the version, holds exactly the broadcast tensors, and its log-probs equal an fp32
  forward of them (and differ from the old weights'). NCCL transfer needs two GPUs: not here.

One command on a GPU machine (no network, no bubblewrap; the checkout plus ``.gpu-check``)::

    python -m benchmarks.gpu_check --wheels .gpu-check

``.gpu-check`` is prepared here first (network; about 40 MB, gitignored)::

    python -m benchmarks.gpu_check --prepare .gpu-check

It holds the wheels of what such a machine lacks, the versions installed here: pydantic,
pydantic-core, annotated-types, typing-inspection, typing-extensions (used when the machine's
is older), msgspec, xxhash, zstandard, tomli-w, deepspeed (built here as a pure-Python wheel,
``DS_BUILD_OPS=0``) and its dependencies hjson, py-cpuinfo, ninja, einops and psutil; binary
ones for CPython 3.10-3.13 on x86-64 Linux. The machine is expected to have torch (2.11 was
lent), transformers, triton, numpy, aiohttp, uvloop, msgpack and prometheus-client. Only the
missing wheels are installed, into ``.gpu-check/site-pyXY`` (``pip --no-index --no-deps
--target``; unzipped when there is no pip); ``harnessrl`` is imported from the checkout
without installing it. ``.gpu-check/cache`` holds the model (``tiny-1m``, built offline; it
is rebuilt in ~20 s if the machine's libraries want another build).

With the device tool: ``run(command="python -m benchmarks.gpu_check --wheels .gpu-check",
carry=[".gpu-check"], timeout_s=300)``.

Here and in CI: ``--cpu`` runs the same checks on the CPU (engine fp32, DeepSpeed on gloo,
``tree_sdpa`` for FlexAttention); ``--quick`` implies ``--cpu`` when there is no GPU. CPU
results go to ``benchmarks/results/quick/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import _common, _gpu_env

NAME = "gpu_check"
BUDGET_S = 240.0
"""The whole check, start-up included, must fit in a GPU machine's lease."""
LEARNER_BF16_MEAN = 0.05
"""Largest mean |learner - engine| log-prob on rollout tokens (bf16 learner, fp32 engine)."""
LEARNER_BF16_MAX = 0.5
ENGINE_TOL = {"cpu": 1e-4, "cuda": 2e-3}
"""Engine log-probs against a separate forward of the same weights on the same device (fp32)."""
TREE_TOL = {"cpu": 1e-5, "cuda": 1e-4}
"""Tree attention against per-branch causal forwards (fp32 log-probs)."""


@dataclass
class Result:
    name: str
    ok: bool = False
    seconds: float = 0.0
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    device: str
    model: str
    engine_dtype: str
    work: Path
    results: list[Result] = field(default_factory=list)
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    server: Any = None
    client: Any = None
    reference: Any = None
    learner: Any = None


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _seq_logprobs(model: Any, prompt: list[int], out: list[int], device: str) -> Any:
    """log p(out[i] | prompt + out[:i]) under ``model`` (fp32 log-softmax of its logits)."""
    import torch

    ids = torch.tensor([prompt + out], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return lp.gather(1, torch.tensor(out, device=device)[:, None])[:, 0].cpu()


def _ids(rng: Any, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(3, vocab - 1, n)]


# ---------------------------------------------------------------------------------------------
# tree attention
# ---------------------------------------------------------------------------------------------


def _tree_samples(vocab: int, n: int = 6) -> list[Any]:
    """Random trees: a prompt, branches of model and environment turns (loss mask 1 / 0)."""
    import numpy as np

    from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8

    rng = np.random.default_rng(7)
    out = []
    for k in range(n):
        nodes = [TreeNode(parent=-1, token_ids=pack_ids(rng.integers(3, vocab, 20)))]
        for _ in range(int(rng.integers(2, 5))):
            parent = int(rng.integers(0, len(nodes)))
            for model_turn in (True, False):
                m = int(rng.integers(3, 14))
                nodes.append(
                    TreeNode(
                        parent=parent,
                        token_ids=pack_ids(rng.integers(3, vocab, m)),
                        logprobs=pack_f32(np.full(m, -9.0 if model_turn else 0.0)),
                        loss_mask=pack_u8(np.full(m, int(model_turn))),
                        weight_version=0,
                    )
                )
                parent = len(nodes) - 1
        out.append(TreeSample(rollout_id=f"t-{k}-1", group_id="t", k=k, reward=0.0, nodes=nodes))
    return out


def check_tree_attention(ctx: Ctx) -> Result:
    import numpy as np
    import torch

    from harnessrl.common.tree import expand
    from harnessrl.learner import policy as policy_mod
    from harnessrl.learner.packing import PackConfig, collate, pack
    from harnessrl.learner.policy import load_policy

    res = Result("tree_attention")
    dev = ctx.device
    policy = load_policy(ctx.model, dtype="float32", device=dev, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.no_grad():  # sharper than the init, so log-probs and gradients are not flat
        for p in policy.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    vocab = int(policy.lm.config.get_text_config().vocab_size)
    samples = _tree_samples(vocab)
    packing = pack(samples, PackConfig(max_tokens=512), advantages=np.zeros(len(samples)))
    rows = packing.rows
    flex = dev.startswith("cuda")
    if flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
        except ImportError:
            flex = False
    kernel = "flex_attention" if flex else policy_mod.TREE_SDPA
    if not flex:
        policy_mod._register_tree_sdpa()

    def run(attn: str, use_flex: bool) -> tuple[Any, dict[str, Any], float]:
        policy.lm.set_attn_implementation(attn)
        batch = collate(rows, device=dev, flex=use_flex)
        policy.zero_grad(set_to_none=True)
        _sync(dev)
        t0 = time.perf_counter()
        logp = policy(**batch.model_inputs()).logprobs
        logp.sum().backward()
        _sync(dev)
        dt = time.perf_counter() - t0
        grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
        return logp.detach(), grads, dt

    first = time.perf_counter()
    tree, g_tree, _ = run(kernel, flex)  # first call: compiles FlexAttention on CUDA
    res.values["first_call_s"] = round(time.perf_counter() - first, 2)
    tree, g_tree, t_tree = run(kernel, flex)
    dense, g_dense, t_dense = run("sdpa", False)
    # the reference: each root-to-leaf branch alone through plain causal attention
    policy.lm.set_attn_implementation("sdpa")
    ref: dict[tuple[int, int, int], float] = {}
    with torch.no_grad():
        for s, sample in enumerate(samples):
            for br in expand(sample):
                ids = torch.from_numpy(br.token_ids.astype(np.int64)).to(dev)[None]
                n = ids.shape[1]
                pos = torch.arange(n, device=dev)[None]
                o = policy(ids, pos, None, torch.arange(n - 1, device=dev), ids[0, 1:])
                for t in range(1, n):
                    key = (s, int(br.node_of[t]), int(br.offset_of[t]))
                    if br.loss_mask[t]:
                        ref.setdefault(key, float(o.logprobs[t - 1]))
    keys = [
        (int(s), int(nd), int(off))
        for r in rows
        for s, nd, off in zip(r.sample_index, r.target_node, r.target_offset, strict=True)
    ]
    want = torch.tensor([ref[k] for k in keys], dtype=torch.float32)
    d_tree = float((tree.cpu() - want).abs().max())
    d_dense = float((dense.cpu() - want).abs().max())
    g_rel = max(
        float((g_tree[n] - g_dense[n]).abs().max() / (g_dense[n].abs().max() + 1e-12))
        for n in g_dense
    )
    tol = TREE_TOL["cuda" if dev.startswith("cuda") else "cpu"]
    res.values.update(
        {
            "kernel": kernel,
            "rows": len(rows),
            "targets": len(keys),
            "max_dlogp_tree_vs_branches": d_tree,
            "max_dlogp_sdpa_vs_branches": d_dense,
            "max_rel_dgrad_tree_vs_sdpa": g_rel,
            "tree_fwd_bwd_s": round(t_tree, 4),
            "sdpa_fwd_bwd_s": round(t_dense, 4),
            "tol": tol,
        }
    )
    res.ok = d_tree <= tol and d_dense <= tol and g_rel <= 1e-3 and len(keys) == len(ref)
    res.detail = (
        f"{kernel} vs branches {d_tree:.1e}, sdpa vs branches {d_dense:.1e} (tol {tol:g}); "
        f"grads rel {g_rel:.1e}; {len(keys)} targets in {len(rows)} rows"
    )
    return res


# ---------------------------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------------------------


async def check_engine(ctx: Ctx, stack: contextlib.AsyncExitStack) -> Result:
    import numpy as np

    from harnessrl.common.models import load_model, resolve_model
    from harnessrl.proxy.config import EngineConfig
    from harnessrl.proxy.engine import EngineServer
    from harnessrl.proxy.sglang import EngineClient

    res = Result("engine")
    folder = resolve_model(ctx.model)
    cfg = EngineConfig(
        model=str(folder),
        port=0,
        device=ctx.device,
        dtype=ctx.engine_dtype,
        threads=2 if ctx.device == "cpu" else 0,
        prefix_cache_mb=64,
    )
    t0 = time.perf_counter()
    ctx.server = await stack.enter_async_context(EngineServer(cfg))
    ctx.client = await stack.enter_async_context(EngineClient(ctx.server.url))
    res.values["load_s"] = round(time.perf_counter() - t0, 2)
    res.values["lean_forward"] = ctx.server.engine.lean is not None
    vocab = ctx.server.engine.vocab_size
    rng = np.random.default_rng(11)
    prompt = _ids(rng, 24, vocab)
    env = _ids(rng, 6, vocab)
    group = 4

    async def gen(ids: list[int], seed: int, n: int) -> Any:
        sp = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}
        return await ctx.client.generate(ids, sp, key=f"r{seed}")

    t0 = time.perf_counter()
    firsts = await asyncio.gather(*(gen(prompt, 2 * k, 16) for k in range(group)))
    others = await asyncio.gather(*(gen(prompt, 2 * k + 1, 16) for k in range(group)))
    seconds = await asyncio.gather(
        *(gen(prompt + f.output_ids + env, 100 + k, 12) for k, f in enumerate(firsts))
    )
    res.values["generate_s"] = round(time.perf_counter() - t0, 3)
    calls = [*firsts, *others, *seconds]
    ctx.rollouts = [
        {"a": a, "b": b, "a2": a2, "prompt": prompt, "env": env, "k": k}
        for k, (a, b, a2) in enumerate(zip(firsts, others, seconds, strict=True))
    ]
    shape_ok = all(
        len(c.output_ids) == len(c.logprobs) > 0
        and c.finish_reason == "length"
        and c.weight_version_end == 0
        and all(lp <= 0 for lp in c.logprobs)
        for c in calls
    )
    ctx.reference = load_model(folder, dtype="float32", device=ctx.device)
    worst = 0.0
    for r in ctx.rollouts:
        for ids, c in (
            (prompt, r["a"]),
            (prompt, r["b"]),
            (prompt + r["a"].output_ids + env, r["a2"]),
        ):
            want = _seq_logprobs(ctx.reference, ids, c.output_ids, ctx.device)
            got = np.asarray(c.logprobs, dtype=np.float32)
            worst = max(worst, float(np.abs(want.numpy() - got).max()))
    cached = sum(c.cached_tokens for c in calls)
    tol = ENGINE_TOL["cuda" if ctx.device.startswith("cuda") else "cpu"]
    res.values.update(
        {
            "calls": len(calls),
            "tokens": sum(len(c.output_ids) for c in calls),
            "cached_tokens": cached,
            "max_dlogp_vs_forward": worst,
            "tol": tol,
        }
    )
    res.ok = shape_ok and worst <= (tol if ctx.engine_dtype == "float32" else 0.1)
    res.detail = (
        f"{len(calls)} calls ({ctx.engine_dtype}, lean forward "
        f"{'on' if res.values['lean_forward'] else 'off'}), log-probs vs a forward "
        f"{worst:.1e} (tol {tol:g}), {cached} prompt tokens from the prefix cache"
    )
    return res


# ---------------------------------------------------------------------------------------------
# learner
# ---------------------------------------------------------------------------------------------


def _rollout_samples(ctx: Ctx) -> list[Any]:
    """The engine's rollouts as TreeSamples: prompt -> [a -> env -> a2], [b]."""
    import numpy as np

    from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8

    def node(parent: int, ids: list[int], lps: list[float] | None) -> Any:
        n = len(ids)
        model = lps is not None
        return TreeNode(
            parent=parent,
            token_ids=pack_ids(np.asarray(ids)),
            logprobs=pack_f32(np.asarray(lps if model else np.zeros(n), np.float32)),
            loss_mask=pack_u8(np.full(n, int(model))),
            weight_version=0,
        )

    out = []
    for r in ctx.rollouts:
        a, b, a2 = r["a"], r["b"], r["a2"]
        nodes = [
            node(-1, r["prompt"], None),
            node(0, a.output_ids, a.logprobs),
            node(1, r["env"], None),
            node(2, a2.output_ids, a2.logprobs),
            node(0, b.output_ids, b.logprobs),
        ]
        k = r["k"]
        out.append(
            TreeSample(rollout_id=f"g-{k}-1", group_id="g", k=k, reward=float(k % 2), nodes=nodes)
        )
    return out


def check_learner(ctx: Ctx) -> Result:
    import numpy as np
    import torch

    from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
    from harnessrl.learner.losses import LossConfig, group_advantages
    from harnessrl.learner.packing import PackConfig, pack

    res = Result("learner")
    if not ctx.rollouts:
        res.detail = "no rollouts: the engine check failed"
        return res
    cfg = DeepSpeedConfig(zero_stage=2, dtype="bfloat16", lr=1e-3, micro_batch_rows=2)
    t0 = time.perf_counter()
    learner = ctx.learner = LearnerEngine(ctx.model, cfg, LossConfig(algo="grpo"))
    res.values["init_s"] = round(time.perf_counter() - t0, 2)
    samples = _rollout_samples(ctx)
    adv, _ = group_advantages([s.group_id for s in samples], [s.reward for s in samples])
    packing = pack(samples, PackConfig(max_tokens=256), advantages=adv)
    rows = packing.rows
    old = learner.logprobs(rows)
    scored = np.concatenate([r.loss_mask for r in rows]) > 0
    d = np.abs(np.concatenate(old) - np.concatenate([r.rollout_logp for r in rows]))[scored]
    before = {n: p.detach().float().clone() for n, p in learner.policy.lm.named_parameters()}
    t0 = time.perf_counter()
    m = learner.train_step(rows)
    _sync(ctx.device)
    step_s = time.perf_counter() - t0
    moved = sum(
        not torch.equal(before[n], p.detach().float())
        for n, p in learner.policy.lm.named_parameters()
    )
    finite = all(np.isfinite(v) for k, v in m.items() if isinstance(v, float))
    res.values.update(
        {
            "attn": "flex_attention" if learner.flex else "tree_sdpa",
            "zero_stage": 2,
            "dtype": "bfloat16",
            "rows": len(rows),
            "shared_tokens": int(packing.stats.shared_tokens),
            "scored_tokens": int(scored.sum()),
            "mean_dlogp_vs_engine": float(d.mean()),
            "max_dlogp_vs_engine": float(d.max()),
            "loss": float(m.get("loss/pg", m.get("loss", float("nan")))),
            "grad_norm": float(m["grad_norm"]),
            "params_moved": int(moved),
            "step_s": round(step_s, 3),
        }
    )
    res.ok = (
        finite
        and m["grad_norm"] > 0
        and moved > 0
        and d.mean() <= LEARNER_BF16_MEAN
        and d.max() <= LEARNER_BF16_MAX
    )
    res.detail = (
        f"GRPO step, ZeRO-2 bf16, {res.values['attn']}: {len(rows)} row(s), "
        f"{int(scored.sum())} scored tokens; vs engine log-probs mean {d.mean():.1e} "
        f"max {d.max():.1e}; grad norm {m['grad_norm']:.3g}; {moved} tensors moved"
    )
    return res


# ---------------------------------------------------------------------------------------------
# weights: learner -> bus -> updater -> engine
# ---------------------------------------------------------------------------------------------


async def check_weights(ctx: Ctx) -> Result:
    import numpy as np
    import torch

    from harnessrl.common.bus import connect
    from harnessrl.common.models import load_model, resolve_model
    from harnessrl.learner.config import BroadcastConfig
    from harnessrl.learner.packing import PackConfig, pack
    from harnessrl.learner.weights import make_publisher
    from harnessrl.proxy.weights_sync import WeightUpdater, durable_name, engine_apply

    res = Result("weights")
    if ctx.learner is None or ctx.server is None:
        res.detail = "needs the engine and the learner"
        return res
    learner, client, srv = ctx.learner, ctx.client, ctx.server
    folder = resolve_model(ctx.model)
    bus = await connect("memory://gpucheck", "gpucheck")
    try:
        publisher = make_publisher(  # what LearnerService._publisher builds for transport stream
            BroadcastConfig(transport="stream"),
            bus,
            model_dir=folder,
            config_json=learner.policy.lm.config.to_json_string(),
            dtype="bfloat16",
            default_disk_dir=ctx.work / "weights",
        )
        updater = WeightUpdater(
            bus,
            engine_apply(client),
            ctx.work / "sync",
            durable=durable_name(srv.url),
            applied_version=0,
            base_model=folder,
        )
        await updater.start()
        t0 = time.perf_counter()
        state = await asyncio.to_thread(learner.state_dict_for_broadcast, torch.bfloat16)
        await publisher.publish(1, learner.global_steps, state)
        applied = await updater.poll(timeout=30.0)
        sync_s = time.perf_counter() - t0
    finally:
        await bus.close()
    version = await client.weight_version()
    params = srv.engine._params
    exact = all(torch.equal(params[n].detach().to("cpu", t.dtype), t) for n, t in state.items())
    prompt = ctx.rollouts[0]["prompt"] if ctx.rollouts else [5, 6, 7, 8]
    sp = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    after = await client.generate(prompt, sp)
    got = np.asarray(after.logprobs, np.float32)
    fresh = load_model(folder, dtype="float32", device=ctx.device)
    fresh.load_state_dict({n: t.float() for n, t in state.items()}, strict=False)
    fresh.tie_weights()
    want_new = _seq_logprobs(fresh, prompt, after.output_ids, ctx.device).numpy()
    want_old = _seq_logprobs(ctx.reference, prompt, after.output_ids, ctx.device).numpy()
    d_new = float(np.abs(got - want_new).max())
    d_old = float(np.abs(got - want_old).max())
    # and the learner's own (bf16) log-probs of the same tokens
    from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8

    n = len(after.output_ids)
    chain = TreeSample(
        rollout_id="w-0-1",
        group_id="w",
        k=0,
        reward=0.0,
        nodes=[
            TreeNode(parent=-1, token_ids=pack_ids(np.asarray(prompt))),
            TreeNode(
                parent=0,
                token_ids=pack_ids(np.asarray(after.output_ids)),
                logprobs=pack_f32(got),
                loss_mask=pack_u8(np.ones(n, np.uint8)),
                weight_version=1,
            ),
        ],
    )
    (row,) = pack([chain], PackConfig(max_tokens=256), advantages=np.zeros(1)).rows
    d_learner = float(np.abs(learner.logprobs([row])[0] - got).max())
    tol = ENGINE_TOL["cuda" if ctx.device.startswith("cuda") else "cpu"]
    res.values.update(
        {
            "transport": "stream",
            "applied_version": applied,
            "engine_version": version,
            "tensors": len(state),
            "bytes": int(sum(t.numel() * t.element_size() for t in state.values())),
            "exact_tensors": exact,
            "max_dlogp_vs_new_forward": d_new,
            "max_dlogp_vs_old_forward": d_old,
            "max_dlogp_vs_learner_bf16": d_learner,
            "sync_s": round(sync_s, 3),
        }
    )
    res.ok = (
        applied == 1
        and version == 1
        and exact
        and d_new <= tol
        and d_old > 10 * tol
        and d_learner <= LEARNER_BF16_MAX
    )
    res.detail = (
        f"version 1 applied in {sync_s:.2f}s ({len(state)} tensors, exact: {exact}); engine vs "
        f"new weights {d_new:.1e} (tol {tol:g}), vs old {d_old:.1e}, vs learner bf16 "
        f"{d_learner:.1e}"
    )
    return res


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


async def _timed(ctx: Ctx, fn: Any, *args: Any) -> Result:
    t0 = time.perf_counter()
    try:
        out = fn(ctx, *args)
        res = await out if asyncio.iscoroutine(out) else out
    except Exception as e:  # one check's failure is a row, not the end of the run
        name = fn.__name__.removeprefix("check_")
        tb = traceback.format_exc().strip().splitlines()
        res = Result(name, False, detail=f"{type(e).__name__}: {e}"[:400])
        res.values["traceback"] = tb[-25:]
    res.seconds = round(time.perf_counter() - t0, 2)
    res.ok = bool(res.ok)
    res.values = json.loads(json.dumps(res.values, default=_plain))
    ctx.results.append(res)
    print(f"  {res.name:<15} {'PASS' if res.ok else 'FAIL'} {res.seconds:7.1f}s", flush=True)
    return res


def _plain(x: Any) -> Any:
    """numpy scalars and the like, for JSON."""
    return x.item() if hasattr(x, "item") else str(x)


async def run_checks(ctx: Ctx) -> None:
    async with contextlib.AsyncExitStack() as stack:
        await _timed(ctx, check_tree_attention)
        await _timed(ctx, check_engine, stack)
        await _timed(ctx, check_learner)
        await _timed(ctx, check_weights)


def _environment(ctx: Ctx, setup: dict[str, Any]) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "device": ctx.device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        **setup,
    }
    if ctx.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    for mod in ("transformers", "deepspeed", "triton"):
        with contextlib.suppress(Exception):
            env[mod] = __import__(mod).__version__
    return env


def _table(ctx: Ctx, env: dict[str, Any], total: float) -> str:
    lines = [
        f"gpu_check on {env.get('gpu', env['device'])} (torch {env['torch']}, "
        f"transformers {env.get('transformers', '?')}, deepspeed {env.get('deepspeed', '?')}, "
        f"python {env['python']})",
        f"{'check':<15} {'result':<6} {'seconds':>8}  detail",
    ]
    for r in ctx.results:
        lines.append(f"{r.name:<15} {'PASS' if r.ok else 'FAIL':<6} {r.seconds:>8.1f}  {r.detail}")
    ok = all(r.ok for r in ctx.results)
    lines.append(
        f"{'total':<15} {'PASS' if ok else 'FAIL':<6} {total:>8.1f}  "
        f"budget {BUDGET_S:.0f}s, start-up and installs included"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (smoke test)")
    p.add_argument("--quick", action="store_true", help="CI: --cpu when there is no GPU")
    p.add_argument("--wheels", type=Path, help="install what is missing from this folder")
    p.add_argument("--prepare", type=Path, help="fill this folder for a GPU machine, then exit")
    p.add_argument(
        "--python",
        nargs="+",
        default=list(_gpu_env.PYTHONS),
        help="--prepare: CPython versions of the binary wheels",
    )
    p.add_argument("--model", default="tiny-1m", help="model spec or folder")
    p.add_argument("--engine-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", type=Path, default=_common.RESULTS_DIR, help="folder for the JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    if args.prepare:
        folder = _gpu_env.prepare(args.prepare, tuple(args.python), args.model)
        manifest = json.loads((folder / "manifest.json").read_text())
        mb = manifest["bytes"] / 1e6
        print(
            f"{folder}: {len(manifest['wheels'])} wheels ({mb:.1f} MB), model {manifest['model']}"
        )
        return 0
    setup: dict[str, Any] = {}
    if args.wheels:
        setup["wheels"] = _gpu_env.ensure(args.wheels)
    setup["harnessrl"] = _gpu_env.ensure_harnessrl()
    import torch

    cuda = torch.cuda.is_available()
    if args.quick and not cuda:
        args.cpu = True
    if not args.cpu and not cuda:
        print(
            "gpu_check: torch sees no CUDA device; --cpu runs the CPU smoke test", file=sys.stderr
        )
        return 2
    device = "cpu" if args.cpu else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device == "cpu" else "cuda")
    if device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    setup["setup_s"] = round(time.monotonic() - start, 2)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = Ctx(device, args.model, args.engine_dtype, Path(tmp))
        print(f"gpu_check: {device}, model {args.model}", flush=True)
        asyncio.run(run_checks(ctx))
    total = time.monotonic() - start
    env = _environment(ctx, setup)
    print(_table(ctx, env, total))
    metrics = {
        "checks": {
            r.name: {"ok": r.ok, "seconds": r.seconds, "detail": r.detail, **r.values}
            for r in ctx.results
        },
        "environment": env,
        "total_s": round(total, 2),
    }
    tree = next((r for r in ctx.results if r.name == "tree_attention"), None)
    baseline = {}
    if tree is not None and "sdpa_fwd_bwd_s" in tree.values:
        baseline["sdpa_dense_tree_mask_fwd_bwd_s"] = tree.values["sdpa_fwd_bwd_s"]
    targets = {
        "all_checks_pass": {
            "value": sum(r.ok for r in ctx.results),
            "target": len(ctx.results),
            "met": all(r.ok for r in ctx.results),
        },
        "under_budget_s": {"value": round(total, 1), "target": BUDGET_S, "met": total <= BUDGET_S},
    }
    path = _common.write_result(
        NAME, metrics, baseline, targets, quick=args.quick or args.cpu, out=args.out
    )
    print(f"wrote {path}")
    return 0 if all(r.ok for r in ctx.results) else 1


if __name__ == "__main__":
    sys.exit(main())
