"""Wire records: the typed msgpack messages every harnessrl process exchanges over JetStream.

Invariants (everything else relies on these):

* Every record is a msgspec ``Struct`` encoded as *standard* msgpack (a map of field names), so a
  record written here decodes with the plain ``msgpack`` package. Each carries ``record`` (its
  type name) and ``schema_version``.
* Token ids travel as packed little-endian ``int32`` bytes and log-probs as ``float32`` bytes
  (``pack_ids`` / ``pack_f32``), never as lists: a 2k-token call is 8 KiB of ids, not 10 KiB of
  msgpack ints or 14 KiB of JSON.
* Encoded payloads above ``COMPRESS_THRESHOLD`` bytes are zstd frames. A frame is recognised by
  the zstd magic number; a msgpack map never starts with those bytes.
* ``decode`` raises ``RecordDecodeError`` (and nothing else) for garbage, a wrong record type, a
  missing field, or a ``schema_version`` newer than this code understands. Consumers dead-letter
  such messages instead of retrying them forever.

Identity: the feeder issues ``TaskRequest(group_id, k, group_size, issued_version)``; the actor
names the rollout ``<group_id>-<k>-<attempt>`` where attempt is the delivery count of the task
message, so a redelivered task is a new *attempt* of the same group member, never an extra member.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar

import msgspec
import numpy as np
import zstandard

SCHEMA_VERSION = 1
"""The schema version this code writes and the newest it reads."""

COMPRESS_THRESHOLD = 1024
"""Encoded records larger than this many bytes are zstd-framed."""

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

ZSTD_LEVEL = int(os.environ.get("HRL_ZSTD_LEVEL", "-3"))
"""zstd level for framed records; negative levels trade ratio for speed (token ids are
high-entropy: level 3 buys ~10% smaller frames at twice the CPU). Env: ``HRL_ZSTD_LEVEL``."""

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,200}$")

_zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
_zd = zstandard.ZstdDecompressor()


class RecordDecodeError(ValueError):
    """A payload is not a valid record of the expected type (garbage, wrong type, newer schema)."""


# ---------------------------------------------------------------------------------------------
# packed arrays and identity helpers
# ---------------------------------------------------------------------------------------------


def pack_ids(ids: Any) -> bytes:
    """Token ids -> packed little-endian int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """Packed int32 bytes -> read-only numpy int32 array (no copy)."""
    return np.frombuffer(data, dtype="<i4")


def pack_f32(values: Any) -> bytes:
    """Float values (log-probs) -> packed little-endian float32 bytes."""
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(data: bytes) -> np.ndarray:
    """Packed float32 bytes -> read-only numpy float32 array (no copy)."""
    return np.frombuffer(data, dtype="<f4")


def pack_u8(values: Any) -> bytes:
    """Small ints (loss masks) -> uint8 bytes."""
    return np.asarray(values, dtype=np.uint8).tobytes()


def unpack_u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def ids_hash(ids: Any) -> bytes:
    """blake2b-128 of a token sequence's int32 LE bytes: how a CallRecord's full input is verified."""
    data = ids if isinstance(ids, bytes | bytearray | memoryview) else pack_ids(ids)
    return hashlib.blake2b(data, digest_size=16).digest()


def check_token(value: str, what: str = "token") -> str:
    """Validate a NATS subject token (run names, group ids, rollout ids): ``[A-Za-z0-9_-]``."""
    if not isinstance(value, str) or not _TOKEN_RE.match(value):
        raise ValueError(
            f"{what} {value!r} must be 1-200 characters of [A-Za-z0-9_-] (it is a subject token)"
        )
    return value


def rollout_id(group_id: str, k: int, attempt: int) -> str:
    """The rollout id of attempt ``attempt`` (delivery count, >= 1) of group member ``k``."""
    check_token(group_id, "group_id")
    if k < 0 or attempt < 1:
        raise ValueError(f"bad rollout identity k={k} attempt={attempt}")
    return f"{group_id}-{k}-{attempt}"


