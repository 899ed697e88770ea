"""The embedded engine's ``device``: every tensor it makes is placed on the model's device.

There is no GPU here, so the engine runs on the CPU under a torch function mode that records
each tensor factory call (``torch.tensor``, ``zeros``, ``arange``...) made from the engine's
modules without a ``device`` argument: on CUDA such a call makes a CPU tensor and the step
fails on mixed devices. Sampling is exempt (it runs on the CPU by design: ``_advance`` copies
the logits back). ``benchmarks/gpu_check.py`` runs the engine on CUDA for real.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
from torch.overrides import TorchFunctionMode

from harnessrl.common.models import resolve_model
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine.requests import parse_generate
from harnessrl.proxy.engine.scheduler import Engine
from harnessrl.proxy.engine.weights import load_state_dict

pytestmark = pytest.mark.unit

ENGINE_DIR = Path(__file__).resolve().parents[1] / "proxy" / "engine"
ON_CPU_BY_DESIGN = {"sampling.py"}
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
}


class Unplaced(TorchFunctionMode):
    """Records ``file:line`` of factory calls from the engine's modules that name no device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.seen = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            self.seen += 1
            if kwargs.get("device") is None:
                frame = sys._getframe(1)
                while frame is not None and "/torch/" in frame.f_code.co_filename:
                    frame = frame.f_back
                if frame is not None:
                    path = Path(frame.f_code.co_filename)
                    if path.parent == ENGINE_DIR and path.name not in ON_CPU_BY_DESIGN:
                        self.calls.append(f"{path.name}:{frame.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


def _run(eng: Engine, bodies: list[dict[str, Any]]) -> list[Any]:
    reqs = []
    for body in bodies:
        items, _ = parse_generate(body, eng.vocab_size, eng.max_context, eng.tokenizer)
        reqs += [eng.new_request(it) for it in items]
    eng.waiting.extend(reqs)
    for _ in range(500):
        if all(r.finish is not None for r in reqs):
            return reqs
        eng._step()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("lean", [True, False])
def test_every_engine_tensor_names_its_device(lean: bool) -> None:
    """Load (self-check included), prefill in chunks, batched decode, a prefix-cache hit, a
    weight swap and generation after it: no tensor is made without the model's device."""
    cfg = EngineConfig(
        model="tiny-1m", threads=1, prefill_chunk=16, prefix_cache_mb=16, lean_forward=lean
    )
    eng = Engine(cfg)
    spy = Unplaced()
    prompt = [(5 * i + 7) % 8000 + 3 for i in range(40)]
    sp = {"max_new_tokens": 6, "ignore_eos": True}
    with torch.inference_mode(), spy:
        eng.load()
        assert (eng.lean is not None) == lean and eng.device == torch.device("cpu")
        first = _run(
            eng,
            [
                {"input_ids": prompt, "sampling_params": {**sp, "temperature": 0}},
                {"input_ids": prompt[:9], "sampling_params": {**sp, "top_k": 5, "top_p": 0.9}},
            ],
        )
        again = _run(eng, [{"input_ids": prompt + [11, 12], "sampling_params": sp}])
        assert again[0].cached_tokens > 0  # the prefix cache's KV went back into the pool
        named = list(load_state_dict(resolve_model("tiny-1m@seed1")).items())
        assert eng._do_swap(named, "1", False, "disk") == "1"
        after = _run(eng, [{"input_ids": prompt[:20], "sampling_params": sp}])
    assert spy.seen > 50  # the mode saw the engine's factory calls
    assert spy.calls == [], sorted(set(spy.calls))
    assert all(len(r.output) == 6 for r in first + again + after)
    assert after[0].version_end == "1"


def test_a_device_that_is_not_there_is_a_clear_error() -> None:
    with pytest.raises(pydantic.ValidationError, match="device"):
        EngineConfig(device="gpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device"):
        Engine(EngineConfig(model="tiny-1m", device="cuda")).load()
