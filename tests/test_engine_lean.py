"""The engine's lean forward (proxy/engine/lean.py) against the ``transformers`` forward.

Each test loads a real ``Engine`` on a small random model saved as a Hugging Face folder
(Llama-shaped with untied embeddings and biases, Qwen2-shaped with q/k/v biases, Qwen3-shaped
with q/k norm and tied embeddings) and drives its packed steps directly; the reference is a
separately loaded copy of the same folder, run as a plain full-sequence forward.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from harnessrl.common.models import load_model
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine.attention import _Segment
from harnessrl.proxy.engine.lean import LeanForward
from harnessrl.proxy.engine.scheduler import Engine

pytestmark = pytest.mark.unit

TOL = 5e-5  # fp32 logits (of magnitude ~5: the HF forward itself moves by ~5e-6 between layouts)
VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)


def _config(arch: str):
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            **SHAPE, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True)
    assert arch == "qwen3-gelu"
    return transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True, hidden_act="gelu")


def save_model(arch: str, folder: Path, seed: int) -> Path:
    """A random model of ``arch`` with weights large enough for peaked logits, saved."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(str(folder))
    return folder


def load_engine(folder: Path, **overrides) -> Engine:
    eng = Engine(EngineConfig(model=str(folder), port=0, threads=1, **overrides))
    eng.load()
    eng.pool = eng._new_pool(4)
    return eng


def ref_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([tokens])).logits[0].float()


def drive(eng: Engine, ref, seqs: dict[int, list[int]] | None = None, scale: int = 1) -> float:
    """Largest |logit - reference| over packed steps covering every path: two first chunks
    in one step, a chunk after cached KV next to decode rows, and decode rows on slots
    {0, 2} (slot 1 free: a non-dense batch). ``seqs``: three token sequences (default: random
    ones of 16 tokens); ``scale`` multiplies the prefill chunks (sequences need ``9 * scale +
    7`` tokens)."""
    if seqs is None:
        rng = random.Random(0)
        seqs = {s: [rng.randrange(3, VOCAB) for _ in range(16)] for s in range(3)}
    expect = {s: ref_logits(ref, toks) for s, toks in seqs.items()}
    done = dict.fromkeys(seqs, 0)
    err = 0.0

    def step(decode: list[int], chunks: list[tuple[int, int]]) -> None:
        nonlocal err
        ids, segs, keep, rows = [], [], [], []
        for s in decode:
            ids.append(seqs[s][done[s]])
            keep.append(len(ids) - 1)
            rows.append((s, done[s]))
        for s, n in chunks:
            segs.append(_Segment(len(ids), n, s, done[s]))
            ids.extend(seqs[s][done[s] : done[s] + n])
            keep.append(len(ids) - 1)
            rows.append((s, done[s] + n - 1))
        eng.pool.fit(3, max(64, *(len(t) + 1 for t in seqs.values())))
        with torch.inference_mode():
            got = eng._run_packed(ids, decode, [done[s] for s in decode], segs, keep)
        for s in decode:
            done[s] += 1
        for s, n in chunks:
            done[s] += n
        for row, (s, pos) in zip(got, rows, strict=True):
            err = max(err, float((row.float() - expect[s][pos]).abs().max()))

    k = scale
    step([], [(0, 6 * k), (2, 5 * k)])  # two first chunks
    step([], [(0, 3 * k), (1, 7 * k)])  # a chunk after cached KV, a first chunk
    step([0, 1], [(2, 4 * k)])  # decode rows next to a chunk after cached KV
    for _ in range(3):
        step([0, 1, 2], [])  # dense decode
    for _ in range(3):
        step([0, 2], [])  # slot 1 left: non-dense decode
    return err


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def arch_dir(arch: str, tmp_path_factory) -> Path:
    return save_model(arch, tmp_path_factory.mktemp(arch), seed=1)


def test_lean_matches_hf_forward(arch: str, arch_dir: Path) -> None:
    """Prefill, chunked prefill after cached KV and batched (dense and non-dense) decode
    through the lean forward give the HF forward's logits. For Qwen the packed transformers
    path agrees; a Llama model, which that path cannot serve (it was refused at load before
    the lean forward), is served by the lean forward alone."""
    eng = load_engine(arch_dir)
    assert isinstance(eng.lean, LeanForward)
    ref = load_model(arch_dir).requires_grad_(False)
    assert drive(eng, ref) < TOL
    eng.lean = None  # the packed transformers path, same steps
    hf_err = drive(eng, ref)
    assert hf_err > 1 if arch == "llama" else hf_err < 1e-3
    if arch == "llama":
        with pytest.raises(ValueError, match="packed attention differs"):
            load_engine(arch_dir, lean_forward=False)


