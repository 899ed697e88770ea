"""The warm-start recipe's training: teacher conversations -> tree samples -> the real learner.

``harnessrl pretrain`` (`harnessrl.learner.pretrain_cmd`) turns a tiny random model into ``tiny-agent``,
a policy that already drives the reference harness on the toy families, so RL starts from
something that can act. Offline, with both cores for the learner, but through the same code
as live training: each conversation becomes a one-root `TreeSample` (prompt tokens loss-masked
out, the assistant's tokens in), `harnessrl.learner.packing.pack` merges the harness's shared system
prompt and tool schema across a batch (computed once per step, not once per trajectory),
and `LearnerEngine.train_step` with ``algo = "sft"`` takes the DeepSpeed step.

Token layout = what the proxy produces: per assistant turn, the rendered prompt delta
(``\\n<|im_start|>…<|im_start|>assistant\\n``) then the reply's tokens through ``<|im_end|>``,
each piece encoded on its own, as TITO appends them.

Conversations recorded live through a harness (``harnessrl teacher-data --harness NAME``)
carry their tokens already: the prefix tree the assembler built from the proxy's CallRecords
(``nodes``: parent, ids, loss mask), used as it is — whatever the harness's prompt, tool
wrapping, retries or forks — after checking that they were made by this tokenizer.

Held-out measure (cheap, every ``eval_every`` steps): on the held-out tasks' teacher
trajectories, the loss and the *teacher-forced exact-match* rate: the share of trajectories
whose every assistant token is the model's argmax. A trajectory that matches would be
reproduced token for token by a greedy rollout, so this tracks greedy success.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harnessrl.common.models import render_chat
from harnessrl.common.records import TreeNode, TreeSample
from harnessrl.learner.config import PackConfig

IM_END = "<|im_end|>"


@dataclass
class Encoded:
    """One conversation as token ids with the loss mask (1 = the assistant's tokens)."""

    ids: np.ndarray
    mask: np.ndarray
    family: str = ""
    nodes: list[tuple[int, np.ndarray, np.ndarray]] | None = None
    """A recorded prefix tree: ``(parent index or -1, ids, mask)`` per node (``ids``/``mask``
    are then every node's tokens in order); None: one sequence."""


def _encode(tok: Any, text: str) -> list[int]:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return list(tok.encode(text, add_special_tokens=False))


def encode_conversation(
    tok: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> Encoded:
    """Ids and loss mask of a whole conversation, laid out as the proxy records it."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # text already encoded
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prompt = render_chat(messages[:i], tools=tools or None, add_generation_prompt=True)
        full = render_chat(messages[: i + 1], tools=tools or None)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError(f"turn {i}: the rendered history is not append-only")
        reply = full[len(prompt) :]
        end = reply.rfind(IM_END)
        if end < 0:
            raise ValueError(f"turn {i}: the template wrote no {IM_END} after the reply")
        reply = reply[: end + len(IM_END)]
        p = _encode(tok, prompt[len(done) :])
        o = _encode(tok, reply)
        ids += p + o
        mask += [0] * len(p) + [1] * len(o)
        done = prompt + reply
    return Encoded(np.asarray(ids, np.int32), np.asarray(mask, np.uint8))


def read_conversations(path: str | Path) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec.get("messages"), list) and not isinstance(
                    rec.get("nodes"), list
                ):
                    raise ValueError("neither a messages list nor a token tree (nodes)")
            except (ValueError, AttributeError) as e:
                raise ValueError(f"{path}:{n}: not a conversation record ({e})") from None
            out.append(rec)
    return out


def decode_tree(rec: dict[str, Any], fingerprint: str, vocab: int) -> Encoded:
    """A recorded token tree (``nodes``) as an `Encoded`; ValueError when it is malformed or
    its tokenizer is not this one (``fingerprint``, ``vocab``: the tokenizer's)."""
    made_by = (rec.get("tokenizer") or {}).get("fingerprint")
    if made_by != fingerprint:
        name = (rec.get("tokenizer") or {}).get("name", "an unnamed tokenizer")
        raise ValueError(
            f"its tokens were made by {name} (fingerprint {made_by}), not by this model's "
            f"tokenizer ({fingerprint}): record the data again with --model set to this model"
        )
    nodes: list[tuple[int, np.ndarray, np.ndarray]] = []
    for i, n in enumerate(rec["nodes"]):
        parent, ids, mask = int(n["parent"]), np.asarray(n["ids"], np.int32), str(n["mask"])
        if not -1 <= parent < i or len(mask) != len(ids) or set(mask) - {"0", "1"}:
            raise ValueError(f"node {i}: bad parent, or mask not one 0/1 per token")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"node {i}: token id outside the vocabulary ({vocab})")
        nodes.append((parent, ids, np.frombuffer(mask.encode(), np.uint8) - ord("0")))
    if not nodes:
        raise ValueError("an empty token tree")
    ids = np.concatenate([n[1] for n in nodes])
    mask = np.concatenate([n[2] for n in nodes]).astype(np.uint8)
    return Encoded(ids, mask, str(rec.get("family", "")), nodes)


def encode_file(tok: Any, path: str | Path) -> list[Encoded]:
    """Every conversation of a ``harnessrl teacher-data`` JSONL file, encoded (rendered from
    ``messages``, or a recorded token tree taken as it is)."""
    from harnessrl.common.models import tokenizer_fingerprint

    fingerprint, vocab = "", 0
    out = []
    for n, rec in enumerate(read_conversations(path), 1):
        if isinstance(rec.get("nodes"), list):
            if not fingerprint:
                fingerprint, vocab = tokenizer_fingerprint(tok), len(tok)
            try:
                enc = decode_tree(rec, fingerprint, vocab)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: conversation {n}: {e}") from None
        else:
            enc = encode_conversation(tok, rec["messages"], rec.get("tools"))
            enc.family = str(rec.get("family", ""))
        out.append(enc)
    return out


def as_sample(enc: Encoded, key: str) -> TreeSample:
    """A TreeSample of a conversation (reward 1: SFT data): one root, or the recorded tree."""
    if enc.nodes is not None:
        nodes = [
            TreeNode(
                parent=p,
                token_ids=ids.astype("<i4").tobytes(),
                logprobs=np.zeros(len(ids), np.float32).tobytes(),
                loss_mask=mask.astype(np.uint8).tobytes(),
                weight_version=0,
            )
            for p, ids, mask in enc.nodes
        ]
        return TreeSample(rollout_id=key, group_id=key, k=0, reward=1.0, nodes=nodes)
    node = TreeNode(
        parent=-1,
        token_ids=enc.ids.astype(np.int32).tobytes(),
        logprobs=np.zeros(len(enc.ids), np.float32).tobytes(),
        loss_mask=enc.mask.astype(np.uint8).tobytes(),
        weight_version=0,
    )
    return TreeSample(rollout_id=key, group_id=key, k=0, reward=1.0, nodes=[node])


def corpus_windows(tok: Any, n_chars: int, seq: int, seed: int) -> list[Encoded]:
    """The synthetic corpus (``harnessrl.common.models.corpus``) cut into ``seq``-token windows, every
    token a target: the language warm-up's data."""
    from harnessrl.common.models.corpus import _corpus_documents

    ids: list[int] = []
    for doc in _corpus_documents(n_chars, seed):
        ids += _encode(tok, doc) + [0]
    arr = np.asarray(ids, np.int32)
    n = len(arr) // seq
    return [
        Encoded(arr[k * seq : (k + 1) * seq], np.ones(seq, np.uint8), "corpus") for k in range(n)
    ]


def batches(n_items: int, batch: int, seed: int, start_step: int) -> Iterator[list[int]]:
    """Indices of each step's batch: epochs of seeded permutations, resumable at any step."""
    per_epoch = max(1, n_items // batch)
    step = start_step
    while True:
        epoch, k = divmod(step, per_epoch)
        perm = np.random.default_rng([seed, epoch]).permutation(n_items)
        yield [int(i) for i in perm[k * batch : (k + 1) * batch]]
        step += 1


def teacher_forced(engine: Any, items: Sequence[Encoded], pack_cfg: PackConfig) -> dict[str, float]:
    """Held-out loss, token accuracy and exact-match rate (every assistant token the argmax)."""
    import torch

    from harnessrl.learner.packing import collate, pack

    samples = [as_sample(e, f"eval-{i}") for i, e in enumerate(items)]
    packing = pack(samples, pack_cfg)
    nll = correct = total = 0.0
    exact = np.ones(len(items), bool)
    lm = engine.policy.lm
    with torch.no_grad():
        for row in packing.rows:
            batch = collate([row], device=engine.device)
            out = lm.base_model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=batch.attention_mask,
                use_cache=False,
            )
            hidden = out.last_hidden_state.flatten(0, 1)[batch.target_src]
            lp = torch.log_softmax(lm.get_output_embeddings()(hidden).float(), -1)
            tgt = batch.target_ids
            scored = torch.from_numpy(row.loss_mask > 0)
            nll += float(-lp.gather(1, tgt[:, None])[:, 0][scored].sum())
            hit = (lp.argmax(-1) == tgt).numpy() | ~scored.numpy()
            correct += float(hit[scored.numpy()].sum())
            total += float(scored.sum())
            for s in np.unique(row.sample_index):
                exact[s] &= bool(hit[row.sample_index == s].all())
    return {
        "loss": nll / max(total, 1.0),
        "token_acc": correct / max(total, 1.0),
        "exact": float(exact.mean()),
        "n": float(len(items)),
    }


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
