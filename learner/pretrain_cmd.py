"""``harnessrl pretrain``: the warm-start recipe that makes ``tiny-agent``.

    harnessrl pretrain --config deploy/pretrain-tiny-agent.toml [--out DIR] [--quick]

1. **data**: ``harnessrl teacher-data`` writes the toy teacher's trajectories through the
   ``harness`` (the reference agent's loop in-process by default; any other harness live and
   unmodified, recorded as the tokens it was served) — fresh training tasks, never a held-out
   one — to ``<out>/teacher.jsonl``, and the held-out tasks' to ``<out>/teacher-eval.jsonl``
   (for the held-out measure only); a live recording resumes where it stopped;
2. **language warm-up** (``corpus_steps``, optional): next-token loss on windows of the
   synthetic corpus the tokenizer was trained on;
3. **SFT** (``steps``): the reply tokens of the teacher conversations, through the real learner
   (`harnessrl.learner.pretrain`: tree packing with the harness prompt shared, ``LearnerEngine`` with
   ``algo = "sft"``, DeepSpeed, AdamW with linear warmup + cosine decay over both phases);
4. **export**: the final weights (``export_dtype``) as a Hugging Face folder with the base
   model's tokenizer and chat template, ``harnessrl_recipe.json`` (this config, the data's
   checksum, the held-out curve) and ``SHA256SUMS``.

It resumes from its own checkpoints (``<out>/checkpoints``, every ``checkpoint_every`` steps
and at the end or the time limit): run the same command again. Progress goes to stderr and
``<out>/metrics.jsonl`` (one JSON object per logged step or evaluation). ``--quick`` shrinks
every budget (20 tasks per family, 30 steps) to check the recipe end to end in a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from harnessrl.common.config import HrlModel, dump_toml
from harnessrl.common.files import atomic_write, atomic_write_json


class PretrainConfig(HrlModel):
    """``harnessrl pretrain``: language warm-up + SFT on teacher trajectories -> a warm start."""

    out: Path = Path("runs/pretrain")
    """Recipe folder: data, checkpoints, ``metrics.jsonl``, and the exported model
    (``<out>/model`` unless ``export`` says otherwise)."""
    model: str = "tiny-1m"
    """Base model (tiny spec or folder) the recipe starts from."""
    seed: int = 0
    """Seed of the task generator, data order and initialisation."""
    per_family: int = Field(1000, ge=1, le=1_000_000)
    """Teacher trajectories (distinct training tasks) per toy family; small families (e.g.
    ``write_word``, 120 possible tasks) give fewer."""
    families: list[str] = []
    """Toy families to train on (``--family``, repeat); empty: all."""
    vary_names: float = Field(0.5, ge=0.0, le=1.0)
    """Share of teacher tasks with input/output/folder names redrawn from the toy word list
    (``harnessrl teacher-data --vary-names``): names the policy must copy, not guess."""
    near_miss: float = Field(0.0, ge=0.0, le=1.0)
    """Share of ``shell`` teacher trajectories that demonstrate the family's plausible mistake
    (``harnessrl teacher-data --near-miss``; ``harnessrl.common.tasks.toy.Family.near_miss``): a warm
    start with family-level errors for RL to correct. 0 for the shipped ``tiny-agent``."""
    teacher_style: Literal["edit", "shell"] = "shell"
    """How the teacher solves a task (``harnessrl teacher-data --style``): ``shell``, one
    ``run`` of the family's shell one-liner then ``finish``; ``edit``, read the inputs and write
    the answer with ``write_file`` (the model must copy and transform file text)."""
    harnesses: list[str] = ["reference"]
    """The harnesses the policy learns to drive (``--harness``, repeat for several): the
    teacher data is recorded through each (``harnessrl teacher-data --harness``: the reference
    harness's loop in-process, any other harness live and unmodified, as token trees; one
    file per harness, all trained on together), the held-out success is measured through
    each, and the exported policy's ``harnessrl_recipe.json`` lists them under ``harnesses``
    (what ``harnessrl harness list`` shows as spoken)."""
    teacher_concurrency: int = Field(4, ge=1, le=256)
    """Live teacher rollouts at once (a harness other than ``reference``)."""
    data: Path | None = None
    """An existing ``harnessrl teacher-data`` file to train on instead of recording the
    training data (the held-out data is still recorded through each harness)."""
    corpus_steps: int = Field(0, ge=0, le=10_000_000)
    """Language warm-up steps on the synthetic corpus before SFT (0: none)."""
    corpus_chars: int = Field(1_000_000, ge=1000, le=1_000_000_000)
    """Characters of synthetic corpus generated for the warm-up."""
    corpus_seq: int = Field(256, ge=16, le=32_768)
    """Tokens per warm-up window."""
    steps: int = Field(3000, ge=0, le=10_000_000)
    """SFT optimiser steps."""
    batch: int = Field(16, ge=1, le=65_536)
    """Conversations (or corpus windows) per optimiser step."""
    lr: float = Field(2e-3, gt=0, le=1.0)
    """Peak AdamW learning rate."""
    warmup_steps: int = Field(100, ge=0, le=10_000_000)
    """Linear warmup steps; then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    min_lr_ratio: float = Field(0.05, ge=0.0, le=1.0)
    """Floor of the cosine decay, as a fraction of ``lr``."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """AdamW decoupled weight decay."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Global gradient-norm clip (0: none)."""
    max_row_tokens: int = Field(8192, ge=256, le=1_000_000)
    """Token budget of one packed row (the learner's ``pack.max_tokens``)."""
    log_every: int = Field(25, ge=1, le=1_000_000)
    """Steps between progress lines."""
    eval_every: int = Field(250, ge=0, le=10_000_000)
    """Steps between held-out measures (teacher-forced loss / exact match; 0: only at the end)."""
    checkpoint_every: int = Field(250, ge=1, le=10_000_000)
    """Steps between checkpoints (also written at the end and at the time limit)."""
    time_limit_minutes: float = Field(0.0, ge=0.0, le=100_000)
    """Stop (checkpoint + export) after this many minutes of training (0: none)."""
    export: Path | None = None
    """Folder of the exported model; empty: ``<out>/model``."""
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the exported weights."""
    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    """Output limit per call written into the exported ``generation_config.json`` (runs with
    ``max_new_tokens = 0`` use it): the ``shell`` teacher's longest reply is 61 tokens, the
    ``edit`` teacher's 154."""
    eval_n: int = Field(3, ge=0, le=1000)
    """Last step: ``harnessrl eval`` of the exported policy on every ``eval_suite`` task this
    many times through each real harness of ``harnesses`` at temperature 1, recorded as the
    warm start's held-out success in ``harnessrl_recipe.json`` (``held_out_success``: through
    the first harness; ``held_out_by_harness``: through each) (0: skip)."""
    eval_suite: str = "toy-eval"
    """Held-out suite of that evaluation."""
    threads: int = Field(0, ge=0, le=1024)
    """torch CPU threads (0: every core)."""
    quick: bool = False
    """Shrink every budget (20 tasks per family through the reference loop, 1 through a live
    harness; 30 SFT steps, 10 warm-up steps at most) to check the recipe end to end."""

    @field_validator("harnesses")
    @classmethod
    def _harnesses(cls, v: list[str]) -> list[str]:
        v = list(dict.fromkeys(h.strip() for h in v))  # order kept, repeats dropped
        if not v or "" in v:
            raise ValueError("name at least one harness (e.g. --harness mini-swe-agent)")
        return v


