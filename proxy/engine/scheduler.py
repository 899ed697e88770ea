"""The scheduler of the embedded engine: ``Request`` and ``Engine`` (model, KV, one thread).

Scheduler (one thread; the HTTP loop never runs the model)
----------------------------------------------------------
Each step admits waiting requests into free slots (prefix-cache lookup first), then runs ONE
packed forward holding a decode token of every running request plus prefill chunks of newly
admitted ones (at most ``prefill_chunk`` prompt tokens per step), samples every request whose
fed tokens reached its end, and finishes the ones that stopped. KV lives in a slot pool
(``harnessrl.proxy.engine.cache``); attention is plugged into ``transformers`` through its attention
interface (``harnessrl.proxy.engine.attention``), and a start-up self-check compares the packed path with
the model's own forward and refuses a model where they differ. Llama/Qwen-shaped models run the
step through the lean forward (``harnessrl.proxy.engine.lean``: the same ops without the module tree),
checked the same way at load; a model it does not cover, or one where it differs, keeps the
``transformers`` forward.

Weight versions
---------------
A weight update is applied by the scheduler thread *between* two forward passes: nothing is
dropped. Requests running across the swap finish under the new weights (their earlier tokens keep
the KV computed by the old ones) and their reply's ``weight_versions`` (SGLang's spans of
versions over output tokens, ``harnessrl.proxy.engine.requests.weight_version_spans``) starts with the old version. Every update
empties the prefix cache, whatever ``flush_cache`` says: reusing KV of old weights would silently
make new log-probs wrong. A disk update without ``weight_version`` increments a numeric version;
a distributed bucket without one keeps the version (send it with the last bucket). A
multi-bucket distributed update applies bucket by bucket, as in SGLang; pause generation
(``in_place``) around it to keep every step on one set of weights.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from harnessrl.common import metrics as m
from harnessrl.common.models import (
    load_model,
    load_tokenizer,
    model_info,
    resolve_model,
)
from harnessrl.common.models.head import lm_logits
from harnessrl.proxy.config import EngineConfig
from harnessrl.proxy.engine.attention import _ATTN_NAME, _PackedBatch, _register_attention, _Segment
from harnessrl.proxy.engine.cache import KVPool, PrefixCache, _lcp
from harnessrl.proxy.engine.lean import LeanForward
from harnessrl.proxy.engine.requests import (
    BadRequest,
    EngineStopped,
    GenerateItem,
    Overloaded,
    SamplingParams,
)
from harnessrl.proxy.engine.sampling import sample

log = logging.getLogger("harnessrl.engine")

_DEFER_MIN_SHARED = 64  # tokens a waiting prompt must share with a running prefill to wait for it
_LEAN_TOL = 1e-4  # fp32 logits: the lean forward runs HF's own ops, so only kernel noise remains


def _low_precision_tol(ref: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> float:
    """Load-time tolerance of a bf16/fp16 forward against the model's own: 8 units in the
    last place (of ``dtype``: 8 significant bits in bf16) of the largest reference logit, at
    least 0.5. Two
    forwards that order their ops differently differ by a few of those (measured: 0.58 at a
    largest logit of 28.3, 4.6 ulps, SmolLM2-135M in bf16 on an AVX2-only CPU, where a fixed
    0.5 refused it), while a wrong mask or position is off by the logits' own scale (17.9)."""
    largest = float(ref.abs().max())
    if not math.isfinite(largest) or largest <= 0.0:
        return 0.5
    return max(0.5, 8 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(largest)))


# ---------------------------------------------------------------------------------------------
# Metrics (process-wide; several engines in one process share them)
# ---------------------------------------------------------------------------------------------

