"""Tests for the harnessrl.common.models package: tiny model/tokenizer factory, chat template, loaders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl.common import models as m

REPO = Path(__file__).resolve().parents[1]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "files."}],
    },
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should run ls.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "bash", "arguments": {"command": "ls"}},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "pwd"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"},
    {"role": "tool", "tool_call_id": "c2", "content": "/work"},
    {"role": "assistant", "content": "Two files.", "reasoning_content": "Done."},
]

EXPECTED = (
    "<|im_start|>system\nYou are helpful.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
    'tags:\n<tools>\n{"type": "function", "function": {"name": "bash", "description": "Run a '
    'command", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, '
    '"required": ["command"]}}}\n</tools>\n\nFor each function call, return a json object with '
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nList files.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nI should run ls.\n</think>\n\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response>\n"
    "<tool_response>\n/work\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\nDone.\n</think>\n\nTwo files.<|im_end|>\n"
)

# A longer agent conversation for the prefix properties.
LONG = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the failing test in src/app.py, please."},
    {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "First read the file.",
        "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "cat src/app.py"}}}],
    },
    {"role": "tool", "content": "def add(a, b):\n    return a - b\n"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "",
        "tool_calls": [
            {"function": {"name": "bash", "arguments": {"command": "sed -i 's/-/+/' src/app.py"}}},
            {"function": {"name": "bash", "arguments": '{"command": "pytest -q"}'}},
        ],
    },
    {"role": "tool", "content": ""},
    {"role": "tool", "content": "1 passed in 0.01s"},
    {"role": "assistant", "content": "Fixed: `add` subtracted instead of adding."},
    {"role": "user", "content": "Thanks! Anything else?"},
    {"role": "assistant", "content": "No, that's all.", "reasoning_content": "Nothing left."},
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("harnessrl-cache")


@pytest.fixture(scope="module")
def tiny_dir(cache: Path) -> Path:
    return m.resolve_model("tiny", cache_dir=cache)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    return m.load_tokenizer(tiny_dir)


# ------------------------------------------------------------------------------------------
# Import hygiene
# ------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_import_does_not_import_torch() -> None:
    code = (
        "import sys, harnessrl.common.models; "
        "bad = [n for n in ('torch', 'transformers', 'tokenizers', 'jinja2') if n in sys.modules]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


# ------------------------------------------------------------------------------------------
# Build, cache, determinism
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_tiny_folder_layout(tiny_dir: Path, cache: Path) -> None:
    assert tiny_dir.parent == cache / "models"
    assert tiny_dir.name.startswith("tiny-8m-s0-")
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        assert (tiny_dir / name).is_file(), name
    assert (tiny_dir / "chat_template.jinja").read_text() == m.CHAT_TEMPLATE
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == m.CHAT_TEMPLATE
    # Resolving again is a cache hit, and so is the alias.
    assert m.resolve_model("tiny-8m", cache_dir=cache) == tiny_dir
    assert m.resolve_model("tiny-8m@seed0", cache_dir=cache) == tiny_dir
    assert not list((cache / "models").glob(".tmp-*"))


@pytest.mark.unit
def test_deterministic_build(tiny_dir: Path, tmp_path: Path) -> None:
    other = m.resolve_model("tiny", cache_dir=tmp_path)
    assert other.name == tiny_dir.name
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (tiny_dir / name).read_bytes(), name


@pytest.mark.unit
def test_seed_changes_weights_not_tokenizer(tiny_dir: Path, cache: Path) -> None:
    a = m.resolve_model("tiny-1m", cache_dir=cache)
    b = m.resolve_model("tiny-1m@seed1", cache_dir=cache)
    assert a.name.startswith("tiny-1m-s0-") and b.name.startswith("tiny-1m-s1-")
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


@pytest.mark.unit
def test_param_counts() -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    targets = {"tiny-1m": 1e6, "tiny-8m": 8e6, "tiny-30m": 30e6}
    for size, target in targets.items():
        with torch.device("meta"):
            model = Qwen3ForCausalLM(m._tiny_config(size))
        n = model.num_parameters()
        assert 0.6 * target <= n <= 1.4 * target, (size, n)


@pytest.mark.unit
def test_model_info(tiny_dir: Path) -> None:
    info = m.model_info(tiny_dir)
    assert info["vocab_size"] == 8192
    assert info["max_position_embeddings"] >= 32768
    assert info["eos_token_ids"] == [2, 0]
    assert info["tie_word_embeddings"] is True
    assert info["model_type"] == "qwen3"
    model = m.load_model(tiny_dir)
    assert info["n_params"] == model.num_parameters()


@pytest.mark.unit
def test_build_race_keeps_winner(tmp_path: Path) -> None:
    final = tmp_path / "models" / "thing"

    def build(tmp: Path) -> None:
        (tmp / "mine").write_text("loser")
        # Another process finishes first while we build.
        final.mkdir(parents=True)
        (final / "theirs").write_text("winner")
        (final / ".complete").write_text("ok\n")

    assert m._build_atomically(final, build) == final
    assert (final / "theirs").exists() and not (final / "mine").exists()
    assert sorted(p.name for p in final.parent.iterdir() if not p.name.endswith(".lock")) == [
        "thing"
    ]


@pytest.mark.unit
def test_default_cache_env(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path, cache: Path) -> None:
    monkeypatch.setenv("HARNESSRL_CACHE", str(cache))
    assert m.default_cache_dir() == cache
    assert m.resolve_model("tiny") == tiny_dir  # cache hit, nothing is built


# ------------------------------------------------------------------------------------------
# resolve_model errors
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_parse_tiny_spec() -> None:
    assert m.parse_tiny_spec("tiny") == ("tiny-8m", 0)
    assert m.parse_tiny_spec("tiny-30m@seed3") == ("tiny-30m", 3)
    assert m.parse_tiny_spec("tiny-2m") is None
    assert m.parse_tiny_spec("/models/qwen") is None


@pytest.mark.unit
@pytest.mark.parametrize("spec", ["tiny-2m", "tiny@seed", "tiny-8m@3", "", "/no/such/model/dir"])
def test_resolve_model_rejects_bad_specs(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        m.resolve_model(spec, cache_dir=tmp_path)
    assert not (tmp_path / "models").exists()


@pytest.mark.unit
def test_resolve_model_local_paths(tmp_path: Path, tiny_dir: Path) -> None:
    assert m.resolve_model(str(tiny_dir)) == tiny_dir
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        m.resolve_model(str(f))
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        m.resolve_model(str(tmp_path))


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_tokenizer_basics(tok) -> None:
    from transformers import PreTrainedTokenizerFast

    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 8192
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.encode("hello", add_special_tokens=True) == tok.encode(
        "hello", add_special_tokens=False
    )
    ids = m.special_token_ids(tok)
    assert set(ids) == set(m.SPECIAL_TOKENS) | set(m.ADDED_TOKENS)
    assert len(set(ids.values())) == len(ids)
    for token, i in ids.items():
        assert tok.encode(token, add_special_tokens=False) == [i], token
        assert tok.decode([i]) == token
    assert m.eos_token_ids(tok) == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    # Tool/think tags are single ids even glued to text, and are not stripped as special.
    text = 'x<tool_call>{"a": 1}</tool_call><think>hm</think>'
    enc = tok.encode(text, add_special_tokens=False)
    for t in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert ids[t] in enc
    assert tok.decode(enc + [ids["<|im_end|>"]], skip_special_tokens=True) == text


@pytest.mark.unit
@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        json.dumps({"name": "bash", "arguments": {"command": "ls -la /tmp", "n": [1, 2.5, None]}}),
        "def f(x):\n    return x  # comment\n\n\n\tindented\r\nwindows line",
        "unicode: héllo wörld — 日本語 🙂 \u200b \x00 \\n",
        "   leading and trailing spaces   ",
        "",
    ],
)
def test_tokenizer_round_trip(tok, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.unit
def test_raw_tokenizers_library_matches(tok, tiny_dir: Path) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    text = m.render_chat(CONVERSATION, tools=TOOLS)
    assert raw.encode(text, add_special_tokens=False).ids == tok.encode(
        text, add_special_tokens=False
    )
    assert m.eos_token_ids(raw) == m.eos_token_ids(tok)
    assert m.special_token_ids(raw) == m.special_token_ids(tok)


@pytest.mark.unit
def test_compression(tok) -> None:
    english = (
        "When the server returns an error, the client should retry the request after a short "
        "delay. We tested the new feature on Monday and found that the results were better than "
        "expected, although some users reported problems with the configuration file. Please "
        "read the documentation before you change any settings, and run the tests again."
    )
    js = json.dumps(
        {
            "name": "read_file",
            "arguments": {"path": "/home/user/project/src/main.py", "limit": 200},
            "status": "ok",
            "items": [1, 2, 3],
            "message": "File not found, please check the path.",
        }
    )
    code = 'def load_config(path: str) -> dict:\n    """Load the configuration."""\n    return {}\n'
    for text, bound in ((english, 0.35), (js, 0.45), (code, 0.45), (english + js + code, 0.4)):
        ratio = len(tok.encode(text, add_special_tokens=False)) / len(text)
        assert ratio <= bound, (text[:40], ratio)


# ------------------------------------------------------------------------------------------
# Chat template
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_template_exact(tok) -> None:
    assert m.render_chat(CONVERSATION, tools=TOOLS) == EXPECTED
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == EXPECTED
    gen = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert gen == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nList files.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert m.render_chat(CONVERSATION[:2], add_generation_prompt=True) == gen
    no_think = m.render_chat(CONVERSATION[:2], add_generation_prompt=True, enable_thinking=False)
    assert no_think == gen + "<think>\n\n</think>\n\n"


@pytest.mark.unit
def test_template_small_cases() -> None:
    assert m.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert m.render_chat([{"role": "user", "content": "hi"}], tools=TOOLS).startswith(
        "<|im_start|>system\n# Tools\n\n"
    )
    # `reasoning` (no `reasoning_content`) is accepted too; empty reasoning still renders a block.
    out = m.render_chat([{"role": "assistant", "content": "ok", "reasoning": ""}])
    assert out == "<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>\n"
    out = m.render_chat(
        [
            {
                "role": "assistant",
                "content": "Running.",
                "tool_calls": [{"name": "x", "arguments": {}}],
            }
        ]
    )
    assert out == (
        '<|im_start|>assistant\nRunning.\n<tool_call>\n{"name": "x", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
    )


@pytest.mark.unit
def test_template_keeps_earlier_reasoning(tok) -> None:
    text = tok.apply_chat_template(LONG, tokenize=False)
    assert "<think>\nFirst read the file.\n</think>\n\nLet me look." in text
    assert "<think>\nNothing left.\n</think>" in text
    assert text.count("<tool_response>") == 3
    assert text.count("<|im_start|>user\n<tool_response>") == 2  # tool results grouped


@pytest.mark.unit
def test_template_prefix_property(tok) -> None:
    for convo, tools in ((LONG, TOOLS), (LONG, None), (CONVERSATION, TOOLS)):
        for n in range(1, len(convo)):
            if convo[n - 1]["role"] != "assistant":
                continue
            short = m.render_chat(convo[:n], tools=tools)
            full = m.render_chat(convo[: n + 1], tools=tools)
            assert full.startswith(short), n
            # Token level too: the new part starts with a special token, so BPE never merges
            # across the boundary.
            ids_short = tok.encode(short, add_special_tokens=False)
            ids_full = tok.encode(full, add_special_tokens=False)
            assert ids_full[: len(ids_short)] == ids_short
            assert ids_full[len(ids_short) :] == tok.encode(
                full[len(short) :], add_special_tokens=False
            )


@pytest.mark.unit
def test_generation_round_trip() -> None:
    """What the model generates after the generation prompt, plus <|im_end|> and the template's
    newline, equals the render of the parsed assistant message."""
    history = LONG[:4]
    completion = (
        '<think>\nNow fix it.\n</think>\n\nEditing.\n<tool_call>\n{"name": "bash", "arguments": '
        '{"command": "sed -i s/-/+/ src/app.py"}}\n</tool_call>\n<tool_call>\n{"name": "bash", '
        '"arguments": {"command":"pytest"}}\n</tool_call>'
    )
    parsed = {
        "role": "assistant",
        "reasoning_content": "Now fix it.",
        "content": "Editing.",
        "tool_calls": [
            {"function": {"name": "bash", "arguments": '{"command": "sed -i s/-/+/ src/app.py"}'}},
            {"function": {"name": "bash", "arguments": '{"command":"pytest"}'}},
        ],
    }
    prompt = m.render_chat(history, tools=TOOLS, add_generation_prompt=True)
    assert prompt + completion + "<|im_end|>\n" == m.render_chat([*history, parsed], tools=TOOLS)


# ------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_model_forward_2k(tiny_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = m.load_model(tiny_dir, dtype="float32", device="cpu")
    assert isinstance(model, torch.nn.Module) and not model.training
    assert model.config.max_position_embeddings >= 32768
    assert model.config.tie_word_embeddings
    assert (
        model.get_input_embeddings().weight.data_ptr()
        == model.get_output_embeddings().weight.data_ptr()
    )
    assert model.generation_config.eos_token_id == [2, 0]
    ids = torch.randint(
        0, model.config.vocab_size, (1, 2048), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 2048, 8192)
    assert torch.isfinite(logits).all()
    # Plain transformers loads it too (what SGLang-style engines do).
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_dir), local_files_only=True)
    assert direct.num_parameters() == model.num_parameters()
    assert m.load_model(tiny_dir, dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError):
        m.load_model(tiny_dir, dtype="float99")
