"""What ``harnessrl run`` shows and records about a live run: collection and views.

`Monitor` gathers a `RunStatus` from what the processes already publish — nothing here talks
to a process in any other way:

* every process's Prometheus ``/metrics`` (actors, assembler, learner, updaters, engines);
  counters are accumulated across restarts of a process (a counter that goes down means the
  process restarted: its previous total is carried over);
* each engine's weight version (``GET /model_info``, as SGLang answers it);
* the bus: stream depths (``TASKS``, ``SAMPLES``), the assembler's pending results, the total
  of TaskRequests ever stored (``TASKS`` last sequence = rollouts issued), and every
  RolloutResult (an ordered consumer over ``ROLLOUTS`` from the start, so a resumed
  supervisor rebuilds the reward history: mean reward per issued version, harness, train/eval);
* the learner's own ``metrics.jsonl`` (step lines: version, batch reward, eval means), whose
  lines it copies verbatim into the run's ``metrics.jsonl`` beside its own ``rollup`` lines;
* at the end, `Monitor.audit`: where every issued rollout is, from the streams alone
  (``harnessrl.common.run.audit``), for the summary's exact ``unaccounted``.

A read that fails is *unknown*, never zero: a queue whose query failed is ``None`` (shown as
``?``, left out of rollup lines), the failure is kept in `RunStatus.unread`, and `Monitor.drained`
counts an unknown queue, or an actor whose ``/metrics`` could not be read, as busy, so a
monitoring error cannot end the drain after the last step early.

Views: `LiveDashboard` (rich, for terminals) and `PlainStatus` (one line every few seconds,
for logs and non-TTY output).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.common.bus import TASK_STALL_ALERT_S
from harnessrl.common.layout import (
    RUN_SOURCE,
    MetricsLine,
    RollupLine,
    RunLine,
    StartLine,
    StepLine,
    decode_line,
    encode_line,
)

log = logging.getLogger("harnessrl.run")

SCRAPE_TIMEOUT_S = 3.0
RATE_WINDOW_S = 60.0
"""Rates (rollouts/s, tokens/s) are averaged over this window."""
SCORED_STATUSES = ("ok", "timeout")
"""Statuses whose reward says something about the policy (a timeout counts as 0); sandbox,
harness and verifier errors are infrastructure failures and are left out of reward means."""


# ---------------------------------------------------------------------------------------------
# Prometheus text -> samples, counters carried across restarts
# ---------------------------------------------------------------------------------------------

Key = tuple[str, tuple[tuple[str, str], ...]]


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


def parse_prometheus(text: str) -> dict[Key, float]:
    """``{(sample name, sorted labels): value}`` of a Prometheus text exposition (format
    0.0.4, what ``prometheus_client`` serves).

    The supervisor reads every process's ``/metrics`` every ``scrape_interval_s``; the
    ``prometheus_client`` parser took 30 ms of CPU for one actor's 22 kB (4 % of a core for
    a demo's processes at a 2 s interval), this one a tenth of it. A line it cannot read
    falls back to that parser for the whole text, so both give the same result."""
    out: dict[Key, float] = {}
    try:
        for line in text.splitlines():
            if not line or line[0] == "#":
                continue
            brace = line.find("{")
            if brace < 0:
                name, _, rest = line.partition(" ")
                labels: tuple[tuple[str, str], ...] = ()
            else:
                end = line.rindex("}")
                name, rest = line[:brace], line[end + 1 :]
                body = line[brace + 1 : end]
                pairs = _LABEL.findall(body)
                if len(pairs) != body.count("=") - sum(v.count("=") for _, v in pairs):
                    raise ValueError(f"labels: {body!r}")
                labels = tuple(
                    sorted(
                        (k, _ESCAPE.sub(lambda m: _ESCAPES.get(m[1], m[0]), v) if "\\" in v else v)
                        for k, v in pairs
                    )
                )
            if not name or " " in name:
                raise ValueError(f"name: {line!r}")
            out[(name, labels)] = float(rest.split()[0])
    except (ValueError, IndexError):
        return _parse_prometheus_slow(text)
    return out


def _parse_prometheus_slow(text: str) -> dict[Key, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Key, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _cumulative(name: str) -> bool:
    return name.endswith(("_total", "_count", "_sum", "_bucket"))


class Scraped:
    """The latest samples of one target; cumulative samples never go down (restarts)."""

    def __init__(self) -> None:
        self.values: dict[Key, float] = {}
        self._last: dict[Key, float] = {}
        self._base: dict[Key, float] = defaultdict(float)
        self.ok = False
        self.at = 0.0

    def update(self, samples: dict[Key, float]) -> None:
        for key, v in samples.items():
            if _cumulative(key[0]):
                last = self._last.get(key, 0.0)
                if v < last:  # the process restarted: keep what it had counted
                    self._base[key] += last
                self._last[key] = v
                self.values[key] = self._base[key] + v
            else:
                self.values[key] = v
        self.ok, self.at = True, time.monotonic()


def total(targets: list[Scraped], name: str, **labels: str) -> float:
    """Sum of ``name`` over targets and over label sets matching ``labels``."""
    want = set(labels.items())
    return sum(
        v for t in targets for (n, lab), v in t.values.items() if n == name and want <= set(lab)
    )


def by_label(targets: list[Scraped], name: str, label: str) -> dict[str, float]:
    out: Counter[str] = Counter()
    for t in targets:
        for (n, lab), v in t.values.items():
            if n == name:
                out[dict(lab).get(label, "")] += v
    return {k: v for k, v in out.items() if v}


# ---------------------------------------------------------------------------------------------
# the snapshot
# ---------------------------------------------------------------------------------------------


@dataclass
class ChildView:
    name: str
    role: str
    pid: int | None
    state: str
    restarts: int


@dataclass
class RunStatus:
    """One snapshot of a run, for the views and the rollup lines."""

    name: str = ""
    run_dir: str = ""
    steps: int = 0
    elapsed_s: float = 0.0
    version: int = 0
    engine_versions: dict[str, str] = field(default_factory=dict)
    synced_versions: dict[str, float] = field(default_factory=dict)
    rollouts_per_s: float = 0.0
    gen_tokens_per_s: float = 0.0
    train_tokens_per_s: float = 0.0
    samples_trained: int = 0
    samples_per_min: float = 0.0
    learner_idle: float = 0.0
    staleness_mean: float = 0.0
    issued: int = 0
    in_flight: int = 0
    results: dict[str, int] = field(default_factory=dict)
    """RolloutResults by status."""
    outcomes: dict[str, float] = field(default_factory=dict)
    """Assembler outcomes: ``sample`` or a tombstone's reason."""
    failures: dict[str, float] = field(default_factory=dict)
    """Actor failures by reason."""
    dropped: dict[str, float] = field(default_factory=dict)
    """Learner drops by reason (stale, low reward, small group...)."""
    task_stall_s: float = 0.0
    """Seconds the task consumer has delivered nothing while tasks waited and actors asked
    (the learner's ``hrl_task_queue_stalled_seconds``; 0: it delivers)."""
    tasks_waiting: int = 0
    """Tasks stored and not with any actor (the learner's ``hrl_task_queue_waiting``)."""
    queues: dict[str, int | None] = field(default_factory=dict)
    """Messages waiting: ``tasks`` (TASKS stream), ``samples`` (SAMPLES stream), ``results``
    (the assembler's pending RolloutResults); None: the last query failed (unknown)."""
    unread: dict[str, str] = field(default_factory=dict)
    """What the last refresh could not read (a queue, a process's ``/metrics``) -> the error."""
    reward_train: dict[int, float] = field(default_factory=dict)
    """Learner batch reward by version (step lines)."""
    rewards: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)
    """``{"train/<harness>"|"eval/<harness>": {issued_version: (mean, n)}}`` from results."""
    children: list[ChildView] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    @property
    def tombstones(self) -> dict[str, float]:
        return {k: v for k, v in self.outcomes.items() if k != "sample"}

    def latest_reward(self, kind: str) -> float | None:
        """Mean reward of the newest version with results of ``kind`` (train|eval)."""
        best: tuple[int, float, int] | None = None
        for key, per in self.rewards.items():
            if not key.startswith(kind + "/") or not per:
                continue
            v = max(per)
            mean, n = per[v]
            if best is None or v > best[0]:
                best = (v, mean * n, n)
            elif v == best[0]:
                best = (v, best[1] + mean * n, best[2] + n)
        return best[1] / best[2] if best and best[2] else None


