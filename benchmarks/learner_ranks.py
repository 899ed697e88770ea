"""Learner fleet: samples/s of one optimiser step on 2 data-parallel ranks against 1 rank.

Each configuration is a fleet of ``benchmarks._learner_fleet`` processes (CPU, gloo, DeepSpeed
ZeRO-0 fp32, one torch thread per rank) that trains the same batch of synthetic GRPO tree
samples for a number of steps after a warm-up step; samples/s = steps * samples / seconds.

Baseline in the same run: the same batch and steps on 1 rank. Each rank trains half the rows, so
the ideal ratio is 2 minus the cost of the gradient all-reduce, the padding of an odd row and
the control channel; on a shared 2-core machine expect far less (the ranks compete for the
cores with everything else).

Target (reported, not asserted): 2 ranks reach >= 1.0x the samples/s of 1 rank.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from benchmarks._common import parse_args, print_table, target, write_result
from benchmarks._learner_fleet import finish, launch


def measure(world: int, spec: dict, folder: Path) -> dict:
    out = folder / f"ranks{world}"
    finish(launch("bench", out, spec, world), out, timeout=1800)
    return torch.load(out, weights_only=False)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    spec = {
        "model": "tiny-1m" if args.quick else "tiny",
        "samples": 8 if args.quick else 16,
        "budget": 128 if args.quick else 256,
        "steps": 3 if args.quick else 20,
        "ds": {"lr": 1e-4},
    }
    with tempfile.TemporaryDirectory() as d:
        one = measure(1, spec, Path(d))
        two = measure(2, spec, Path(d))
    ratio = two["samples_per_s"] / one["samples_per_s"]
    print_table(
        f"learner ranks: {spec['model']}, {spec['samples']} samples a step, {spec['steps']} steps",
        [
            ("1 rank (baseline)", f"{one['samples_per_s']:.2f}", f"{one['seconds']:.1f}"),
            ("2 ranks", f"{two['samples_per_s']:.2f}", f"{two['seconds']:.1f}"),
        ],
        ("learner", "samples/s", "seconds"),
    )
    print(f"\n2 ranks / 1 rank: {ratio:.2f}x")
    path = write_result(
        "learner_ranks",
        {
            "samples_per_s_1_rank": one["samples_per_s"],
            "samples_per_s_2_ranks": two["samples_per_s"],
            "rows": two["rows"],
            **spec,
        },
        {"samples_per_s_1_rank": one["samples_per_s"]},
        {"speedup_2_ranks": target(ratio, 1.0)},
        ratios={"2_ranks_vs_1": ratio},
        quick=args.quick,
        out=args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