def test_weight_swap_reaches_lean_forward(arch: str, arch_dir: Path, tmp_path: Path) -> None:
    """New weights applied as the engine applies them (``copy_`` into the HF parameters)
    reach the lean forward without a second copy: its fused matrices share the parameters'
    storage, and its logits equal the HF forward with the new weights."""
    from harnessrl.proxy.engine.weights import load_state_dict

    eng = load_engine(arch_dir)
    lean = eng.lean
    assert lean is not None
    att = eng.model.model.layers[0].self_attn
    ptr = lean.layers[0].qkv.untyped_storage().data_ptr()
    assert att.q_proj.weight.untyped_storage().data_ptr() == ptr
    assert att.v_proj.weight.untyped_storage().data_ptr() == ptr
    new_dir = save_model(arch, tmp_path / "new", seed=2)
    named = list(load_state_dict(new_dir).items())
    eng.check_weights(named, full=True)
    assert eng._do_swap(named, "7", False, "disk") == "7"
    assert eng.lean is lean and lean.layers[0].qkv.untyped_storage().data_ptr() == ptr
    assert drive(eng, load_model(new_dir).requires_grad_(False)) < TOL
    # Storage no longer shared (a parameter rebound): the next swap rebuilds the fusion.
    att.k_proj.weight.data = att.k_proj.weight.data.clone()
    assert eng._do_swap(list(load_state_dict(arch_dir).items()), "8", False, "disk") == "8"
    assert drive(eng, load_model(arch_dir).requires_grad_(False)) < TOL
    assert eng._do_swap(named, "9", False, "disk") == "9"
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.no_grad():  # the engine's own HF modules hold the new weights too
        assert torch.equal(
            eng.model(input_ids=ids).logits, load_model(new_dir)(input_ids=ids).logits
        )


def test_unsupported_architecture_falls_back(tmp_path: Path, caplog) -> None:
    """A model the lean forward does not cover (GELU MLP) runs the transformers forward,
    says so in the log, and still matches the reference."""
    folder = save_model("qwen3-gelu", tmp_path / "gelu", seed=1)
    with caplog.at_level(logging.INFO, logger="harnessrl.engine"):
        eng = load_engine(folder)
    assert eng.lean is None
    assert "lean forward off (activation 'gelu' is not silu)" in caplog.text
    assert drive(eng, load_model(folder).requires_grad_(False)) < 1e-3


def test_lean_forward_that_differs_is_dropped(tmp_path: Path, caplog, monkeypatch) -> None:
    """The load-time check refuses a lean forward whose logits differ from the model's
    forward (here: shifted by 1e-3) and keeps the transformers forward; ``lean_forward =
    false`` turns it off."""
    folder = save_model("qwen3", tmp_path / "q3", seed=1)
    real = LeanForward.forward
    monkeypatch.setattr(LeanForward, "__call__", lambda self, *a: real(self, *a) + 1e-3)
    with caplog.at_level(logging.WARNING, logger="harnessrl.engine"):
        eng = load_engine(folder)
    assert eng.lean is None
    assert "lean forward differs from the model's forward" in caplog.text
    assert load_engine(folder, lean_forward=False).lean is None


def test_low_precision_tolerance_scales_with_the_logits() -> None:
    """bf16 keeps 8 significant bits, so the load-time check allows 8 ulps of the largest
    logit: SmolLM2-135M's lean forward in bf16 (off by 0.58 at a largest logit of 28.3, as
    measured on an AVX2-only CPU) passes, a wrong mask (off by 17.9) does not, and small
    logits keep the 0.5 floor."""
    from harnessrl.proxy.engine.scheduler import _low_precision_tol

    tol = _low_precision_tol(torch.tensor([[-3.0, 28.25]]))
    assert tol == 1.0
    assert 0.581 <= tol < 17.9
    assert _low_precision_tol(torch.tensor([2.0, -9.0])) == 0.5  # 8 ulps of 9 = 0.5
    assert _low_precision_tol(torch.tensor([0.1])) == 0.5
    assert _low_precision_tol(torch.tensor([float("nan")])) == 0.5
    assert _low_precision_tol(torch.tensor([300.0])) == 16.0  # ulp 2 in [256, 512)