# ---------------------------------------------------------------------------------------------
# the monitor
# ---------------------------------------------------------------------------------------------


@dataclass
class Target:
    """A ``/metrics`` endpoint of one process."""

    name: str
    role: str
    url: str
    scraped: Scraped = field(default_factory=Scraped)


class Monitor:
    """Collects `RunStatus` (see the module docstring); ``tick`` refreshes it."""

    def __init__(
        self,
        run_name: str,
        run_dir: Path,
        *,
        steps: int,
        learner_metrics: Path | None = None,
        engines: dict[str, str] | None = None,
        engine_api_key_file: str = "",
    ) -> None:
        self.run_name = run_name
        self.run_dir = Path(run_dir)
        self.steps = steps
        self.learner_metrics = learner_metrics
        self.engines = dict(engines or {})
        self.engine_api_key_file = engine_api_key_file
        self.targets: dict[str, Target] = {}
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.t0 = time.monotonic()
        self.bus: Any = None
        self._sub: Any = None
        self._session: Any = None
        self.engine_versions: dict[str, str] = {}
        self.queues: dict[str, int | None] = {}
        self.issued = 0
        self.unread: dict[str, str] = {}
        """What the last refresh could not read -> why (see `RunStatus.unread`)."""
        self.result_counts: Counter[str] = Counter()
        self.members: set[tuple[str, int]] = set()
        self.results_read = 0
        """Stream sequence of the last RolloutResult read (decodable or not)."""
        self.accounting: Any = None
        """The last `audit` (``harnessrl.common.run.audit.Accounting``); None before one succeeded."""
        self._rewards: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0.0, 0, 0])
        self._reward_delta: dict[tuple[str, str, int], list[float]] = defaultdict(
            lambda: [0.0, 0.0]
        )
        self._result_times: deque[float] = deque()
        self._rate_hist: deque[tuple[float, float, float]] = deque()
        self.steps_seen: list[StepLine] = []
        self.reward_train: dict[int, float] = {}
        self.learner_version = 0
        self._copied_lines = 0
        self._learner_offset = 0
        self._learner_partial = b""

    # -- setup ------------------------------------------------------------------------------

    def add_target(self, name: str, role: str, url: str) -> None:
        self.targets[name] = Target(name, role, url)

    async def connect(self, nats_url: str, *, creds: str = "", ca: str = "") -> None:
        """Connect to the bus (``creds``/``ca``: file paths, the admin's) and start following
        every RolloutResult of the run."""
        from harnessrl.common.bus import connect

        self.bus = await connect(
            nats_url, self.run_name, name="harnessrl run (monitor)", creds=creds, ca=ca
        )
        with contextlib.suppress(Exception):
            await self._follow_results()

    async def _follow_results(self) -> None:
        from harnessrl.common.records import RolloutResult, decode

        async def on_msg(msg: Any) -> None:
            try:
                self.add_result(decode(msg.data, RolloutResult))
            except Exception as e:  # a record we cannot read is not the monitor's business
                log.debug("monitor: undecodable result: %r", e)
            with contextlib.suppress(Exception):
                self.results_read = max(self.results_read, int(msg.metadata.sequence.stream))

        self._sub = await self.bus.js.subscribe(
            self.bus.subjects.rollouts,
            stream=self.bus.subjects.stream("ROLLOUTS"),
            ordered_consumer=True,
            cb=on_msg,
        )

    def add_result(self, r: Any) -> None:
        """Account one RolloutResult (also used by tests)."""
        self.result_counts[r.status] += 1
        self.members.add((r.group_id, r.k))
        if r.status in SCORED_STATUSES:
            kind = "eval" if r.is_eval else "train"
            reward = r.reward if r.status == "ok" else 0.0
            acc = self._rewards[(kind, r.harness, r.issued_version)]
            acc[0] += reward
            acc[1] += 1
            d = self._reward_delta[(kind, r.harness, r.issued_version)]
            d[0] += reward
            d[1] += 1
        self._result_times.append(r.ended_at or time.time())

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.close()
        if self._session is not None:
            await self._session.close()

    # -- one refresh ------------------------------------------------------------------------

    async def tick(self) -> None:
        """Scrape every target, engine versions and the bus; copy new learner lines."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
            )
        await asyncio.gather(
            *(self._scrape(t) for t in self.targets.values()),
            *(self._engine_version(n, u) for n, u in self.engines.items()),
            asyncio.wait_for(self._bus_depths(), SCRAPE_TIMEOUT_S),  # NATS may be down
            return_exceptions=True,
        )
        self.copy_learner_lines()
        now = time.monotonic()
        gen = total(self._scraped("engine"), "hrl_engine_generated_tokens_total")
        trained = total(self._scraped("learner"), "hrl_learner_trained_rollouts_total")
        self._rate_hist.append((now, gen, trained))
        while self._rate_hist and now - self._rate_hist[0][0] > RATE_WINDOW_S:
            self._rate_hist.popleft()
        wall = time.time()
        while self._result_times and wall - self._result_times[0] > RATE_WINDOW_S:
            self._result_times.popleft()

    async def _scrape(self, t: Target) -> None:
        try:
            async with self._session.get(t.url) as resp:
                resp.raise_for_status()
                text = await resp.text()
            t.scraped.update(parse_prometheus(text))
            self.unread.pop(f"{t.name} metrics", None)
        except Exception as e:
            t.scraped.ok = False
            self.unread[f"{t.name} metrics"] = _why(e)

    async def _engine_version(self, name: str, url: str) -> None:
        try:
            headers = {}
            if self.engine_api_key_file:
                from harnessrl.common.files import read_secret

                key = read_secret(self.engine_api_key_file, "engine API key file")
                headers["Authorization"] = f"Bearer {key}"
            # SGLang reports its weight version in /model_info only (/get_model_info before
            # the rename; /get_weight_version is gone)
            for path in ("/model_info", "/get_model_info"):
                async with self._session.get(url.rstrip("/") + path, headers=headers) as resp:
                    if resp.status == 404:
                        continue
                    body = await resp.json(content_type=None)
                break
            else:
                raise RuntimeError("the engine answers neither /model_info nor /get_model_info")
            self.engine_versions[name] = str(body.get("weight_version"))
        except Exception:
            self.engine_versions[name] = "down"

    async def _bus_depths(self) -> None:
        """Queue depths; a query that fails makes its queues unknown (None), never 0."""
        if self.bus is None:
            for queue in ("tasks", "samples", "results"):
                self._unknown(queue, "not connected to the bus")
            return
        js, subj = self.bus.js, self.bus.subjects
        for queue, kind in (("tasks", "TASKS"), ("samples", "SAMPLES")):
            try:
                info = await js.stream_info(subj.stream(kind))
                self.queues[queue] = int(info.state.messages)
                if queue == "tasks":
                    self.issued = int(info.state.last_seq)
                self.unread.pop(f"queue {queue}", None)
            except Exception as e:
                self._unknown(queue, _why(e))
        try:
            ci = await js.consumer_info(subj.stream("ROLLOUTS"), "assembler")
            self.queues["results"] = int(ci.num_pending) + int(ci.num_ack_pending)
            self.unread.pop("queue results", None)
        except Exception as e:
            self._unknown("results", _why(e))

    def _unknown(self, queue: str, why: str) -> None:
        self.queues[queue] = None
        self.unread[f"queue {queue}"] = why
        log.debug("monitor: reading queue %s failed: %s", queue, why)

    def drained(self, st: RunStatus) -> bool:
        """Nothing issued is still queued, running on an actor or waiting for the assembler,
        as far as every read says. An unknown queue, or an actor whose ``/metrics`` could not be
        read on the last refresh (its rollouts in flight unknown), counts as busy: the drain
        after the last step must not end on a monitoring error."""
        actors_read = all(t.scraped.ok for t in self.targets.values() if t.role == "actor")
        queues_empty = all(st.queues.get(q) == 0 for q in ("tasks", "results"))
        return actors_read and queues_empty and st.in_flight == 0

    async def audit(self, catch_up_s: float = 10.0, ledger: dict[str, Any] | None = None) -> Any:
        """Where every issued rollout is, from the streams (``harnessrl.common.run.audit``; with the
        learner's committed ``ledger``, what was assembled too); kept in ``accounting``."""
        from harnessrl.common.run.audit import audit

        self.accounting = await audit(
            self.bus,
            self.members,
            lambda: self.results_read,
            catch_up_s=catch_up_s,
            ledger=ledger,
        )
        return self.accounting

    def _scraped(self, role: str) -> list[Scraped]:
        return [t.scraped for t in self.targets.values() if t.role == role]

    # -- learner lines ----------------------------------------------------------------------

    def resume_copy(self) -> None:
        """After a supervisor restart: skip the learner lines already copied."""
        if self.metrics_path.exists():
            with open(self.metrics_path) as f:
                self._copied_lines = sum(1 for ln in f if ln.strip() and RUN_SOURCE not in ln)
            for raw in self.metrics_path.read_text().splitlines():
                line = decode_line(raw)
                if line is not None:
                    self._learner_line(line)

    def copy_learner_lines(self) -> None:
        """Append the learner's new complete lines to the run's metrics.jsonl, verbatim."""
        p = self.learner_metrics
        if p is None or not p.exists():
            return
        with open(p, "rb") as f:
            f.seek(self._learner_offset)
            data = f.read()
        self._learner_offset += len(data)
        data = self._learner_partial + data
        lines = data.split(b"\n")
        self._learner_partial = lines.pop()
        out = []
        for raw in lines:
            if not raw.strip():
                continue
            if self._copied_lines > 0:  # already copied by an earlier supervisor
                self._copied_lines -= 1
                continue
            line = decode_line(raw)
            if line is None:
                continue
            self._learner_line(line)
            out.append(raw + b"\n")
        if out:
            self._append(b"".join(out))

    def _learner_line(self, line: MetricsLine) -> None:
        if isinstance(line, StartLine):
            self.steps_seen = [s for s in self.steps_seen if s.version <= line.version]
            self.learner_version = line.version
        elif isinstance(line, StepLine):
            self.steps_seen.append(line)
            self.learner_version = line.version
            self.reward_train[self.learner_version] = line.reward_mean

    def _append(self, data: bytes) -> None:
        """One ``write`` on an O_APPEND descriptor: lines are never interleaved."""
        fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def write_line(self, line: RunLine) -> None:
        """Append one of the supervisor's own lines (``rollup``, ``summary``), stamped now."""
        line.time = time.time()
        self._append((encode_line(line) + "\n").encode())

    # -- derived ----------------------------------------------------------------------------

    def rates(self) -> tuple[float, float, float]:
        """(rollouts/s, generated tokens/s, samples trained/min) over the rate window."""
        wall = time.time()
        n_results = sum(1 for t in self._result_times if wall - t <= RATE_WINDOW_S)
        span = min(RATE_WINDOW_S, max(1e-9, time.monotonic() - self.t0))
        rollouts = n_results / span if n_results else 0.0
        if len(self._rate_hist) >= 2:
            (t0, g0, s0), (t1, g1, s1) = self._rate_hist[0], self._rate_hist[-1]
            dt = max(1e-9, t1 - t0)
            return rollouts, max(0.0, g1 - g0) / dt, max(0.0, s1 - s0) / dt * 60
        return rollouts, 0.0, 0.0

    def rewards(self) -> dict[str, dict[int, tuple[float, int]]]:
        out: dict[str, dict[int, tuple[float, int]]] = defaultdict(dict)
        for (kind, harness, v), (s, n, _) in sorted(self._rewards.items()):
            if n:
                out[f"{kind}/{harness}"][v] = (s / n, int(n))
        return dict(out)

    def take_reward_delta(self) -> dict[str, dict[str, list[float]]]:
        """Results since the last call: ``{"train/h": {version: [sum, n]}}`` (rollup lines)."""
        out: dict[str, dict[str, list[float]]] = defaultdict(dict)
        for (kind, harness, v), (s, n) in sorted(self._reward_delta.items()):
            out[f"{kind}/{harness}"][str(v)] = [round(s, 6), int(n)]
        self._reward_delta.clear()
        return dict(out)

    def status(self, children: list[ChildView] | None = None, events: list[str] | None = None):
        """The current `RunStatus`."""
        learner = self._scraped("learner")
        actors = self._scraped("actor")
        rps, gen_tps, spm = self.rates()
        stale_n = total(learner, "hrl_learner_staleness_versions_count")
        stale_sum = total(learner, "hrl_learner_staleness_versions_sum")
        version = max(self.learner_version, int(total(learner, "hrl_learner_version")))
        return RunStatus(
            name=self.run_name,
            run_dir=str(self.run_dir),
            steps=self.steps,
            elapsed_s=time.monotonic() - self.t0,
            version=version,
            engine_versions=dict(self.engine_versions),
            synced_versions=by_label(
                self._scraped("weights_sync"), "hrl_weights_sync_version", "engine"
            ),
            rollouts_per_s=rps,
            gen_tokens_per_s=gen_tps,
            train_tokens_per_s=total(learner, "hrl_learner_tokens_per_second"),
            samples_trained=max(
                int(total(learner, "hrl_learner_trained_rollouts_total")),
                sum(s.samples for s in self.steps_seen),
            ),
            samples_per_min=spm,
            learner_idle=total(learner, "hrl_learner_idle_fraction"),
            staleness_mean=stale_sum / stale_n if stale_n else 0.0,
            issued=self.issued,
            in_flight=int(total(actors, "hrl_actor_rollouts_inflight")),
            results=dict(self.result_counts),
            outcomes=by_label(
                self._scraped("assembler"), "hrl_assembler_rollouts_total", "outcome"
            ),
            failures=by_label(actors, "hrl_actor_failures_total", "reason"),
            dropped=by_label(learner, "hrl_learner_dropped_total", "reason"),
            task_stall_s=total(learner, "hrl_task_queue_stalled_seconds"),
            tasks_waiting=int(total(learner, "hrl_task_queue_waiting")),
            queues=dict(self.queues),
            unread=dict(self.unread),
            reward_train=dict(self.reward_train),
            rewards=self.rewards(),
            children=children or [],
            events=events or [],
        )

    def rollup(self, st: RunStatus) -> RollupLine:
        """A ``rollup`` line for metrics.jsonl."""
        return RollupLine(
            elapsed_s=round(st.elapsed_s, 2),
            version=st.version,
            engine_versions=st.engine_versions,
            rollouts_per_s=round(st.rollouts_per_s, 4),
            gen_tokens_per_s=round(st.gen_tokens_per_s, 2),
            train_tokens_per_s=round(st.train_tokens_per_s, 2),
            samples_trained=st.samples_trained,
            samples_per_min=round(st.samples_per_min, 3),
            learner_idle=round(st.learner_idle, 4),
            staleness_mean=round(st.staleness_mean, 3),
            issued=st.issued,
            in_flight=st.in_flight,
            results=st.results,
            outcomes=st.outcomes,
            failures=st.failures,
            dropped=st.dropped,
            queues={k: v for k, v in st.queues.items() if v is not None},  # absent: unknown
            rewards=self.take_reward_delta(),
            restarts={c.name: c.restarts for c in st.children if c.restarts},
        )


# ---------------------------------------------------------------------------------------------
# views
# ---------------------------------------------------------------------------------------------


def _fmt_counts(d: dict[str, float], empty: str = "none") -> str:
    items = sorted(((k, v) for k, v in d.items() if v), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {int(v)}" for k, v in items) or empty


def _why(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:200]


def _queues(st: RunStatus, sep: str) -> str:
    return sep.join(f"{k} {'?' if v is None else v}" for k, v in sorted(st.queues.items()))


def _r(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def stall(st: RunStatus) -> str:
    """What the views say about a stalled task queue ("" when it is not)."""
    if st.task_stall_s < TASK_STALL_ALERT_S:
        return ""
    return (
        f"TASK QUEUE STALLED {st.task_stall_s:.0f}s: {st.tasks_waiting} tasks wait, the task "
        "consumer delivers none (see the learner's log)"
    )


def status_line(st: RunStatus) -> str:
    """One plain line (logs, non-TTY)."""
    engines = " ".join(f"{n}@v{v}" for n, v in sorted(st.engine_versions.items())) or "-"
    train = st.reward_train.get(st.version)
    q = _queues(st, " ")
    unread = f" | UNREAD {', '.join(sorted(st.unread))}" if st.unread else ""
    stalled = f"{stall(st)} | " if stall(st) else ""
    return (
        f"[{_clock(st.elapsed_s)}] {stalled}v{st.version}/{st.steps} | engines {engines} | reward train "
        f"{_r(train)} eval {_r(st.latest_reward('eval'))} | {st.rollouts_per_s:.2f} rollouts/s "
        f"{st.gen_tokens_per_s:.0f} tok/s | trained {st.samples_trained} | idle "
        f"{100 * st.learner_idle:.0f}% | stale {st.staleness_mean:.1f} | queues {q or '-'} | "
        f"failures {_fmt_counts(st.failures)} | tombstones {_fmt_counts(st.tombstones)} | "
        f"dropped {_fmt_counts(st.dropped)}{unread}"
    )


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class PlainStatus:
    """Prints `status_line` every ``interval`` seconds."""

    def __init__(self, interval: float = 15.0, out: Any = None) -> None:
        self.interval = interval
        self.out = out
        self._last = 0.0

    def __enter__(self) -> PlainStatus:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, st: RunStatus, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.interval:
            self._last = now
            print(status_line(st), file=self.out, flush=True)

    def event(self, msg: str) -> None:
        print(f"run: {msg}", file=self.out, flush=True)


def render(st: RunStatus) -> Any:
    """The rich renderable of a snapshot."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    frac = min(1.0, st.version / st.steps) if st.steps else 0.0
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        ProgressBar(total=1.0, completed=frac, width=30),
        Text(f"version {st.version}/{st.steps} ({100 * frac:.0f}%)"),
    )
    head.add_row("progress", bar)
    engines = ", ".join(f"{n} v{v}" for n, v in sorted(st.engine_versions.items())) or "—"
    head.add_row("engines", engines)
    head.add_row(
        "throughput",
        f"{st.rollouts_per_s:.2f} rollouts/s · {st.gen_tokens_per_s:.0f} generated tok/s · "
        f"{st.train_tokens_per_s:.0f} trained tok/s · {st.samples_per_min:.1f} samples/min",
    )
    head.add_row(
        "learner",
        f"{st.samples_trained} samples trained · idle {100 * st.learner_idle:.0f}% · staleness "
        f"{st.staleness_mean:.2f} versions",
    )
    head.add_row(
        "queues", _queues(st, " · ") + f" · rollouts issued {st.issued}, running {st.in_flight}"
    )
    if stall(st):
        head.add_row("stalled", Text(stall(st), style="bold red"))
    if st.unread:
        unread = "; ".join(f"{k}: {v}" for k, v in sorted(st.unread.items()))
        head.add_row("unread", Text(f"{unread} (? = unknown)", style="red"))
    head.add_row("results", _fmt_counts(st.results))
    head.add_row("failures", _fmt_counts(st.failures))
    head.add_row("tombstones", _fmt_counts(st.tombstones))
    head.add_row("dropped", _fmt_counts(st.dropped))

    rewards = Table(title="reward mean by weight version", expand=False, show_edge=False)
    rewards.add_column("version", justify="right")
    rewards.add_column("batch", justify="right")
    keys = sorted(st.rewards)
    for k in keys:
        rewards.add_column(k, justify="right")
    versions = sorted(set(st.reward_train) | {v for k in keys for v in st.rewards[k]})[-8:]
    for v in versions:
        cells = [str(v), _r(st.reward_train.get(v))]
        for k in keys:
            mean_n = st.rewards[k].get(v)
            cells.append(f"{mean_n[0]:.2f} ({mean_n[1]})" if mean_n else "")
        rewards.add_row(*cells)

    procs = Table(title="processes", show_edge=False)
    for col in ("name", "pid", "state", "restarts"):
        procs.add_column(col)
    for c in st.children:
        style = {"ready": "green", "done": "cyan", "restarting": "yellow"}.get(c.state, "red")
        procs.add_row(c.name, str(c.pid or ""), Text(c.state, style=style), str(c.restarts))
    parts: list[Any] = [head, rewards, procs]
    if st.events:
        parts.append(Text("\n".join(st.events[-5:]), style="dim"))
    return Panel(
        Group(*parts),
        title=f"harnessrl run {st.name} — {_clock(st.elapsed_s)}",
        subtitle=st.run_dir,
    )


class LiveDashboard:
    """A rich Live view, refreshed by ``update`` (no background thread)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console()
        self.live = Live(console=self.console, auto_refresh=False, transient=False)

    def __enter__(self) -> LiveDashboard:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def update(self, st: RunStatus, force: bool = False) -> None:
        self.live.update(render(st), refresh=True)

    def event(self, msg: str) -> None:
        pass  # events are shown inside the panel


def make_view(dashboard: bool, interval: float) -> Any:
    """The live dashboard on a terminal, else plain status lines."""
    import sys

    if dashboard and sys.stdout.isatty():
        return LiveDashboard()
    return PlainStatus(interval)
