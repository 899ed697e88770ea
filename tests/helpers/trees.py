"""Call histories for tree tests: `Spec` (one call's full input and output), the call records
of a history (`make_calls`, deltas by mode) and a matching rollout result (`result_for`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from harnessrl.common import records as r

RID = "g-0-1"


@dataclass
class Spec:
    """One call of a history, with its full input (deltas are derived from a list of these)."""

    inp: list[int]
    out: list[int]
    label: str = "main"
    status: str = "ok"
    finish: str = "stop"
    wv: int = 0
    tito: bool = True

    @property
    def path(self) -> list[int]:
        return self.inp + self.out


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def logprobs_of(seq: int, n: int) -> list[float]:
    return [-0.125 * (seq + 1) - 0.0625 * i for i in range(n)]


def delta(specs: list[Spec], j: int, mode: str, rng: random.Random) -> tuple[int, int]:
    """(parent_seq, prefix_len) for call j: ``tito`` = earliest longest earlier path that is a
    whole prefix (else a full render); ``lcp`` = the earlier call sharing most tokens (partial);
    ``random`` = any earlier call, any shorter valid prefix; ``full`` = no parent."""
    inp = specs[j].inp
    earlier = range(j)
    if mode == "full" or j == 0:
        return -1, 0
    if mode == "tito":
        whole = [k for k in earlier if lcp(inp, specs[k].path) == len(specs[k].path)]
        if not whole:
            return -1, 0
        best = max(whole, key=lambda k: (len(specs[k].path), -k))
        return best, len(specs[best].path)
    if mode == "lcp":
        best = max(earlier, key=lambda k: (lcp(inp, specs[k].path), -k))
        return best, lcp(inp, specs[best].path)
    k = rng.randrange(j)
    return k, rng.randint(0, lcp(inp, specs[k].path))


def make_calls(
    specs: list[Spec], mode: str = "tito", seed: int = 0, rid: str = RID
) -> list[r.CallRecord]:
    rng = random.Random(seed)
    out = []
    for j, s in enumerate(specs):
        parent, plen = delta(specs, j, mode, rng)
        out.append(
            r.CallRecord(
                rollout_id=rid,
                seq=j,
                label=s.label,  # type: ignore[arg-type]
                parent_seq=parent,
                prefix_len=plen,
                suffix_ids=r.pack_ids(s.inp[plen:]),
                input_len=len(s.inp),
                input_hash=r.ids_hash(s.inp),
                output_ids=r.pack_ids(s.out),
                output_logprobs=r.pack_f32(logprobs_of(j, len(s.out))),
                finish_reason=s.finish,
                status=s.status,  # type: ignore[arg-type]
                weight_version_start=s.wv,
                weight_version_end=s.wv + 1,
                tito_hit=s.tito,
            )
        )
    return out


def result_for(n_calls: int, rid: str = RID, **kw) -> r.RolloutResult:
    group_id, k, attempt = r.parse_rollout_id(rid)
    base = dict(
        rollout_id=rid,
        task_id="toy/t",
        harness="reference",
        group_id=group_id,
        k=k,
        attempt=attempt,
        n_calls=n_calls,
        reward=0.75,
    )
    return r.RolloutResult(**{**base, **kw})