CONFIG = PretrainConfig
SECTION = "pretrain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--family", dest="cfg__families", action="append", metavar="F", help="family; repeat"
    )


def quick(cfg: PretrainConfig) -> PretrainConfig:
    return cfg.model_copy(
        update={
            # a live harness records ~0.25-1 conversations/s here, the reference loop ~30/s
            "per_family": min(cfg.per_family, 20 if cfg.harnesses == ["reference"] else 1),
            "steps": min(cfg.steps, 30),
            "corpus_steps": min(cfg.corpus_steps, 10),
            "warmup_steps": min(cfg.warmup_steps, 5),
            "eval_every": 15,
            "checkpoint_every": 15,
            "log_every": 5,
            "eval_n": 0,
        }
    )


def log(msg: str) -> None:
    print(f"[pretrain] {msg}", file=sys.stderr, flush=True)


def data_path(out: Path, split: str, harness: str) -> Path:
    """Where the recipe keeps the teacher data of ``split`` through ``harness``
    (``teacher.jsonl``, ``teacher-eval.jsonl``; ``teacher-<harness>.jsonl`` for a live one)."""
    stem = "teacher" if split == "train" else "teacher-eval"
    return out / (f"{stem}.jsonl" if harness == "reference" else f"{stem}-{harness}.jsonl")


def teacher_data(cfg: PretrainConfig, out: Path, split: str, harness: str) -> Path:
    """Generate (once) the teacher trajectories of ``split`` through ``harness`` with
    ``harnessrl teacher-data``; an interrupted live recording resumes where it stopped."""
    path = data_path(out, split, harness)
    if path.exists():
        return path
    argv = [sys.executable, "-m", "harnessrl.common.cli", "teacher-data", "--out", str(path)]
    argv += ["--split", split, "--seed", str(cfg.seed), "--per-family", str(cfg.per_family)]
    argv += ["--style", cfg.teacher_style, "--vary-names", str(cfg.vary_names)]
    if harness != "reference":  # recorded live: the tokens of this model's tokenizer
        argv += ["--harness", harness, "--model", cfg.model]
        argv += ["--concurrency", str(cfg.teacher_concurrency)]
    if cfg.near_miss and split == "train":
        argv += ["--near-miss", str(cfg.near_miss)]
    for f in cfg.families:
        argv += ["--family", f]
    subprocess.run(argv, check=True)
    return path


