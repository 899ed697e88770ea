"""Settings of the model-API gateway: the sampling and proxy fields that ``harnessrl proxy``
and every rollout (``harnessrl actor``/``rollout``/``eval``) share, declared once, and the
``harnessrl proxy`` config (plain pydantic models: ``--help`` builds the flags from them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from harnessrl.common.config import HrlModel, ServiceConfig
from harnessrl.common.records import check_token

DEFAULT_MAX_NEW_TOKENS = 4096
"""Output limit per call when neither the run nor the model says."""
REQUEST_BYTES_PER_TOKEN = 32
"""Request bytes allowed per token of the context window: a conversation's JSON averages 4-5
bytes per token, at most ~9 with every character ``\\u``-escaped."""
REQUEST_BYTES_SLACK = 4 << 20
"""Bytes allowed on top (images, which a text model never sees, and tool schemas)."""
REQUEST_BYTES_UNKNOWN_CONTEXT = 64 << 20
"""The limit when the context window is unknown."""


def request_bytes_limit(max_context: int, configured: int = 0) -> int:
    """The largest request body a proxy reads: ``configured``, else sized from the context
    window (`REQUEST_BYTES_PER_TOKEN` per token + `REQUEST_BYTES_SLACK`; 0: unknown)."""
    if configured:
        return configured
    if not max_context:
        return REQUEST_BYTES_UNKNOWN_CONTEXT
    return REQUEST_BYTES_PER_TOKEN * max_context + REQUEST_BYTES_SLACK


def _shipped_limit() -> str:
    from harnessrl.common.models.resolve import SHIPPED, declared_max_new_tokens

    return str(declared_max_new_tokens(SHIPPED["tiny-agent"]) or "none")


_MAX_NEW_TOKENS_DOC = (
    "Most tokens one call may generate (a harness's max_tokens can only lower it); 0: the "
    "model's own limit (``max_new_tokens`` in its ``generation_config.json``; ``tiny-agent`` "
    f"declares {_shipped_limit()}), else {DEFAULT_MAX_NEW_TOKENS}."
)
"""The doc of ``max_new_tokens``, quoting what the shipped model's files say."""


class SamplingSettings(HrlModel):
    """How the engines sample every call of a rollout (set by the run, never by the harness;
    what was used is recorded in each CallRecord's ``sampling``)."""

    temperature: float = Field(1.0, ge=0.0, le=5.0)
    """Sampling temperature of every call (the harness's own value is recorded, not used)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    """Top-k sampling; -1 disables it."""
    max_new_tokens: int = Field(0, ge=0, le=1_000_000, description=_MAX_NEW_TOKENS_DOC)


class ProxySettings(SamplingSettings):
    """What a proxy needs to serve calls: the engines, the model whose tokenizer and chat
    template build the prompts, the tool-call parser, the context window, and sampling."""

    engines: list[str] = ["http://127.0.0.1:30000"]
    """Engine URLs speaking SGLang's native API (repeat the flag for several); calls of one
    rollout stick to one engine."""
    model: str = "tiny-agent"
    """Folder, hub id (``owner/name``), ``tiny-agent``, ``smollm2-135m`` (SmolLM2-135M-Instruct
    dequantized from a 4-bit GGUF) or a tiny spec such as ``tiny-1m``, whose tokenizer and chat
    template build the prompts; must match the engines' model."""
    parser: Literal["hermes", "qwen"] = "hermes"
    """Tool-call parser for the model's output."""
    model_name: str = Field("harnessrl", min_length=1, max_length=200)
    """Model name the harness is told to use (and ``/v1/models`` reports); some harnesses pick
    prompts and tools by it."""
    max_context: int = Field(0, ge=0, le=10_000_000)
    """Context window in tokens; 0 asks the engine (``/model_info``, then ``/server_info``)."""
    max_request_bytes: int = Field(0, ge=0, le=1 << 40)
    """Largest request body a harness may send; a larger one is refused with 413 before it
    is read (by its Content-Length, or once a chunked body passes it). 0: sized from the
    context window, 32 bytes per token + 4 MiB (64 MiB when the context is unknown)."""
    engine_api_key_file: str = ""
    """File holding the engines' API key (sent as ``Authorization: Bearer KEY`` on every
    engine call; SGLang's ``--api-key``); empty: the key a ``harnessrl engine`` of this user
    on this machine serves with by default (``~/.cache/harnessrl/engine-api-key``) when that
    file exists, else none. Never enters a sandbox."""

    def request_limit(self, max_context: int) -> int:
        """The request body limit for a context window of ``max_context`` tokens."""
        return request_bytes_limit(max_context, self.max_request_bytes)

    def output_limit(self) -> int:
        """``max_new_tokens``, or when 0 the model's own limit (else `DEFAULT_MAX_NEW_TOKENS`)."""
        if self.max_new_tokens:
            return self.max_new_tokens
        from harnessrl.common.models import model_max_new_tokens

        return model_max_new_tokens(self.model) or DEFAULT_MAX_NEW_TOKENS

    @field_validator("engines")
    @classmethod
    def _engine_urls(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one engine URL is needed")
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        return v


class ProxyConfig(ServiceConfig, ProxySettings):
    """``harnessrl proxy``: the model-API gateway of one sandbox (or a few rollouts)."""

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
    harness: str = Field("", max_length=200)
    """Harness adapter whose calls this proxy serves (``claude-code``, ``opencode``...),
    recorded on every CallRecord of every rollout of the token map; empty: unknown."""
    harness_version: str = Field("", max_length=200)
    """Version of that harness as installed, recorded on every CallRecord; empty: unknown."""
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
