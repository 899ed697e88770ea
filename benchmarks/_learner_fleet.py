"""One rank of a learner fleet on synthetic tree samples, for tests and benchmarks (started
with the launcher's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, e.g. by ``launch``).

``python -m benchmarks._learner_fleet MODE OUT SPEC_JSON``: rank 0 drives the engine as the learner
service would and writes what it saw to OUT (``torch.save``); every other rank follows.

* ``parity``: one step on a fixed batch, then the post-step weights (broadcast gather), the
  per-rank split, log-probs, a checkpoint round trip.
* ``loop``: steps and commits forever, writing ``OUT.step`` after each commit and pinging while
  "idle" (the test kills a rank).
* ``bench``: ``steps`` steps on a fixed batch; samples/s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from harnessrl.common.records import TreeNode, TreeSample, pack_f32, pack_ids, pack_u8
from harnessrl.learner.ds_engine import DeepSpeedConfig, LearnerEngine
from harnessrl.learner.losses import LossConfig, group_advantages
from harnessrl.learner.packing import PackConfig, pack

ROOT = Path(__file__).resolve().parent.parent


def make_samples(seed: int = 0, n: int = 4) -> list[TreeSample]:
    """Rollouts of one group: a shared prompt, then 1-3 branches of model/env turns each."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 8000, 12)
    out = []
    for k in range(n):
        nodes = [TreeNode(parent=-1, token_ids=pack_ids(prompt))]
        for _ in range(int(rng.integers(1, 4))):
            parent = int(rng.integers(0, len(nodes)))
            for is_model in (True, False):
                m = int(rng.integers(3, 10))
                nodes.append(
                    TreeNode(
                        parent=parent,
                        token_ids=pack_ids(rng.integers(3, 8000, m)),
                        logprobs=pack_f32(rng.uniform(-10, -8, m) if is_model else np.zeros(m)),
                        loss_mask=pack_u8(np.full(m, int(is_model))),
                        weight_version=0,
                    )
                )
                parent = len(nodes) - 1
        out.append(
            TreeSample(rollout_id=f"g-{k}-1", group_id="g", k=k, reward=float(k % 2), nodes=nodes)
        )
    return out


def rows_for(samples: list[TreeSample], budget: int = 64):
    adv, _ = group_advantages([s.group_id for s in samples], [s.reward for s in samples])
    return pack(samples, PackConfig(max_tokens=budget), advantages=adv).rows


def launch(mode: str, out: Path, spec: dict, world: int) -> list[subprocess.Popen]:
    """``world`` ranks of this module with a launcher's environment (as torchrun sets it);
    rank r logs to ``OUT.log<r>``."""
    from harnessrl.common.files import free_port
    from harnessrl.common.procs import popen_child

    port = str(free_port("127.0.0.1"))
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DS_ACCELERATOR": "cpu",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        log = open(f"{out}.log{rank}", "w")  # noqa: SIM115
        argv = [sys.executable, "-m", "benchmarks._learner_fleet", mode, str(out), json.dumps(spec)]
        procs.append(popen_child(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen], out: Path, timeout: float = 600) -> None:
    """Wait for every rank; raise with the ranks' log tails unless all exited 0."""
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if codes != [0] * len(procs):
        logs = "\n".join(Path(f"{out}.log{r}").read_text()[-3000:] for r in range(len(procs)))
        raise RuntimeError(f"ranks exited with {codes}:\n{logs}")


def main(mode: str, out: str, spec: dict) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = LearnerEngine(
        spec.get("model", "tiny-1m"),
        DeepSpeedConfig(**spec.get("ds", {})),
        LossConfig(**spec.get("loss", {"algo": "grpo"})),
    )
    engine.record_grads = mode == "parity"
    Path(f"{out}.pid{engine.fleet.rank if engine.fleet else 0}").write_text(str(os.getpid()))
    if engine.fleet is not None and engine.fleet.rank > 0:
        engine.follow()
        return 0
    samples = make_samples(spec.get("seed", 3), n=spec.get("samples", 5))
    rows = rows_for(samples, budget=spec.get("budget", 48))
    try:
        if mode == "parity":
            parity(engine, rows, out, spec)
        elif mode == "loop":
            loop(engine, rows, out, spec)
        elif mode == "bench":
            bench(engine, rows, samples, out, spec)
    finally:
        engine.close()
    return 0


def parity(engine: LearnerEngine, rows: list, out: str, spec: dict) -> None:
    before = engine.logprobs(rows)
    m = engine.train_step(rows, keep_logp=True)
    kept = engine.last_logp
    weights = engine.state_dict_for_broadcast(dedupe_tied=False)
    split = [s.tolist() for s in engine.last_split]
    after = engine.logprobs(rows)
    ckpt = Path(spec["ckpt"])
    engine.save_checkpoint(ckpt, {"version": 1})
    engine.train_step(rows)
    restored = engine.load_checkpoint(ckpt)
    back = engine.state_dict_for_broadcast(dedupe_tied=False)
    torch.save(
        {
            "metrics": m,
            "grads": engine.last_grads,
            "weights": weights,
            "split": split,
            "rows": len(rows),
            "before": before,
            "kept": kept,
            "after": after,
            "restored": restored,
            "round_trip": all(torch.equal(weights[k], back[k]) for k in weights),
        },
        out,
    )


def loop(engine: LearnerEngine, rows: list, out: str, spec: dict) -> None:
    step = 0
    while True:
        engine.train_step(rows)
        step += 1
        engine.save_checkpoint(spec["ckpt"], {"version": step})
        Path(f"{out}.step").write_text(str(step))
        for _ in range(10):  # "waiting for data"
            time.sleep(0.1)
            engine.keepalive()


def bench(engine: LearnerEngine, rows: list, samples: list, out: str, spec: dict) -> None:
    engine.train_step(rows)  # warm-up
    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        engine.train_step(rows)
    dt = time.perf_counter() - t0
    torch.save(
        {"samples_per_s": spec["steps"] * len(samples) / dt, "seconds": dt, "rows": len(rows)},
        out,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