def export(cfg: PretrainConfig, engine: Any, folder: Path, meta: dict[str, Any]) -> Path:
    """Write the model folder: weights, config, tokenizer + template, recipe, checksums."""
    import torch

    from harnessrl.common.models import resolve_model
    from harnessrl.common.weights import serialize, write_hf_folder

    dtype = torch.bfloat16 if cfg.export_dtype == "bfloat16" else torch.float32
    lm = engine.policy.lm
    config = json.loads(lm.config.to_json_string())
    config["torch_dtype"] = config["dtype"] = cfg.export_dtype
    config_json = json.dumps(config, indent=2, sort_keys=True)
    data = serialize(engine.state_dict_for_broadcast(dtype=dtype), config_json)
    write_hf_folder(folder, data, base=resolve_model(cfg.model), config_json=config_json)
    (folder / ".complete").unlink(missing_ok=True)  # the tiny cache's marker, not ours
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["max_new_tokens"] = cfg.max_new_tokens
    atomic_write(gen_path, json.dumps(gen, indent=2, sort_keys=True) + "\n")
    write_recipe(folder, meta)
    return folder


def write_recipe(folder: Path, meta: dict[str, Any]) -> None:
    """``harnessrl_recipe.json`` and the ``SHA256SUMS`` over every file of the folder."""
    from harnessrl.learner.pretrain import file_sha256

    atomic_write_json(folder / "harnessrl_recipe.json", meta)
    sums = "".join(
        f"{file_sha256(p)}  {p.name}\n"
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != "SHA256SUMS"
    )
    atomic_write(folder / "SHA256SUMS", sums)


def held_out_eval(cfg: PretrainConfig, folder: Path, out: Path) -> dict[str, dict[str, Any]]:
    """``harnessrl eval`` of the exported policy (a child process: the real harnesses, sandbox,
    proxy and engine); its summary through each harness."""
    report = out / "eval.json"
    argv = [sys.executable, "-m", "harnessrl.common.cli", "eval", "--policy", str(folder)]
    argv += ["--suite", cfg.eval_suite, "--n", str(cfg.eval_n)]
    for h in cfg.harnesses:
        argv += ["--harness", h]
    argv += ["--temperature", "1.0", "--out", str(report), "--log-dir", str(out / "eval-logs")]
    subprocess.run(argv, check=True)
    summary = json.loads(report.read_text())["summary"][str(folder)]
    return {
        h: {
            "suite": cfg.eval_suite,
            "harness": h,
            "n_per_task": cfg.eval_n,
            "temperature": 1.0,
            **summary[h],
        }
        for h in cfg.harnesses
    }


def prior_elapsed(metrics: Path) -> float:
    """Training seconds of earlier invocations, from their last step lines (for checkpoints
    that predate ``train_s``): each invocation's ``elapsed_s`` restarts at 0."""
    if not metrics.exists():
        return 0.0
    total = last = 0.0
    for line in metrics.read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        el = obj.get("elapsed_s") if obj.get("kind") == "step" else None
        if el is None:
            continue
        if el < last:  # a new invocation started
            total += last
        last = float(el)
    return total + last


