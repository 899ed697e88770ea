"""The embedded engine on a real model: ``smollm2-135m`` (SmolLM2-135M-Instruct, Llama, 30
layers, GQA 9/3 heads, tied embeddings; dequantized 4-bit weights, float32).

* The lean forward against the ``transformers`` forward, on the packed steps a scheduler takes
  (two first chunks, a chunk after cached KV next to decode rows, dense and non-dense decode)
  over real chat prompts: the same logits to ``LEAN_TOL`` (measured 8.6e-5 on logits of
  magnitude ~20 after 30 layers; not bitwise: the lean forward fuses q/k/v and gate/up into one
  matmul each, which sums in another order).
* ``/generate`` with ``input_ids`` and ``return_logprob``: greedy output is the argmax of a
  fresh full forward and its log-probs equal that forward's to 1e-4; the model stops on the
  end id of its own ``generation_config.json``; ``sampling_seed`` reproduces a sample exactly
  and another seed gives another; ``stop_token_ids`` stop where asked.
* ``harnessrl engine --model <hub id>`` resolved offline from a test HF cache serves the same
  tokens; the engine's memory while serving a conversation (RSS of the process).
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from harnessrl.common.models import load_model, load_tokenizer
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine.lean import LeanForward
from harnessrl.proxy.engine.scheduler import Engine
from harnessrl.proxy.engine_cmd import spawn_engine
from tests.smollm2_env import HUB_ID, offline_env
from tests.test_engine_lean import drive

LEAN_TOL = 2e-4  # |logit| difference, fp32 (measured 8.6e-5: 4e-6 of the largest logit)
LOGPROB_TOL = 1e-4
GB = 1 << 30
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok(smollm2: Path):
    return load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def ref(smollm2: Path):
    return load_model(smollm2).requires_grad_(False)


def chat_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0].float()


# ------------------------------------------------------------------------------------------
# lean forward vs transformers
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lean_forward_equals_transformers_forward(smollm2: Path, ref, tok) -> None:
    eng = Engine(EngineConfig(model=str(smollm2), port=0, threads=2))
    eng.load()
    assert isinstance(eng.lean, LeanForward)
    eng.pool = eng._new_pool(4)
    code = "def f(x):\n    return x ** 2  # 🙂\n\n\nprint(f(12), 'héllo')   \n"
    ask = "What is the capital of France? Answer in one sentence, then name two museums there."
    prompts = [
        [{"role": "user", "content": ask}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": code * 2}],
        [{"role": "user", "content": "Liste les fichiers, s'il te plaît.   \n\n" * 3}],
    ]
    seqs = {s: chat_ids(tok, m) for s, m in enumerate(prompts)}
    scale = (min(len(t) for t in seqs.values()) - 7) // 9  # prefill chunks of real length
    assert scale >= 4
    err = drive(eng, ref, seqs, scale)
    assert err < LEAN_TOL, err
    print(f"lean vs transformers, SmolLM2 fp32: max |logit diff| {err:.2e}")


# ------------------------------------------------------------------------------------------
# /generate
# ------------------------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def engine_process(flags: list[str], env: dict[str, str] | None = None):
    proc, url = spawn_engine(
        ["--port", "0", "--threads", "2", "--insecure", *flags], timeout=300, env=env
    )
    try:
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.fixture(scope="module")
def served():
    """``harnessrl engine --model smollm2-135m`` (float32): its process and URL."""
    with engine_process(["--model", "smollm2-135m"]) as running:
        yield running


def generate(url: str, ids: list[int], **sp: Any) -> dict[str, Any]:
    return _post(
        url + "/generate", {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    )


def sampled(reply: dict[str, Any]) -> tuple[list[int], list[float]]:
    rows = reply["meta_info"]["output_token_logprobs"]
    return [t for _, t, _ in rows], [lp for lp, _, _ in rows]


def check_logprobs(ref, prompt: list[int], out: list[int], got: list[float]) -> torch.Tensor:
    """The reply's log-probs against a fresh full forward (temperature 1, no truncation);
    returns the logits of the positions that predicted ``out``."""
    logits = ref_logits(ref, prompt + out)[len(prompt) - 1 : -1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0]
    err = float((want - torch.tensor(got)).abs().max())
    assert err < LOGPROB_TOL, err
    return logits


@pytest.mark.slow
def test_generate_greedy_stops_on_generation_config_eos(
    served: tuple, ref, tok, smollm2: Path
) -> None:
    _, url = served
    prompt = chat_ids(tok, QUESTION)
    with urllib.request.urlopen(url + "/get_model_info", timeout=30) as r:
        info = json.loads(r.read())
    eos = json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"]
    assert info["eos_token_ids"] == [eos] == [tok.eos_token_id] == [2]
    reply = generate(url, prompt, max_new_tokens=40, temperature=0.0)
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    out, lps = sampled(reply)
    assert out[-1] == 2 and reply["output_ids"] == out[:-1]  # trimmed, as SGLang does
    assert "Paris" in reply["text"] and meta["prompt_tokens"] == len(prompt)
    logits = check_logprobs(ref, prompt, out, lps)
    assert logits.argmax(-1).tolist() == out  # greedy: each token the forward's argmax


@pytest.mark.slow
def test_generate_sampling_seed_and_stop_ids(served: tuple, ref, tok) -> None:
    _, url = served
    prompt = chat_ids(tok, [{"role": "user", "content": "Write a haiku about the sea."}])
    sp = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    a = generate(url, prompt, sampling_seed=11, **sp)
    b = generate(url, prompt, sampling_seed=11, **sp)
    c = generate(url, prompt, sampling_seed=12, **sp)
    assert sampled(a)[0] == sampled(b)[0]  # the same sample again (b's prompt KV is cached:
    diff = torch.tensor(sampled(a)[1]) - torch.tensor(sampled(b)[1])  # log-probs to ~1e-6)
    assert float(diff.abs().max()) < LOGPROB_TOL
    assert sampled(a)[0] != sampled(c)[0]
    out, lps = sampled(a)
    check_logprobs(ref, prompt, out, lps)
    stop = out[5]
    d = generate(url, prompt, sampling_seed=11, stop_token_ids=[stop], **sp)
    first = out.index(stop)
    assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert sampled(d)[0] == out[: first + 1]


# ------------------------------------------------------------------------------------------
# harnessrl engine: a hub id, offline; memory
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_engine_serves_a_hub_id_offline(smollm2_hf_home: Path, tok) -> None:
    """``harnessrl engine --model harnessrl-test/smollm2-135m-dequantized`` with a test HF
    cache and ``HF_HUB_OFFLINE=1``: the snapshot folder is served, greedily the same answer."""
    prompt = chat_ids(tok, QUESTION)
    with engine_process(["--model", HUB_ID], env=offline_env(smollm2_hf_home)) as (proc, url):
        with urllib.request.urlopen(url + "/get_model_info", timeout=30) as r:
            info = json.loads(r.read())
        assert "models--harnessrl-test--smollm2-135m-dequantized" in info["model_path"]
        reply = _post(url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 40, "temperature": 0.0}})  # fmt: skip
        assert "Paris" in reply["text"]


def converse(url: str, n_prompt: int = 1200, calls: int = 3) -> None:
    """An agent-like conversation: a long prompt extended by each reply and a tool result."""
    rng = random.Random(0)
    prompt = [rng.randrange(20, 49000) for _ in range(n_prompt)]
    sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    for k in range(calls):
        reply = _post(url + "/generate", {"input_ids": prompt, "sampling_params": sp})
        prompt = prompt + reply["output_ids"] + [rng.randrange(20, 49000) for _ in range(60)]
        assert k == 0 or reply["meta_info"]["cached_tokens"] > n_prompt  # prefix cache in use


@pytest.mark.slow
def test_engine_memory_serving_a_conversation() -> None:
    """RSS of ``harnessrl engine --model smollm2-135m --dtype bfloat16`` serving an agent-like
    conversation (a 1.2k-token prompt extended over three calls, the prefix cache in use):
    within the 1 GB target. In float32 (the next test) the 0.54 GB of weights next to 0.3 GB of
    torch and transformers leave no room for it."""
    with engine_process(["--model", "smollm2-135m", "--dtype", "bfloat16"]) as (proc, url):
        ready = _rss(proc.pid)
        converse(url)
        serving = _rss(proc.pid)
    print(f"engine bfloat16: RSS {ready / GB:.2f} GB ready, {serving / GB:.2f} GB serving")
    assert serving <= 1.0 * GB, (ready, serving)


@pytest.mark.slow
def test_float32_engine_memory(served: tuple) -> None:
    """The float32 engine, the same conversation: measured 0.94 GB ready and 1.1-1.2 GB serving
    (above the 1 GB target); the bound guards against regressions such as the weights staying
    resident twice through the safetensors mapping (1.29 GB before serving anything)."""
    proc, url = served
    converse(url)
    serving = _rss(proc.pid)
    print(f"engine float32: RSS {serving / GB:.2f} GB serving")
    assert serving <= 1.25 * GB, serving