def member_claim(key: bytes, group_id: str, k: int) -> str:
    """The claim of group member ``k``: an HMAC of its identity under the run's claim key
    (``Bus.claim_key``). The feeder puts it in the member's TaskRequest, which only the actor
    it is delivered to sees; that actor copies it into its RolloutResult, and the assembler
    recomputes it: a result for a member its publisher was never handed is refused."""
    msg = f"{check_token(group_id, 'group_id')}:{int(k)}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:32]


def parse_rollout_id(rid: str) -> tuple[str, int, int]:
    """Inverse of ``rollout_id``: ``(group_id, k, attempt)``."""
    check_token(rid, "rollout_id")
    group_id, k, attempt = rid.rsplit("-", 2)
    return group_id, int(k), int(attempt)


# ---------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------


class Record(msgspec.Struct, kw_only=True, omit_defaults=False):
    """Base of every wire record."""

    record: str = ""
    """Record type name (set automatically); lets tools tell records apart on the wire."""
    schema_version: int = SCHEMA_VERSION
    """Schema version the producer wrote; decoders reject versions newer than ``SCHEMA_VERSION``."""

    KIND: ClassVar[str] = ""
    COMPRESS: ClassVar[bool | None] = None
    """Whether ``encode`` zstd-frames this type: None decides by size (``COMPRESS_THRESHOLD``);
    False for incompressible payloads (weight chunks), which framing would only slow down."""
    SCATTER: ClassVar[str] = ""
    """Name of this type's last field when it is a large buffer (weight chunks): ``encode_many``
    returns such a record as ``Scattered`` (the msgpack bytes up to that buffer's contents, then
    the buffer itself), which the bus sends without copying the buffer. Joined, the two are
    exactly ``encode``'s bytes; the type must never compress."""

    def __post_init__(self) -> None:
        if not self.record:
            self.record = type(self).__name__


class TaskRequest(Record, kw_only=True):
    """One rollout to run: group member ``k`` of ``group_size`` for (task, harness).

    Producer: learner feeder. Consumer: actors (work queue, durable consumer ``actors``).
    Subject: ``hrl.<run>.tasks``. Idempotency key: ``task:<group_id>:<k>``.
    The actor names the rollout ``rollout_id(group_id, k, delivery_count)``.
    """

    group_id: str
    """Group identity, shared by the ``group_size`` members of one (task, harness) group."""
    k: int
    """Member index within the group, ``0 <= k < group_size``."""
    group_size: int
    """Number of members issued for this group (GRPO's n)."""
    issued_version: int
    """Learner weight version when the feeder issued the task (for staleness accounting)."""
    task_id: str
    """Task identifier within its suite (or a task folder path)."""
    suite: str = ""
    """Suite the task belongs to ("" when ``task_id`` is a path)."""
    harness: str = "reference"
    """Harness adapter name (``reference``, ``claude-code``, ``codex``, ``command`` ...)."""
    harness_cmd: str = ""
    """Command line for the ``command`` harness; empty otherwise."""
    task_hash: str = ""
    """Content hash of the task definition, so actors detect a task that changed under them."""
    timeout_s: float = 0.0
    """Wall-clock limit for the harness; 0 means the task's own default."""
    is_eval: bool = False
    """Held-out evaluation rollout: scored and reported, never trained on."""
    seed: int = 0
    """The rollout's seed: its model calls sample with engine ``sampling_seed``s derived from
    it and their seq (``harnessrl.proxy.calls.call_seed``), so the same task, seed and policy replay the
    same draws (the feeder gives each group member its own; eval gives both policies the
    same)."""
    created_at: float = 0.0
    """Unix time the feeder issued the request."""
    meta: dict[str, str] = {}
    """Free-form string annotations carried through to the RolloutResult."""
    claim: str = ""
    """`member_claim` of this member (empty when the publisher made none): the actor returns
    it in its RolloutResult as proof it was handed this member."""

    def msg_id(self) -> str:
        return f"task:{self.group_id}:{self.k}"


