"""Config models of the processes at the model boundary (engine, proxy).

Plain pydantic models (no heavy imports): ``harnessrl COMMAND --help`` builds its flags from them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config import HrlModel


class EngineConfig(HrlModel):
    """``harnessrl engine``: the embedded torch engine speaking SGLang's native HTTP API."""

    model: str = "tiny"
    """Model folder (any Hugging Face causal LM with safetensors) or a tiny spec (``tiny``,
    ``tiny-1m``, ``tiny-8m@seed1``...) built offline on first use."""
    tokenizer: str = ""
    """Tokenizer folder; empty uses the model folder (without one, replies carry empty text)."""
    host: str = "127.0.0.1"
    """Address to listen on (loopback by default)."""
    port: int = Field(30000, ge=0, le=65535)
    """HTTP port (SGLang's default is 30000); 0 picks a free port."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights, activations and KV cache dtype (log-probs are always computed in float32)."""
    max_batch_size: int = Field(16, ge=1, le=1024)
    """Requests decoded together in one batched forward; more wait in the queue."""
    max_queue: int = Field(4096, ge=1, le=1_000_000)
    """Waiting requests beyond which ``/generate`` answers 503 (overloaded, retry later)."""
    max_context: int = Field(0, ge=0, le=10_000_000)
    """Longest prompt + completion, tokens; 0 uses the model's ``max_position_embeddings``."""
    prefill_chunk: int = Field(1024, ge=16, le=1_000_000)
    """Prompt tokens computed per scheduler step (long prompts are prefilled in chunks between
    decode steps, which bounds memory and keeps running requests moving)."""
    prefix_cache_mb: int = Field(1024, ge=0, le=1_000_000)
    """Memory for the LRU prefix cache of KV (MiB); 0 disables it."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Base seed; a request without ``sampling_seed`` gets one derived from it and its order."""
    weight_version: str = Field("0", min_length=1, max_length=128)
    """Weight version reported before the first update (a string, as in SGLang)."""
    threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads; 0 keeps torch's default (one per core)."""
    dist_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """Timeout of the distributed weight-update group (joining it and each broadcast)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Logging level."""