M_REQUESTS = m.counter("hrl_engine_requests_total", "Finished /generate requests.", ("finish",))
M_PROMPT = m.counter("hrl_engine_prompt_tokens_total", "Prompt tokens of finished requests.")
M_GENERATED = m.counter("hrl_engine_generated_tokens_total", "Tokens sampled.")
M_PREFILLED = m.counter("hrl_engine_prefill_tokens_total", "Prompt tokens computed.")
M_CACHED = m.counter("hrl_engine_cached_tokens_total", "Prompt tokens reused from cache.")
M_CACHE_LOOKUPS = m.counter(
    "hrl_engine_prefix_cache_lookups_total", "Prefix cache lookups.", ("result",)
)
M_BATCH = m.gauge("hrl_engine_batch_size", "Requests decoded in the last step.")
M_RUNNING = m.gauge("hrl_engine_running_requests", "Requests holding a slot.")
M_QUEUE = m.gauge("hrl_engine_queue_depth", "Requests waiting for a slot.")
M_TPS = m.gauge("hrl_engine_tokens_per_second", "Tokens sampled per second (last 10 s).")
M_STEP = m.histogram("hrl_engine_step_seconds", "Duration of one scheduler step.")
M_VERSION = m.gauge("hrl_engine_weight_version", "Numeric weight version (-1 if not).")
M_UPDATES = m.counter("hrl_engine_weight_updates_total", "Weight updates.", ("source",))


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    """One generation, owned by the scheduler thread once submitted."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_text: bool = False
    tokens: list[int] = field(default_factory=list)
    """Input + output so far; KV exists for ``tokens[:computed]`` in ``slot``."""
    computed: int = 0
    slot: int | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    version_start: str | None = None
    version_end: str | None = None
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """``(old version, output tokens so far)`` at each weight update while admitted: the
    ``weight_versions`` spans of the reply (``requests.weight_version_spans``)."""
    finish: dict[str, Any] | None = None
    created: float = field(default_factory=time.perf_counter)
    finished_at: float = 0.0
    generator: torch.Generator | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.input_ids)


# ---------------------------------------------------------------------------------------------
# The engine (scheduler thread)
# ---------------------------------------------------------------------------------------------


class Engine:
    """Model, KV pool, prefix cache and the scheduler thread; no HTTP.

    Thread-safe entry points (``submit``, ``abort``, ``pause``, ``resume``, ``apply_weights``,
    ``flush_cache``) return ``concurrent.futures.Future``s resolved by the scheduler thread, which
    alone touches the model and the KV state, between two forward passes.
    """

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.model: Any = None
        self.tokenizer: Any = None
        self.version = cfg.weight_version
        self.paused = False
        self.waiting: list[Request] = []
        self.active: list[Request] = []
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._commands: list[tuple[Any, tuple[Any, ...], concurrent.futures.Future]] = []
        self._live: dict[str, Request] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._counter = 0
        self._tps: collections.deque[tuple[float, int]] = collections.deque()
        self.steps = 0
        self.step_cpu_s = 0.0
        """CPU seconds of the scheduler thread in steps (other torch threads not included): on
        a shared machine, a cost that waiting for a core does not inflate."""
        self.peak_batch = 0
        self.lean: LeanForward | None = None
        """The lean forward when it runs the model's steps (see ``_switch_attention``)."""

    # -- loading ---------------------------------------------------------------------------

    def load(self) -> None:
        """Load model and tokenizer, set up the pool and cache, and self-check (blocking)."""
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        with contextlib.suppress(Exception):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {cfg.device} asked for, but torch sees no CUDA device")
        self.folder = resolve_model(cfg.model)
        self.info = model_info(self.folder)
        self.model = load_model(self.folder, dtype=cfg.dtype, device=self.device)
        self.model.requires_grad_(False)
        try:
            self.tokenizer = load_tokenizer(cfg.tokenizer or self.folder)
        except Exception as e:  # the engine serves ids without a tokenizer
            log.warning("no tokenizer for %s (%s); replies carry empty text", self.folder, e)
            self.tokenizer = None
        tc = self.model.config.get_text_config()
        self.vocab_size = int(tc.vocab_size)
        # what SGLang stops on: generation_config's and config's eos ids, and the tokenizer's
        own = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_ids = tuple(
            dict.fromkeys([*self.info["eos_token_ids"], *([] if own is None else [int(own)])])
        )
        model_max = int(getattr(tc, "max_position_embeddings", 0) or 0) or 1 << 20
        self.max_context = min(cfg.max_context or model_max, model_max)
        layer_types = list(getattr(tc, "layer_types", None) or [])
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"unsupported attention layer types {sorted(set(layer_types))}")
        self._mask_keys = sorted(set(layer_types) | {"full_attention"})
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._unique = {id(p): n for n, p in self.model.named_parameters()}
        heads = int(tc.num_key_value_heads or tc.num_attention_heads)
        dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        self._kv_shape = (int(tc.num_hidden_layers), heads, dim)
        self._switch_attention()
        self.pool = self._new_pool(cfg.max_batch_size)
        self.cache = PrefixCache(cfg.prefix_cache_mb << 20)
        M_VERSION.set(_numeric(self.version))
        _give_back_memory()

    def _new_pool(self, slots: int) -> KVPool:
        layers, heads, dim = self._kv_shape
        return KVPool(
            layers, heads, dim, slots, self.model.dtype, self.max_context, device=self.device
        )

    def _switch_attention(self) -> None:
        """Plug the packed attention in, then the lean forward where the model allows, and
        check each against the model's own forward on the three paths a step takes: a first
        chunk, a chunk after cached KV, a decode row. The lean forward runs the steps when it
        passes; otherwise the packed ``transformers`` path must pass (else the model is
        refused). Llama-style models in ``transformers`` 5 build their own causal mask from
        the one the engine passes, so only the lean forward can serve them."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(9)]
        with torch.no_grad():
            ref = self.model(input_ids=self._tensor([ids])).logits[0, [4, 7, 8]].float()
        _register_attention()
        self.model.set_attn_implementation(_ATTN_NAME)
        if self.model.config._attn_implementation != _ATTN_NAME:
            raise ValueError(f"{type(self.model).__name__} cannot use a custom attention")
        tol = (
            _LEAN_TOL
            if self.model.dtype == torch.float32
            else _low_precision_tol(ref, self.model.dtype)
        )
        self.lean = None
        err = self._check_steps(ids, ref)
        if self.cfg.lean_forward:
            self.lean = LeanForward.build(self.model)
        if self.lean is not None:
            lean_err = self._check_steps(ids, ref)
            if lean_err <= tol:
                log.info(
                    "lean forward on (%s, off by %.2g from its forward; transformers path: %.2g)",
                    type(self.model).__name__,
                    lean_err,
                    err,
                )
                return
            log.warning(
                "lean forward differs from the model's forward by %.3g; using the transformers "
                "forward",
                lean_err,
            )
            self.lean = None
        if not err <= (1e-3 if self.model.dtype == torch.float32 else tol):
            raise ValueError(f"packed attention differs from the model's forward by {err:.3g}")

    def _check_steps(self, ids: list[int], ref: torch.Tensor) -> float:
        """Largest |logit difference| from ``ref`` of the current forward path over a first
        chunk ``ids[:5]``, a chunk ``ids[5:8]`` after cached KV and a decode row ``ids[8]``."""
        self.pool = self._new_pool(1)
        with torch.no_grad():
            got = [
                self._run_packed(ids[0:5], [], [], [_Segment(0, 5, 0, 0)], [4]),
                self._run_packed(ids[5:8], [], [], [_Segment(0, 3, 0, 5)], [2]),
                self._run_packed(ids[8:9], [0], [8], [], [0]),
            ]
        return float((torch.cat(got).float() - ref).abs().max())

    def _run_packed(
        self,
        ids: list[int],
        dec_slots: list[int],
        dec_pos: list[int],
        segs: list[_Segment],
        keep: list[int],
    ) -> torch.Tensor:
        """One packed forward (decode rows first, then segments); logits of rows ``keep``."""
        pos = list(dec_pos) + [s.past + j for s in segs for j in range(s.n)]
        batch = _PackedBatch(self.pool, dec_slots, dec_pos, segs)
        if self.lean is not None:
            return self.lean(
                self._tensor(ids), self._tensor(pos), batch, self._tensor(keep), max(pos) + 1
            )
        out = self.model.base_model(
            input_ids=self._tensor([ids]),
            position_ids=self._tensor([pos]),
            attention_mask=dict.fromkeys(self._mask_keys, batch),
            use_cache=False,
        )
        head = self.model.get_output_embeddings()
        hidden = out.last_hidden_state[0, self._tensor(keep)]
        return lm_logits(hidden, head.weight, head.bias)  # fp32, as the learner's

    def _tensor(self, data: Any) -> torch.Tensor:
        """Token ids or positions as a tensor on the model's device."""
        return torch.tensor(data, device=self.device)

    # -- thread-safe API -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cv:
            for _, _, fut in self._commands:
                if not fut.done():
                    fut.set_exception(EngineStopped("engine stopped"))
            self._commands.clear()

    def new_request(self, item: GenerateItem) -> Request:
        return Request(
            item.rid, item.input_ids, item.params, item.return_logprob, item.logprob_text
        )

    def submit(self, req: Request) -> concurrent.futures.Future:
        """Queue a request; its future resolves to the finished ``Request``."""
        with self._cv:
            if self._stopping or not self.alive:
                raise EngineStopped("engine is not running")
            if req.rid in self._live:
                raise BadRequest(f"rid {req.rid!r} is already running")
            if len(self._live) - len(self.active) >= self.cfg.max_queue:
                raise Overloaded(f"{self.cfg.max_queue} requests are already waiting")
            self._live[req.rid] = req
            self._incoming.append(req)
            self._cv.notify()
        return req.future

    def _call(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping or not self.alive:
                fut.set_exception(EngineStopped("engine is not running"))
                return fut
            self._commands.append((fn, args, fut))
            self._cv.notify()
        return fut

    def abort(self, rid: str | None = None, abort_all: bool = False) -> concurrent.futures.Future:
        """Finish a queued or running request (or all) with ``finish_reason`` abort."""
        return self._call(self._do_abort, rid, abort_all, "aborted by request")

    def pause(self, mode: str) -> concurrent.futures.Future:
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        return self._call(self._do_pause, mode)

    def resume(self) -> concurrent.futures.Future:
        return self._call(self._do_resume)

    def flush_cache(self) -> concurrent.futures.Future:
        return self._call(self.cache.clear)

    def apply_weights(
        self,
        named: list[tuple[str, torch.Tensor]],
        version: str | None,
        abort_all: bool = False,
        source: str = "disk",
    ) -> concurrent.futures.Future:
        """Swap weights in between two steps; resolves to the new version."""
        return self._call(self._do_swap, named, version, abort_all, source)

    # -- weights (called from any thread; read-only on the model) --------------------------

    def check_weights(self, named: Sequence[tuple[str, torch.Tensor]], full: bool) -> None:
        """Raise ``ValueError`` unless every tensor names a parameter of the right shape (and,
        with ``full``, every parameter is present)."""
        seen = set()
        for name, t in named:
            p = self._params.get(name)
            if p is None:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            if not t.is_floating_point():
                raise ValueError(f"{name}: dtype {t.dtype} is not floating point")
            seen.add(id(p))
        if full:
            missing = [n for i, n in self._unique.items() if i not in seen]
            if missing:
                raise ValueError(f"{len(missing)} parameters missing, e.g. {missing[0]!r}")

    def read_weights(self, model_path: str) -> list[tuple[str, torch.Tensor]]:
        """Read and check a model folder's safetensors (blocking; raises ``ValueError``)."""
        from safetensors.torch import load_file

        folder = resolve_model(model_path)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(
                {folder / f for f in json.loads(index.read_text())["weight_map"].values()}
            )
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors in {folder}")
        named: list[tuple[str, torch.Tensor]] = []
        for f in files:
            try:
                named.extend(load_file(str(f)).items())
            except Exception as e:  # a corrupt file is a bad request
                raise ValueError(f"cannot read {f}: {e}") from None
        self.check_weights(named, full=True)
        return named

    # -- scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        # inference_mode, not no_grad: no version counters or autograd metadata on the step's
        # tensors (cheaper dispatch). Every tensor it creates stays in this thread.
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (
                        self._commands
                        or self._incoming
                        or self._stopping
                        or (not self.paused and (self.waiting or self.active))
                    ):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    self.waiting.extend(self._incoming)
                    self._incoming = []
                    stopping = self._stopping
                for fn, args, fut in commands:
                    try:
                        fut.set_result(fn(*args))
                    except Exception as e:  # reported to the caller
                        fut.set_exception(e)
                if stopping:
                    self._do_abort(None, True, "engine stopped")
                    return
                if not self.paused and (self.waiting or self.active):
                    try:
                        self._step()
                    except Exception as e:  # a bad step must not kill the engine
                        log.exception("scheduler step failed; aborting the running requests")
                        self._fail_active(f"engine error: {type(e).__name__}: {e}")
                M_QUEUE.set(len(self.waiting))
                M_RUNNING.set(len(self.active))

    def _step(self) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self._admit()
        plan = self._plan()
        if not plan:
            return
        sampled = self._forward(plan)
        n_tokens = self._advance(sampled)
        self._compact()
        self.steps += 1
        self.step_cpu_s += time.thread_time() - cpu0
        now = time.perf_counter()
        M_STEP.observe(now - t0)
        self._tps.append((now, n_tokens))
        while self._tps[0][0] < now - 10:
            self._tps.popleft()
        window = max(now - self._tps[0][0], now - t0, 1e-3)
        M_TPS.set(sum(n for _, n in self._tps) / window)

    def _admit(self) -> None:
        i = 0
        while self.pool.free and i < len(self.waiting):
            req = self.waiting[i]
            if req.params.max_new_tokens - len(req.output) <= 0:
                del self.waiting[i]
                self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
                continue
            toks = np.asarray(req.tokens, dtype=np.int64)
            entry, hit = (None, 0)
            if self.cache.capacity > 0:
                entry, hit = self.cache.lookup(toks, len(toks) - 1)
                if self._should_wait(toks, hit):
                    i += 1
                    continue
                M_CACHE_LOOKUPS.labels("hit" if hit else "miss").inc()
            del self.waiting[i]
            req.slot = self.pool.alloc()
            self.pool.fit(self._rows(req.slot), max(hit, self._keep()))
            if hit:
                self.pool.write(req.slot, entry.kv, hit)
            req.computed = hit
            if req.version_start is None:
                req.version_start = self.version
                req.cached_tokens = hit
                M_CACHED.inc(hit)
            if req.generator is None and req.params.temperature > 0:
                self._counter += 1
                seed = req.params.sampling_seed
                if seed is None:
                    seed = hash((self.cfg.seed, self._counter)) & (2**63 - 1)
                req.generator = torch.Generator().manual_seed(seed)
            self.active.append(req)

    def _should_wait(self, toks: np.ndarray, hit: int) -> bool:
        """Whether a prompt should wait for a running prefill that will put more of it in the
        cache than it finds there now."""
        for r in self.active:
            if len(r.tokens) - r.computed > 1:
                shared = _lcp(np.asarray(r.tokens, dtype=np.int64), toks)
                if min(shared, len(toks) - 1) > hit + _DEFER_MIN_SHARED:
                    return True
        return False

    def _keep(self) -> int:
        """Positions of the pool in use."""
        return max((r.computed for r in self.active), default=0)

    def _rows(self, extra: int = 0) -> int:
        """Pool rows in use: one past the highest slot of an active request (or ``extra``)."""
        return max([r.slot for r in self.active] + [extra]) + 1

    def _plan(self) -> list[tuple[Request, int]]:
        """Decode rows (by slot) then prefill chunks (by admission) for this step."""
        decode, prefill = [], []
        budget = self.cfg.prefill_chunk
        for req in self.active:
            left = len(req.tokens) - req.computed
            if left == 1:
                decode.append((req, 1))
            elif budget > 0:
                n = min(left, budget)
                budget -= n
                (decode if n == 1 else prefill).append((req, n))
        decode.sort(key=lambda rn: rn[0].slot)
        return decode + prefill

    def _forward(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, torch.Tensor]]:
        """Run one packed forward; return (request, logits row) for requests that sample."""
        ids: list[int] = []
        dec_slots: list[int] = []
        dec_pos: list[int] = []
        segs: list[_Segment] = []
        keep: list[int] = []
        samplers: list[Request] = []
        for req, n in plan:
            c = req.computed
            if n == 1:
                dec_slots.append(req.slot)
                dec_pos.append(c)
            else:
                segs.append(_Segment(len(ids), n, req.slot, c))
            ids.extend(req.tokens[c : c + n])
            if c + n == len(req.tokens):
                keep.append(len(ids) - 1)
                samplers.append(req)
        self.pool.fit(self._rows(), max(max(r.computed + n for r, n in plan), self._keep()))
        logits = self._run_packed(ids, dec_slots, dec_pos, segs, keep or [len(ids) - 1])
        M_BATCH.set(len(dec_slots))
        self.peak_batch = max(self.peak_batch, len(dec_slots))
        M_PREFILLED.inc(sum(s.n for s in segs))
        for req, n in plan:
            req.computed += n
        return [(req, logits[i]) for i, req in enumerate(samplers)]

    def _advance(self, sampled: list[tuple[Request, torch.Tensor]]) -> int:
        if not sampled:
            return 0
        reqs = [r for r, _ in sampled]
        uniforms = [  # from each request's own CPU generator, wherever the model runs
            float(torch.rand((), generator=r.generator, dtype=torch.float64, device="cpu"))
            if r.generator
            else 0
            for r in reqs
        ]
        logits = torch.stack([lg for _, lg in sampled]).float().cpu()  # sampling is on the CPU
        tokens, logps = sample(logits, [r.params for r in reqs], uniforms)
        M_GENERATED.inc(len(tokens))
        for req, tok, lp in zip(reqs, tokens, logps, strict=True):
            if not req.output and req.computed > 1:  # prefill landed: share it
                self._cache_slot(req)
            req.tokens.append(tok)
            req.output.append(tok)
            req.logprobs.append(lp)
            p = req.params
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                self._finish(req, {"type": "stop", "matched": tok})
            elif len(req.output) >= p.max_new_tokens:
                self._finish(req, {"type": "length", "length": p.max_new_tokens})
        return len(tokens)

    def _cache_slot(self, req: Request) -> None:
        if self.cache.capacity > 0 and req.slot is not None and req.computed > 1:
            n, slot = req.computed, req.slot
            self.cache.insert(
                np.asarray(req.tokens[:n], dtype=np.int64), lambda: self.pool.read(slot, n)
            )

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self._cache_slot(req)
            self.pool.release(req.slot)
            req.slot = None
            req.computed = 0
        if req in self.active:
            self.active.remove(req)

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish = reason
        req.version_end = self.version
        if req.version_start is None:
            req.version_start = self.version
        req.finished_at = time.perf_counter()
        with self._cv:
            self._live.pop(req.rid, None)
        M_REQUESTS.labels(reason["type"]).inc()
        M_PROMPT.inc(len(req.input_ids))
        if not req.future.done():
            req.future.set_result(req)

    def _fail_active(self, message: str) -> None:
        """Abort every running request without trusting (or caching) its KV."""
        for req in list(self.active):
            if req.slot is not None:
                self.pool.release(req.slot)
                req.slot = None
            self._finish(req, {"type": "abort", "message": message})
        self.pool = self._new_pool(self.cfg.max_batch_size)

    def _compact(self) -> None:
        """Move the highest slots into holes so running requests hold slots 0..n-1."""
        used = sorted((r.slot, r) for r in self.active)
        holes = sorted(self.pool.free)
        while used and holes and holes[0] < used[-1][0]:
            src, req = used.pop()
            dst = holes.pop(0)
            self.pool.move(src, dst, req.computed)
            self.pool.free.remove(dst)
            self.pool.free.append(src)
            req.slot = dst
            holes = sorted(self.pool.free)
        self.pool.fit(self._rows(), self._keep() + 1, shrink=True)

    # -- commands (scheduler thread) -------------------------------------------------------

    def _do_abort(self, rid: str | None, abort_all: bool, message: str) -> int:
        hits = [
            r for r in self.waiting + self.active if abort_all or (rid is not None and r.rid == rid)
        ]
        for req in hits:
            self._finish(req, {"type": "abort", "message": message})
        self._compact()
        return len(hits)

    def _do_pause(self, mode: str) -> int:
        n = 0
        if mode == "abort":
            n = self._do_abort(None, True, "generation paused (abort)")
        elif mode == "retract":
            running = list(self.active)
            for req in running:
                self._release(req)
            self.waiting[:0] = running
            n = len(running)
            self._compact()
        self.paused = True
        return n

    def _do_resume(self) -> None:
        self.paused = False

    def _do_swap(
        self, named: list[tuple[str, torch.Tensor]], version: str | None, abort_all: bool, src: str
    ) -> str:
        if abort_all:
            self._do_abort(None, True, "aborted for a weight update")
        for req in self.active + self.waiting:
            if req.version_start is not None:  # admitted: some of its KV is the old weights'
                req.version_events.append((self.version, len(req.output)))
        for name, t in named:
            self._params[name].copy_(t)
        if self.lean is not None:
            try:
                self.lean.refresh()
            except RuntimeError:  # the HF parameters hold the new weights: fuse them again
                log.warning("lean forward lost its weights' storage; rebuilding it")
                self.lean = LeanForward(self.model)
        self.cache.clear()
        if version is None and src == "disk" and self.version.isdigit():
            version = str(int(self.version) + 1)
        version = version or self.version
        self.version = version
        M_VERSION.set(_numeric(version))
        M_UPDATES.labels(src).inc()
        log.info("weights updated from %s: version %s", src, version)
        return version


def _numeric(version: str) -> float:
    try:
        return float(version)
    except ValueError:
        return -1.0


def _give_back_memory() -> None:
    """Return the heap that loading freed to the OS (glibc keeps freed blocks of the sizes a
    load allocates, the weights read from the file and cast or copied, in the process: SmolLM2
    135M in bfloat16, 0.97 -> 0.76 GB RSS at start). A no-op without glibc."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