class SamplingParams(msgspec.Struct, kw_only=True):
    """Sampling parameters actually used for a call (set by the run's config, not the harness)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024


CallApi = Literal["chat", "messages", "responses", "generate"]
CallLabel = Literal["main", "subagent", "compaction", "aux"]
CallStatus = Literal["ok", "error", "aborted"]


class CallRecord(Record, kw_only=True):
    """One model call made by a harness, exactly as the engine saw and produced it.

    Producer: proxy. Consumer: assembler (filtered read by subject).
    Subject: ``hrl.<run>.calls.<rollout_id>``. Idempotency key: ``call:<rollout_id>:<seq>``.

    The input is a delta: ``full_input = (input_{parent} + output_{parent})[:prefix_len] +
    suffix_ids`` (with ``parent_seq == -1``: ``prefix_len == 0`` and ``suffix_ids`` is the whole
    input). ``input_len``/``input_hash`` let the assembler verify the rebuilt input.
    """

    rollout_id: str
    """Rollout this call belongs to (``<group_id>-<k>-<attempt>``)."""
    seq: int
    """0-based call number within the rollout, in order of arrival at the proxy."""
    api: CallApi = "chat"
    """Which API the harness used."""
    label: CallLabel = "main"
    """``main``, ``subagent``, ``compaction`` or ``aux`` (title generation and similar)."""
    harness: str = ""
    """Harness adapter that made the call (``claude-code``, ``codex``...; empty when unknown,
    e.g. a standalone proxy started without ``--harness``)."""
    harness_version: str = ""
    """Version of that harness as installed (empty when unknown)."""
    parent_seq: int = -1
    """Earlier call whose input+output this call's input extends; -1 for none."""
    prefix_len: int = 0
    """Number of tokens shared with the parent's input+output."""
    suffix_ids: bytes = b""
    """Packed int32 ids of the input after the shared prefix."""
    input_len: int = 0
    """Length of the full input in tokens."""
    input_hash: bytes = b""
    """``ids_hash`` of the full input."""
    output_ids: bytes = b""
    """Packed int32 ids the engine sampled (including a final stop token, if any)."""
    output_logprobs: bytes = b""
    """Packed float32 log-probs of ``output_ids`` under the sampling distribution."""
    finish_reason: str = ""
    """Engine finish reason: ``stop``, ``length`` or ``abort``."""
    weight_version_start: int = -1
    """Engine weight version when generation started."""
    weight_version_end: int = -1
    """Engine weight version when generation ended (differs when a swap happened mid-call)."""
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    """Sampling parameters used."""
    requested: dict[str, Any] = {}
    """Sampling parameters the harness asked for (recorded, ignored)."""
    status: CallStatus = "ok"
    """``ok``, ``error`` (engine or proxy failure) or ``aborted`` (client went away)."""
    error: str = ""
    """Error text when ``status != "ok"``."""
    tito_hit: bool = False
    """Whether the input reused earlier sampled ids (token-in-token-out) or was fully rendered."""
    cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache."""
    engine: str = ""
    """Engine URL that served the call."""
    t_start: float = 0.0
    """Unix time the proxy received the request."""
    t_end: float = 0.0
    """Unix time the proxy finished the reply."""
    queue_s: float = 0.0
    """Seconds spent before the engine started the request."""
    engine_s: float = 0.0
    """Seconds the engine spent generating."""
    headers: dict[str, str] = {}
    """Selected request headers used for labelling (sub-agent ids and similar)."""

    def msg_id(self) -> str:
        return f"call:{self.rollout_id}:{self.seq}"


RolloutStatus = Literal[
    "ok", "timeout", "sandbox_error", "harness_error", "verifier_error", "engine_error"
]
"""How a rollout ended. One taxonomy for every producer and consumer:

* **scored** (the model's outcome, trained on): ``ok``, the verifier scored the final workspace
  (a checker that rejects the output is a low score, not an error; one that crashes or exits
  non-zero on it scores 0, its traceback in ``error``);
* **infrastructure** (tombstoned with a reason, never trained as the model's failure):
  ``timeout`` (the harness outlived its limit and ``timeout_scoring`` is ``discard``),
  ``sandbox_error`` (sandbox create/run/copy failed or died), ``harness_error`` (the harness
  could not run: unknown task or harness, install or launch failure, missing task environment),
  ``verifier_error`` (the verifier itself failed: timeout, OOM or killed, a module or command
  the task's environment should provide is missing, no readable score) and
  ``engine_error`` (model calls failed for infrastructure reasons — engine unreachable, 5xx —
  and the harness ended without a successful call after them).
"""

SCORED_STATUSES: frozenset[str] = frozenset({"ok"})
"""Statuses whose reward is the model's outcome (trained on)."""
INFRA_STATUSES: frozenset[str] = frozenset(
    {"timeout", "sandbox_error", "harness_error", "verifier_error", "engine_error"}
)
"""Statuses that are infrastructure outcomes: tombstoned, never trained."""


class RolloutResult(Record, kw_only=True):
    """The outcome of one rollout: the verifier's score of the final workspace.

    Producer: actor (after the proxy flushed every CallRecord). Consumer: assembler, metrics.
    Subject: ``hrl.<run>.rollouts.<actor>`` (the publishing actor's NATS user: the server lets
    an actor publish only under its own). Idempotency key: ``rollout:<rollout_id>:<claim
    prefix>`` (another actor, who does not know the claim, cannot take the id first).
    """

    rollout_id: str
    """``<group_id>-<k>-<attempt>``."""
    task_id: str
    """Task identifier."""
    suite: str = ""
    """Task suite."""
    harness: str = ""
    """Harness adapter name."""
    harness_version: str = ""
    """Version of the harness as installed (empty when unknown)."""
    group_id: str
    """Group identity from the TaskRequest."""
    k: int
    """Member index from the TaskRequest."""
    attempt: int = 1
    """Delivery count of the task message (1 = first attempt)."""
    group_size: int = 1
    """Group size from the TaskRequest."""
    issued_version: int = 0
    """Weight version at issue time, from the TaskRequest."""
    is_eval: bool = False
    """Held-out evaluation rollout (never trained on)."""
    status: RolloutStatus = "ok"
    """See `RolloutStatus`: ``ok`` is scored; every other status is an infrastructure outcome
    (tombstoned, never trained)."""
    reason: str = ""
    """Machine-readable cause of a failed status (``engine_unreachable``, ``task_not_found``,
    ``unknown_harness``...), the same label as the actor's failure metric; empty when ok."""
    reward: float = 0.0
    """Scalar reward in [0, 1] (meaningful when status is ``ok``)."""
    metrics: dict[str, float] = {}
    """Per-metric scores from the checker (and rubric), each in [0, 1]."""
    n_calls: int = 0
    """Number of CallRecords the proxy published (and flushed) for this rollout."""
    durations: dict[str, float] = {}
    """Seconds per phase: ``sandbox``, ``harness``, ``verify``, ``total``; and
    ``harness_cpu``, the CPU seconds of the harness and the processes it waited for, where the
    sandbox measured them (independent of the machine's load, unlike the wall times)."""
    error: str = ""
    """Error text for failed statuses; for ``ok``, notes on the scoring (a checker that failed
    and scored 0, with its traceback; a rubric judge that failed)."""
    actor: str = ""
    """Actor instance that ran the rollout."""
    started_at: float = 0.0
    """Unix time the actor started the rollout."""
    ended_at: float = 0.0
    """Unix time the actor finished the rollout."""
    meta: dict[str, str] = {}
    """Annotations from the TaskRequest."""
    claim: str = ""
    """The TaskRequest's ``claim``, returned as proof this actor was handed the member."""

    def msg_id(self) -> str:
        if self.claim:
            return f"rollout:{self.rollout_id}:{self.claim[:12]}"
        return f"rollout:{self.rollout_id}"


class TreeNode(msgspec.Struct, kw_only=True, array_like=False):
    """One node of a rollout's prefix tree: a run of tokens with a single parent."""

    parent: int
    """Index of the parent node in ``TreeSample.nodes``; -1 for a root."""
    token_ids: bytes
    """Packed int32 token ids of this node."""
    logprobs: bytes = b""
    """Packed float32 rollout log-probs per token (0 where loss mask is 0)."""
    loss_mask: bytes = b""
    """uint8 per token: 1 = model-generated (trained), 0 = environment/prompt."""
    weight_version: int = -1
    """Engine weight version that generated this node's model tokens (-1: no model tokens)."""


class TreeCounters(msgspec.Struct, kw_only=True):
    """Accounting for one assembled rollout."""

    n_calls: int = 0
    """CallRecords read for the rollout."""
    n_leaves: int = 0
    """Leaves retained in the tree."""
    dropped: dict[str, int] = {}
    """Calls or leaves dropped, by reason."""
    unique_tokens: int = 0
    """Tokens in the tree, each counted once."""
    expanded_tokens: int = 0
    """Tokens if every root-to-leaf path were a separate sequence."""
    model_tokens: int = 0
    """Tokens with loss mask 1."""
    tito_misses: int = 0
    """Successful calls, after the first, whose input was fully re-rendered instead of
    extending earlier ids (failed calls never count)."""
    false_forks: int = 0
    """Calls that continue an earlier call's conversation but keep only part of its sampled
    output (the rest re-rendered): each leaves a dead-end branch."""
    truncated_calls: int = 0
    """Successful calls whose reply ran into the token limit (``finish_reason == "length"``):
    a reply cut off mid-tool-call, often junk repeated until the limit."""


class TreeSample(Record, kw_only=True):
    """A rollout's calls rebuilt into one filtered prefix tree (a forest: one root per segment).

    Producer: assembler. Consumer: learner (work queue, durable consumer ``learner``).
    Subject: ``hrl.<run>.samples``. Idempotency key: ``sample:<rollout_id>`` (``:<part>`` when
    split). A sample with no nodes and a ``dropped_reason`` is a *tombstone*: the rollout ended
    without a trainable sample, and groups/admission control must not wait for it.
    """

    rollout_id: str
    """``<group_id>-<k>-<attempt>``."""
    group_id: str
    """Group identity."""
    k: int
    """Member index."""
    attempt: int = 1
    """Attempt (delivery count) that produced this sample."""
    group_size: int = 1
    """Group size issued by the feeder."""
    issued_version: int = 0
    """Weight version at issue time."""
    task_id: str = ""
    """Task identifier."""
    suite: str = ""
    """Task suite."""
    harness: str = ""
    """Harness adapter name."""
    is_eval: bool = False
    """Evaluation rollout: reported, never trained on."""
    reward: float = 0.0
    """Rollout reward, shared by every segment of the tree."""
    metrics: dict[str, float] = {}
    """Per-metric scores from the verifier."""
    weight_version: int = -1
    """Oldest weight version among retained model tokens (what staleness is measured from)."""
    nodes: list[TreeNode] = []
    """Tree nodes in topological order (a parent precedes its children)."""
    counters: TreeCounters = msgspec.field(default_factory=TreeCounters)
    """Accounting for this rollout."""
    dropped_reason: str = ""
    """Non-empty for a tombstone: why the rollout yielded no sample."""
    rollout_status: str = "ok"
    """The RolloutResult status this sample came from."""
    part: int = 0
    """Part index when a very large tree is split across messages."""
    n_parts: int = 1
    """Number of parts of this sample."""
    sampling: SamplingParams | None = None
    """How the engines sampled every retained call (the assembler refuses a rollout whose
    retained calls disagree: ``mixed_sampling``); the learner takes its log-probs at this
    temperature. None: not recorded (a tombstone, or a sample made elsewhere)."""

    @property
    def is_tombstone(self) -> bool:
        return bool(self.dropped_reason) and not self.nodes

    def msg_id(self) -> str:
        base = f"sample:{self.rollout_id}"
        return base if self.n_parts == 1 else f"{base}:{self.part}"


class WeightsReady(Record, kw_only=True):
    """Announces a new policy version and where its weights are.

    Producer: learner. Consumer: engine weight updaters (``harnessrl weights-sync`` or built in).
    Subject: ``hrl.<run>.weights.ready``. Idempotency key: ``weights:<version>:ready``.
    With ``transport == "stream"`` the data follows as ``WeightChunk`` records on
    ``hrl.<run>.weights.data.<version>``; an updater applies a version only once every chunk
    arrived and the digest matches.
    """

    version: int
    """New policy version (monotonically increasing)."""
    step: int = 0
    """Learner optimiser step that produced it."""
    transport: Literal["stream", "disk", "distributed"] = "stream"
    """Data plane: chunked stream, shared disk path, or SGLang distributed update."""
    path: str = ""
    """Folder with the HF checkpoint for ``disk`` transport."""
    n_chunks: int = 0
    """Number of WeightChunk records for ``stream`` transport."""
    total_bytes: int = 0
    """Size of the serialized weights."""
    digest: str = ""
    """Digest of the concatenated chunk data: ``xxh3-128:<hex>`` (``sha256:<hex>`` and a bare hex
    digest, blake2b-256, are what earlier learners announced; ``harnessrl.common.weights.weights_hasher``
    reads all three)."""
    dtype: str = "bfloat16"
    """Dtype of the transferred tensors."""
    created_at: float = 0.0
    """Unix time of publication."""

    def msg_id(self) -> str:
        return f"weights:{self.version}:ready"


class WeightChunk(Record, kw_only=True):
    """One chunk (<= ~1 MiB) of a serialized weight version for the ``stream`` transport.

    Producer: learner. Consumer: weight updaters. Subject: ``hrl.<run>.weights.data.<version>``.
    Idempotency key: ``weights:<version>:<index>``. Never zstd-framed (``COMPRESS``): weights
    are incompressible.
    """

    COMPRESS: ClassVar[bool | None] = False
    SCATTER: ClassVar[str] = "data"

    version: int
    """Policy version this chunk belongs to."""
    index: int
    """0-based chunk index."""
    n_chunks: int
    """Total number of chunks of the version."""
    data: memoryview
    """Raw chunk bytes: decoded as a view into the received message (no copy); any buffer
    (``bytes``, a ``memoryview`` slice of the serialised version) when encoding."""

    def msg_id(self) -> str:
        return f"weights:{self.version}:{self.index}"


class DeadLetter(Record, kw_only=True):
    """A message that could not be decoded or processed, kept with the reason instead of retried.

    Producer: any consumer (``harnessrl.common.bus``). Consumer: operators (``harnessrl`` tools, metrics).
    Subject: ``hrl.<run>.dead.<stream kind>``. Idempotency key: ``dead:<stream>:<stream seq>``.
    """

    stream: str
    """Stream the message came from."""
    subject: str
    """Original subject."""
    seq: int
    """Stream sequence of the original message."""
    consumer: str
    """Durable consumer that gave up on it."""
    reason: str
    """Why it was dead-lettered."""
    data: bytes = b""
    """Original payload (truncated to 256 KiB)."""
    at: float = 0.0
    """Unix time of dead-lettering."""


T = TypeVar("T", bound="Record")

RECORD_TYPES: dict[str, type[Record]] = {
    t.__name__: t
    for t in (
        TaskRequest,
        CallRecord,
        RolloutResult,
        TreeSample,
        WeightsReady,
        WeightChunk,
        DeadLetter,
    )
}

# ---------------------------------------------------------------------------------------------
# encode / decode
# ---------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


class _Header(msgspec.Struct):
    record: str = ""
    schema_version: int = 0


_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode(record: Record, *, compress: bool | None = None) -> bytes:
    """Encode a record to msgpack; zstd-frame it when larger than ``COMPRESS_THRESHOLD``.

    ``compress=False`` never frames, ``True`` always does; by default the record type's
    ``COMPRESS`` rule decides.
    """
    raw = _encoder.encode(record)
    if compress is None:
        compress = _compresses(record, raw)
    return _zc.compress(raw) if compress else raw


def _compresses(record: Record, raw: bytes) -> bool:
    rule = record.COMPRESS
    return len(raw) > COMPRESS_THRESHOLD if rule is None else rule


class Scattered(NamedTuple):
    """A record's wire bytes in two parts, never joined on the publishing side: the msgpack
    bytes up to its ``SCATTER`` buffer's contents, then that buffer."""

    head: bytes
    body: memoryview

    @property
    def nbytes(self) -> int:
        """Length of the joined bytes."""
        return len(self.head) + len(self.body)

    def join(self) -> bytes:
        return b"".join(self)


def wire_size(data: bytes | Scattered) -> int:
    """Length of an encoded record's bytes on the wire."""
    return data.nbytes if isinstance(data, Scattered) else len(data)


def _bin_header(n: int) -> bytes:
    """msgpack ``bin`` header for ``n`` bytes."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def encode_scattered(record: Record) -> Scattered:
    """``encode(record)`` as ``Scattered``, for a type with a ``SCATTER`` field: the record is
    encoded with that field empty (a 2-byte ``bin`` at the very end), whose header is then
    replaced by the real length's; the buffer itself is not copied."""
    field = record.SCATTER
    body = memoryview(getattr(record, field)).cast("B")
    head = _encoder.encode(msgspec.structs.replace(record, **{field: b""}))
    if record.COMPRESS is not False or not head.endswith(b"\xc4\x00"):
        raise TypeError(f"{type(record).__name__}.{field} is not an uncompressed last bin field")
    return Scattered(head[:-2] + _bin_header(len(body)), body)


def encode_many(records: list[Record]) -> list[bytes | Scattered]:
    """``encode`` for a batch; safe to call from a worker thread (zstd releases the GIL).
    A record of a ``SCATTER`` type comes back as ``Scattered`` (its buffer not copied)."""
    zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)  # not thread-safe: one per call
    out: list[bytes | Scattered] = []
    for rec in records:
        if isinstance(rec, bytes | bytearray | memoryview):
            out.append(bytes(rec))  # pre-encoded: passed through as is
            continue
        if rec.SCATTER:
            out.append(encode_scattered(rec))
            continue
        raw = _encoder.encode(rec)
        out.append(zc.compress(raw) if _compresses(rec, raw) else raw)
    return out


def unframe(data: bytes) -> bytes:
    """Return the msgpack bytes of a payload (decompressing a zstd frame)."""
    if data[:4] == ZSTD_MAGIC:
        try:
            return _zd.decompress(data, max_output_size=1 << 31)
        except zstandard.ZstdError as e:
            raise RecordDecodeError(f"corrupt zstd frame: {e}") from None
    return data


def decode(data: bytes, type_: type[T]) -> T:
    """Decode a payload as ``type_``; raise ``RecordDecodeError`` for anything else."""
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) == 0:
        raise RecordDecodeError("empty payload")
    raw = unframe(bytes(data))
    try:
        head = _header_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise RecordDecodeError(f"not a msgpack record: {e}") from None
    if head.record != type_.__name__:
        raise RecordDecodeError(f"expected a {type_.__name__} record, got {head.record!r}")
    if head.schema_version > SCHEMA_VERSION:
        raise RecordDecodeError(
            f"{head.record} schema_version {head.schema_version} is newer than supported "
            f"{SCHEMA_VERSION}; upgrade harnessrl"
        )
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    try:
        return dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise RecordDecodeError(f"invalid {type_.__name__}: {e}") from None


def now() -> float:
    return time.time()