def main(cfg: PretrainConfig, args: argparse.Namespace | None = None) -> int:
    import numpy as np
    import torch

    from harnessrl.common.models import load_tokenizer
    from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
    from harnessrl.learner.losses import LossConfig
    from harnessrl.learner.packing import PackConfig, pack
    from harnessrl.learner.pretrain import (
        as_sample,
        batches,
        corpus_windows,
        encode_file,
        file_sha256,
        teacher_forced,
    )

    if cfg.quick:
        cfg = quick(cfg)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "pretrain.toml", dump_toml(cfg))
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    t0 = time.monotonic()
    try:
        train_paths = (
            [cfg.data] if cfg.data else [teacher_data(cfg, out, "train", h) for h in cfg.harnesses]
        )
        eval_paths = [teacher_data(cfg, out, "eval", h) for h in cfg.harnesses]
    except subprocess.CalledProcessError as e:
        log(f"teacher-data failed (exit {e.returncode})")
        return 1
    tok = load_tokenizer(cfg.model)
    try:
        train = [e for p in train_paths for e in encode_file(tok, p)]
        held = [e for p in eval_paths for e in encode_file(tok, p)]
    except (OSError, ValueError) as e:
        print(f"harnessrl pretrain: {e}", file=sys.stderr)
        return 2
    if cfg.families:
        held = [e for e in held if e.family in cfg.families]
    corpus = (
        corpus_windows(tok, cfg.corpus_chars, cfg.corpus_seq, cfg.seed) if cfg.corpus_steps else []
    )
    log(
        f"data: {len(train)} train / {len(held)} held-out conversations, "
        f"{len(corpus)} corpus windows ({time.monotonic() - t0:.1f}s)"
    )
    total = cfg.corpus_steps + cfg.steps
    ds = DeepSpeedConfig(
        lr=cfg.lr,
        lr_warmup_versions=cfg.warmup_steps,  # one optimiser step per version here
        lr_decay_versions=total,
        lr_min_ratio=cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        seed=cfg.seed,
        micro_batch_rows=4,
    )
    engine = LearnerEngine(cfg.model, ds, LossConfig(algo="sft"))
    state = engine.load_checkpoint(out / "checkpoints") or {}
    step = int(state.get("step", 0))
    curve: list[dict[str, Any]] = list(state.get("curve", []))
    if step:
        log(f"resumed at step {step}/{total}")
    pack_cfg = PackConfig(max_tokens=cfg.max_row_tokens)
    metrics_path = out / "metrics.jsonl"

    def emit(obj: dict[str, Any]) -> None:
        with open(metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")

    def evaluate() -> dict[str, float]:
        if not held:
            return {}
        m = teacher_forced(engine, held, pack_cfg)
        curve.append({"step": step, **m})
        emit({"kind": "eval", "step": step, **m})
        log(
            f"step {step}: held-out loss {m['loss']:.3f}, token acc {m['token_acc']:.4f}, "
            f"exact {m['exact']:.3f} (n={int(m['n'])})"
        )
        return m

    def train_s() -> float:
        return prior_s + time.monotonic() - t_train

    def checkpoint() -> None:
        state = {"step": step, "curve": curve, "train_s": round(train_s(), 1)}
        engine.save_checkpoint(out / "checkpoints", state)

    corpus_it = batches(len(corpus), cfg.batch, cfg.seed, min(step, cfg.corpus_steps))
    sft_it = batches(len(train), cfg.batch, cfg.seed + 1, max(0, step - cfg.corpus_steps))
    prior_s = float(state.get("train_s", 0.0)) or prior_elapsed(metrics_path)
    t_train = time.monotonic()
    limit = max(cfg.time_limit_minutes * 60 - prior_s, 1e-9) if cfg.time_limit_minutes else 0.0
    tokens = 0.0
    stopped = ""
    while step < total:
        phase = "corpus" if step < cfg.corpus_steps else "sft"
        idx = next(corpus_it if phase == "corpus" else sft_it)
        items = [corpus[i] for i in idx] if phase == "corpus" else [train[i] for i in idx]
        packing = pack([as_sample(e, f"s{step}-{k}") for k, e in enumerate(items)], pack_cfg)
        m = engine.train_step(packing.rows)
        step += 1
        tokens += m["tokens_computed"]
        if step % cfg.log_every == 0 or step == total:
            el = time.monotonic() - t_train
            emit({"kind": "step", "step": step, "phase": phase, **m, "elapsed_s": el})
            log(
                f"step {step}/{total} {phase}: loss {m['loss/total']:.4f} lr {m['lr']:.2e} "
                f"{m['step_time_s']:.2f}s/step {tokens / max(el, 1e-9):.0f} tok/s "
                f"(shared {packing.stats.shared_tokens} tok) {el / 60:.1f} min"
            )
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            evaluate()
        if step % cfg.checkpoint_every == 0 and step < total:
            checkpoint()
        if limit and time.monotonic() - t_train > limit:
            stopped = f"time limit {cfg.time_limit_minutes:g} min"
            break
    final = evaluate()
    checkpoint()
    folder = cfg.export or out / "model"
    meta = {
        "recipe": json.loads(json.dumps(cfg.model_dump(mode="json"))),
        "harnesses": cfg.harnesses,
        "steps": step,
        "stopped": stopped or "steps",
        "train_data_sha256": {p.name: file_sha256(p) for p in train_paths},
        "train_conversations": len(train),
        "held_out": final,
        "curve": curve,
        "train_minutes": round(train_s() / 60, 2),
        "threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "torch": torch.__version__,
    }
    export(cfg, engine, folder, meta)
    log(f"exported {folder} after {step} steps ({(time.monotonic() - t0) / 60:.1f} min)")
    if cfg.eval_n:
        try:
            by_harness = held_out_eval(cfg, folder, out)
        except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as e:
            log(f"held-out evaluation failed: {e}")
            return 1
        meta["held_out_success"] = by_harness[cfg.harnesses[0]]
        meta["held_out_by_harness"] = by_harness
        write_recipe(folder, meta)
        for h, r in by_harness.items():
            log(
                f"held-out {cfg.eval_suite} through {h}: success {r['success']:.3f}, "
                f"reward {r['reward']:.3f}"
            )
    return 0
