"""``harnessrl proxy`` config (a plain pydantic model: ``--help`` builds its flags from it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.config import ServiceConfig
from common.records import check_token


class ProxyConfig(ServiceConfig):
    """``harnessrl proxy``: the model-API gateway of one sandbox (or a few rollouts)."""

    engines: list[str] = ["http://127.0.0.1:30000"]
    """Engine URLs speaking SGLang's native API (repeat the flag for several); calls of one
    rollout stick to one engine."""
    model: str = "tiny"
    """Folder (or tiny spec) whose tokenizer and chat template build the prompts; must match
    the engines' model."""
    parser: Literal["hermes", "qwen"] = "hermes"
    """Tool-call parser for the model's output."""
    model_name: str = "harnessrl"
    """Model id reported by ``/v1/models`` (harnesses accept any name)."""
    host: str = "127.0.0.1"
    """Address to listen on (loopback: the sandbox reaches it through its forwarder)."""
    port: int = Field(0, ge=0, le=65535)
    """HTTP port; 0 picks a free one (printed in the ready line)."""
    token: str = ""
    """API key the harness must send (Bearer or x-api-key); its calls belong to ``rollout_id``."""
    rollout_id: str = ""
    """Rollout of the calls made with ``token``."""
    tokens: dict[str, str] = {}
    """More ``{token: rollout_id}`` pairs (JSON on the command line)."""
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    """Sampling temperature of every call (the harness's value is recorded, not used)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = Field(4096, ge=1, le=1_000_000)
    """Most tokens one call may generate (the harness's own max_tokens can only lower it)."""
    max_context: int = Field(0, ge=0, le=10_000_000)
    """Context window in tokens; 0 asks the engine (``/get_model_info``)."""
    record_buffer: int = Field(256, ge=1, le=1_000_000)
    """CallRecords that may wait for the bus before new calls are refused with 503."""
    health_interval_s: float = Field(2.0, gt=0, le=3600)
    """Seconds between engine health checks."""
    ping_s: float = Field(5.0, gt=0, le=600)
    """Seconds between keep-alive events of a pseudo-stream."""
    stream_grace_s: float = Field(2.0, ge=0, le=600)
    """Seconds a stream's headers are held back so a fast failure still gets a real status."""
    flush_timeout_s: float = Field(60.0, gt=0, le=3600)
    """On shutdown, how long to wait for the bus to acknowledge every record."""

    @model_validator(mode="after")
    def _token_pair(self) -> ProxyConfig:
        if bool(self.token) != bool(self.rollout_id):
            raise ValueError("token and rollout_id go together")
        if not self.token and not self.tokens:
            raise ValueError("set token + rollout_id (or tokens): every call needs a rollout")
        for rid in self.token_map().values():
            check_token(rid, "rollout_id")
        return self

    def token_map(self) -> dict[str, str]:
        return {**self.tokens, **({self.token: self.rollout_id} if self.token else {})}
