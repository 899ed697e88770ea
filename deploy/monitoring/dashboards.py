"""The Grafana dashboards of a harnessrl run, built with grafana-foundation-sdk.

    python deploy/monitoring/dashboards.py           # (re)write deploy/monitoring/dashboards/*.json
    python deploy/monitoring/dashboards.py --check   # exit 1 when a committed file is stale

The JSON files are generated, committed, and checked fresh by ``tests/test_monitoring.py``;
edit this module, never the JSON. Import them in Grafana (Dashboards > New > Import, or a
file provisioning provider pointed at ``dashboards/``): each asks for a Prometheus data source
(``$datasource``) and filters by the ``run`` label the scrape targets carry (``$run``; "All"
also matches targets without one).

Every query reads only ``hrl_*`` metrics (``harnessrl.common.metrics``) and ``up`` of the ``hrl-*`` jobs
of ``prometheus.yml``; the test evaluates each one against a real Prometheus scraping a real
run. Dashboards: overview (the run at a glance), proxy, actors, learner (with the feeder and
the assembler), bus, engines (with the weight updaters).

Lives in ``deploy/`` rather than behind a ``harnessrl`` command: the dashboards are deploy
artefacts like ``prometheus.yml``, and the SDK is a development dependency (the ``test``
extra) that no machine running the fleets needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DashboardLinkType,
    DataSourceRef,
    VariableRefresh,
)

OUT = Path(__file__).resolve().parent / "dashboards"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run=~"$run"'
RATE = "$__rate_interval"


def sel(*matchers: str) -> str:
    """A label selector that always filters by the run: ``sel('status!="ok"')``."""
    return "{" + ",".join((RUN, *matchers)) + "}"


def rate(metric: str, *matchers: str, by: str = "") -> str:
    """Per-second rate of a counter, summed (``by``: the labels kept)."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{sel(*matchers)}[{RATE}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    """The ``q`` quantile of a histogram over the rate interval (``by``: labels kept)."""
    keep = ", ".join(("le", *(b.strip() for b in by.split(",") if b.strip())))
    return f"histogram_quantile({q}, sum by ({keep}) (rate({histogram}_bucket{sel()}[{RATE}])))"


def mean(histogram: str, by: str = "") -> str:
    """Mean of a histogram's observations over the rate interval."""
    return f"{rate(histogram + '_sum', by=by)} / {rate(histogram + '_count', by=by)}"


# ---------------------------------------------------------------------------------------------
# panels
# ---------------------------------------------------------------------------------------------


def q(expr: str, legend: str = "") -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr)
    return query.legend_format(legend) if legend else query


def graph(
    title: str, description: str, *targets: prometheus.Dataquery, unit: str = "short", w: int = 8
) -> timeseries.Panel:
    """A time series panel."""
    panel = timeseries.Panel().title(title).description(description).datasource(DS)
    panel = panel.unit(unit).span(w).height(8).fill_opacity(10).line_width(1)
    for t in targets:
        panel = panel.with_target(t)
    return panel


def number(title: str, description: str, expr: str, *, unit: str = "short") -> stat.Panel:
    """A single-value panel (the newest value of ``expr``)."""
    target = prometheus.Dataquery().expr(expr).legend_format("{{run}}")
    panel = stat.Panel().title(title).description(description).datasource(DS)
    return panel.unit(unit).span(4).height(4).with_target(target)


def board(uid: str, title: str, description: str) -> dashboard.Dashboard:
    """A dashboard with the data source and run variables and links to the others."""
    run = (
        dashboard.QueryVariable("run")
        .label("Run")
        .datasource(DS)
        .query('label_values(up{job=~"hrl-.*"}, run)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    others = (
        dashboard.DashboardLink("harnessrl")
        .type(DashboardLinkType.DASHBOARDS)
        .tags(["harnessrl"])
        .as_dropdown(True)
        .include_vars(True)
        .keep_time(True)
    )
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["harnessrl"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .link(others)
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(run)
    )


def row(b: dashboard.Dashboard, title: str, *panels: object) -> dashboard.Dashboard:
    b = b.with_row(dashboard.Row(title))
    for p in panels:
        b = b.with_panel(p)  # type: ignore[arg-type]
    return b


# ---------------------------------------------------------------------------------------------
# the dashboards
# ---------------------------------------------------------------------------------------------

FAILED = 'status!~"ok|timeout"'
"""Rollout statuses that are infrastructure failures (``harnessrl.common.records.INFRA_STATUSES`` less
``timeout``, which may be scored)."""
LOSS_TERMS = 'name=~"loss/.*"'
OFF_POLICY_STATS = 'name=~"mismatch/.*|is/.*|ppo/.*"'
POLICY_HEALTH = 'name=~"entropy|rollouts/truncated_frac|value/explained_variance"'
"""``hrl_learner_step_metric`` names of the loss terms and of the off-policy statistics."""
CACHE_HIT = 'result="hit"'


def overview() -> dashboard.Dashboard:
    b = board("hrl-overview", "harnessrl / overview", "A training run at a glance.")
    b = row(
        b,
        "Now",
        number(
            "Learner version",
            "Weight versions trained.",
            f"max by (run) (hrl_learner_version{sel()})",
        ),
        number(
            "Oldest engine version",
            "Lowest version an engine's updater applied (embedded engines and SGLang alike).",
            f"min by (run) (hrl_weights_sync_version{sel()})",
        ),
        number(
            "Rollouts / s",
            "Rollouts finished, any status.",
            rate("hrl_actor_rollouts_total", by="run"),
        ),
        number(
            "Generated tokens / s",
            "Tokens sampled by the embedded engines.",
            rate("hrl_engine_generated_tokens_total", by="run"),
        ),
        number(
            "Learner idle",
            "Fraction of the learner's wall time spent waiting for samples.",
            f"max by (run) (hrl_learner_idle_fraction{sel()})",
            unit="percentunit",
        ),
        number(
            "Failed rollouts",
            "Fraction of rollouts that ended in an infrastructure failure (not scored).",
            f"{rate('hrl_actor_rollouts_total', FAILED, by='run')} / "
            f"{rate('hrl_actor_rollouts_total', by='run')}",
            unit="percentunit",
        ),
    )
    b = row(
        b,
        "Training",
        graph(
            "Weight version",
            "The learner's version and the version each engine's updater applied.",
            q(f"max by (run) (hrl_learner_version{sel()})", "learner {{run}}"),
            q(f"max by (engine) (hrl_weights_sync_version{sel()})", "engine {{engine}}"),
        ),
        graph(
            "Reward by harness",
            "Mean reward of scored rollouts per harness (train and held-out eval rollouts), and "
            "the learner's eval rounds.",
            q(mean("hrl_actor_reward", by="harness, kind"), "{{kind}} {{harness}}"),
            q(f"hrl_learner_eval_reward{sel()}", "eval round {{suite}}/{{harness}}"),
        ),
        graph(
            "Rollouts / s",
            "Rollouts finished per second, by status.",
            q(rate("hrl_actor_rollouts_total", by="status"), "{{status}}"),
            unit="reqps",
        ),
        graph(
            "Tokens / s",
            "Sampled by the engines, trained (loss-mask 1) by the assembler's samples, computed "
            "by the learner (tree-packed forward and backward).",
            q(rate("hrl_engine_generated_tokens_total"), "generated"),
            q(rate("hrl_assembler_model_tokens_total"), "model tokens assembled"),
            q(f"sum(hrl_learner_tokens_per_second{sel()})", "learner computed"),
        ),
        graph(
            "Staleness",
            "Versions between a trained sample's weights and the learner's (admission control "
            "keeps it within max_staleness).",
            q(mean("hrl_learner_staleness_versions"), "mean"),
            q(quantile(0.9, "hrl_learner_staleness_versions"), "p90"),
        ),
        graph(
            "Learner idle",
            "Fraction of the learner's wall time spent waiting for samples (cumulative).",
            q(f"max by (run) (hrl_learner_idle_fraction{sel()})", "{{run}}"),
            unit="percentunit",
        ),
    )
    return row(
        b,
        "Failures",
        graph(
            "Failed rollouts by reason",
            "Rollouts that failed (sandbox, harness, verifier, engine) or timed out, by reason.",
            q(rate("hrl_actor_failures_total", by="reason"), "{{reason}}"),
            unit="reqps",
        ),
        graph(
            "Tombstones",
            "Rollouts the assembler ended without a sample, by reason.",
            q(
                rate("hrl_assembler_rollouts_total", 'outcome!="sample"', by="outcome"),
                "{{outcome}}",
            ),
            unit="reqps",
        ),
        graph(
            "Samples dropped by the learner",
            "Samples not trained, by reason (stale: older than max_staleness).",
            q(rate("hrl_learner_dropped_total", by="reason"), "{{reason}}"),
            unit="reqps",
        ),
        graph(
            "Dead letters",
            "Messages given up as undecodable or unprocessable, by stream and consumer.",
            q(
                rate("hrl_bus_dead_lettered_total", by="stream, consumer"),
                "{{stream}} {{consumer}}",
            ),
            unit="reqps",
        ),
        graph(
            "Processes up",
            "1 while Prometheus can scrape a process.",
            q(f'up{{job=~"hrl-.*",{RUN}}}', "{{job}} {{process}}"),
            w=16,
        ),
    )


def proxy() -> dashboard.Dashboard:
    b = board(
        "hrl-proxy",
        "harnessrl / proxy",
        "The per-sandbox proxies (inside the actors) and standalone proxies: engine calls, "
        "token-in-token-out, CallRecords.",
    )
    b = row(
        b,
        "Engine calls",
        graph(
            "Engine calls / s",
            "Generate calls by outcome (finish reason, or unavailable / bad_request / error).",
            q(rate("hrl_proxy_engine_requests_total", by="outcome"), "{{outcome}}"),
            unit="reqps",
        ),
        graph(
            "Engines in rotation",
            "1 while every proxy keeps the engine in rotation; 0 once one ejected it.",
            q(f"min by (engine) (hrl_proxy_engine_healthy{sel()})", "{{engine}}"),
        ),
        graph(
            "Calls in flight",
            "Generate calls outstanding per engine.",
            q(f"sum by (engine) (hrl_proxy_engine_outstanding{sel()})", "{{engine}}"),
        ),
        graph(
            "Ejections and swap retries",
            "Engines taken out of rotation, and calls retried on another engine during a weight swap.",
            q(rate("hrl_proxy_engine_ejections_total", by="engine"), "ejected {{engine}}"),
            q(rate("hrl_proxy_engine_swap_retries_total"), "swap retries"),
            unit="reqps",
        ),
    )
    return row(
        b,
        "Token-in-token-out and records",
        graph(
            "TITO",
            "How each call's prompt was built: first call, hit (extends an earlier call's "
            "tokens), miss (re-rendered); false forks: re-rendered calls that leave a dead branch.",
            q(rate("hrl_proxy_tito_total", by="result"), "{{result}}"),
            q(rate("hrl_proxy_false_forks_total"), "false forks"),
            unit="reqps",
        ),
        graph(
            "CallRecords / s",
            "Records published to the bus or lost, and calls refused because the buffer was full.",
            q(rate("hrl_proxy_records_total", by="outcome"), "{{outcome}}"),
            q(rate("hrl_proxy_calls_refused_total"), "refused"),
            unit="reqps",
        ),
        graph(
            "Records waiting",
            "CallRecords buffered, not yet acked by the bus.",
            q(f"sum(hrl_proxy_records_buffered{sel()})", "buffered"),
        ),
        graph(
            "Record publish latency",
            "From a record to its bus ack.",
            q(quantile(0.5, "hrl_proxy_record_publish_seconds"), "p50"),
            q(quantile(0.99, "hrl_proxy_record_publish_seconds"), "p99"),
            unit="s",
        ),
    )


def actors() -> dashboard.Dashboard:
    b = board("hrl-actors", "harnessrl / actors", "Rollouts: sandboxes, harnesses, verifiers.")
    b = row(
        b,
        "Rollouts",
        graph(
            "Rollouts in flight",
            "Rollouts running now, per actor.",
            q(f"sum by (process) (hrl_actor_rollouts_inflight{sel()})", "{{process}}"),
        ),
        graph(
            "Rollouts / s by status",
            "ok is scored; every other status is an infrastructure outcome (tombstoned).",
            q(rate("hrl_actor_rollouts_total", by="status"), "{{status}}"),
            unit="reqps",
        ),
        graph(
            "Failures by reason",
            "Failed rollouts by reason (finer than the status).",
            q(rate("hrl_actor_failures_total", by="reason"), "{{reason}}"),
            unit="reqps",
        ),
        graph(
            "Task messages",
            "TaskRequests acked, nak'ed for a retry, or dead-lettered.",
            q(rate("hrl_actor_tasks_total", by="outcome"), "{{outcome}}"),
            unit="reqps",
        ),
        graph(
            "Reward",
            "Median and mean reward of scored rollouts, per harness and kind.",
            q(quantile(0.5, "hrl_actor_reward", by="harness, kind"), "p50 {{kind}} {{harness}}"),
            q(mean("hrl_actor_reward", by="harness, kind"), "mean {{kind}} {{harness}}"),
        ),
        graph(
            "Model calls per rollout",
            "Calls a harness made per rollout.",
            q(quantile(0.5, "hrl_actor_calls_per_rollout"), "p50"),
            q(quantile(0.9, "hrl_actor_calls_per_rollout"), "p90"),
        ),
    )
    return row(
        b,
        "Durations",
        graph(
            "Phase durations (p90)",
            "Sandbox creation, harness run, verification and the whole rollout.",
            q(quantile(0.9, "hrl_actor_phase_seconds", by="phase"), "{{phase}}"),
            unit="s",
        ),
        graph(
            "Sandbox create / destroy (p90)",
            "Per sandbox backend.",
            q(
                quantile(0.9, "hrl_actor_sandbox_create_seconds", by="backend"),
                "create {{backend}}",
            ),
            q(
                quantile(0.9, "hrl_actor_sandbox_destroy_seconds", by="backend"),
                "destroy {{backend}}",
            ),
            unit="s",
        ),
    )


def learner() -> dashboard.Dashboard:
    b = board(
        "hrl-learner",
        "harnessrl / learner",
        "The learner (steps, losses, off-policy statistics, checkpoints, broadcasts), its task "
        "feeder and the assembler.",
    )
    b = row(
        b,
        "Steps",
        graph(
            "Version and samples trained",
            "Weight version, and rollouts trained per second.",
            q(f"max by (run) (hrl_learner_version{sel()})", "version"),
            q(rate("hrl_learner_trained_rollouts_total"), "trained / s"),
        ),
        graph(
            "Step time",
            "Optimiser step (pack + forward/backward + step).",
            q(quantile(0.5, "hrl_learner_step_seconds"), "p50"),
            q(quantile(0.9, "hrl_learner_step_seconds"), "p90"),
            unit="s",
        ),
        graph(
            "Learner tokens / s",
            "Tokens computed per second in the last step.",
            q(f"sum(hrl_learner_tokens_per_second{sel()})", "tokens/s"),
        ),
        graph(
            "Loss terms",
            "Loss terms of the last step.",
            q(f"hrl_learner_step_metric{sel(LOSS_TERMS)}", "{{name}}"),
        ),
        graph(
            "Off-policy statistics",
            "Rollout/learner mismatch (mean |dlogp|, KL), importance weights and clip fractions.",
            q(f"hrl_learner_step_metric{sel(OFF_POLICY_STATS)}", "{{name}}"),
        ),
        graph(
            "Policy health",
            "Mean entropy of the scored tokens; share of the step's rollouts with a reply cut off"
            " at the token limit (a policy drifting into junk repeated to the limit shows here"
            " first); PPO: the critic's explained variance of the return.",
            q(f"hrl_learner_step_metric{sel(POLICY_HEALTH)}", "{{name}}"),
        ),
        graph(
            "Eval reward",
            "Mean reward of the last eval round per suite and harness.",
            q(f"hrl_learner_eval_reward{sel()}", "{{suite}}/{{harness}}"),
        ),
    )
    b = row(
        b,
        "Samples and admission",
        graph(
            "Staleness",
            "Versions between a trained sample's weights and the learner's.",
            q(quantile(0.5, "hrl_learner_staleness_versions"), "p50"),
            q(quantile(0.9, "hrl_learner_staleness_versions"), "p90"),
            q(mean("hrl_learner_staleness_versions"), "mean"),
        ),
        graph(
            "Dropped and duplicate samples",
            "Samples not trained by reason, redelivered duplicates, split samples given up.",
            q(rate("hrl_learner_dropped_total", by="reason"), "dropped {{reason}}"),
            q(rate("hrl_learner_duplicate_deliveries_total"), "duplicate deliveries"),
            q(rate("hrl_learner_incomplete_samples_total"), "incomplete split samples"),
            unit="reqps",
        ),
        graph(
            "Admission",
            "Training rollouts issued and not yet ended, against the feeder's limit; rollouts "
            "waiting in the learner for their group or batch.",
            q(f"sum(hrl_feeder_in_flight{sel()})", "in flight"),
            q(f"sum(hrl_feeder_capacity{sel()})", "capacity"),
            q(f"sum(hrl_learner_pending_rollouts{sel()})", "pending in learner"),
        ),
        graph(
            "Tasks issued / s",
            "TaskRequests published by the feeder, train and eval.",
            q(rate("hrl_feeder_issued_total", by="kind"), "{{kind}}"),
            unit="reqps",
        ),
        graph(
            "Checkpoints and broadcasts",
            "Commit duration (full or state-only) and weight broadcast duration (p90).",
            q(quantile(0.9, "hrl_learner_checkpoint_seconds", by="kind"), "checkpoint {{kind}}"),
            q(quantile(0.9, "hrl_learner_broadcast_seconds"), "broadcast"),
            unit="s",
        ),
        graph(
            "Broadcast bytes / s",
            "Weight bytes broadcast.",
            q(rate("hrl_learner_broadcast_bytes_total"), "bytes/s"),
            unit="Bps",
        ),
    )
    return row(
        b,
        "Assembler",
        graph(
            "Assembled",
            "CallRecords assembled and rollouts settled per second, by outcome.",
            q(rate("hrl_assembler_calls_total"), "calls"),
            q(rate("hrl_assembler_rollouts_total", by="outcome"), "rollouts {{outcome}}"),
            unit="reqps",
        ),
        graph(
            "Tree tokens / s",
            "Unique tree tokens (each counted once), tokens if every branch were its own "
            "sequence, and trained model tokens.",
            q(rate("hrl_assembler_unique_tokens_total"), "unique"),
            q(rate("hrl_assembler_expanded_tokens_total"), "branch-expanded"),
            q(rate("hrl_assembler_model_tokens_total"), "model (loss mask 1)"),
        ),
        graph(
            "Branches and forks",
            "Retained branches per sample (p90), forked samples and TITO misses per second.",
            q(quantile(0.9, "hrl_assembler_branches"), "branches p90"),
            q(rate("hrl_assembler_forked_total"), "forked / s"),
            q(rate("hrl_assembler_tito_misses_total"), "TITO misses / s"),
        ),
        graph(
            "Assembler latency",
            "From a rollout's end to its sample stored, and tree building alone (p90).",
            q(quantile(0.9, "hrl_assembler_lag_seconds"), "lag"),
            q(quantile(0.9, "hrl_assembler_assemble_seconds"), "assemble"),
            unit="s",
        ),
        graph(
            "Assembler retries",
            "Duplicate results, straggler re-reads, bus-error retries, split samples, dropped calls.",
            q(rate("hrl_assembler_duplicate_results_total"), "duplicates"),
            q(rate("hrl_assembler_straggler_waits_total"), "straggler waits"),
            q(rate("hrl_assembler_retries_total"), "retries"),
            q(rate("hrl_assembler_split_samples_total"), "split samples"),
            q(rate("hrl_assembler_dropped_calls_total", by="reason"), "dropped calls {{reason}}"),
            unit="reqps",
        ),
        graph(
            "Assembling now",
            "Rollouts being assembled.",
            q(f"sum(hrl_assembler_inflight{sel()})", "in flight"),
        ),
    )


def bus() -> dashboard.Dashboard:
    b = board(
        "hrl-bus",
        "harnessrl / bus",
        "JetStream traffic as every process sees it (hrl_bus_*): publishes, deliveries, acks, "
        "redeliveries, dead letters, consumer lag.",
    )
    return row(
        b,
        "Streams",
        graph(
            "Published / s",
            "Records published per stream.",
            q(rate("hrl_bus_published_total", by="stream"), "{{stream}}"),
            unit="reqps",
        ),
        graph(
            "Publish duplicates and retries",
            "Publishes the server de-duplicated by msg id, and attempts retried after a "
            "transient error.",
            q(rate("hrl_bus_duplicates_total", by="stream"), "duplicates {{stream}}"),
            q(rate("hrl_bus_publish_retries_total", by="stream"), "retries {{stream}}"),
            unit="reqps",
        ),
        graph(
            "Consumed / s",
            "Records delivered to each consumer.",
            q(rate("hrl_bus_consumed_total", by="stream, consumer"), "{{stream}} {{consumer}}"),
            unit="reqps",
        ),
        graph(
            "Acked and nak'ed / s",
            "Deliveries acked, and nak'ed for a redelivery.",
            q(rate("hrl_bus_acked_total", by="stream, consumer"), "acked {{stream}} {{consumer}}"),
            q(rate("hrl_bus_naked_total", by="stream, consumer"), "nak {{stream}} {{consumer}}"),
            unit="reqps",
        ),
        graph(
            "Redelivered / s",
            "Deliveries with a delivery count above 1.",
            q(rate("hrl_bus_redelivered_total", by="stream, consumer"), "{{stream}} {{consumer}}"),
            unit="reqps",
        ),
        graph(
            "Dead letters / s",
            "Messages given up, by stream and consumer.",
            q(
                rate("hrl_bus_dead_lettered_total", by="stream, consumer"),
                "{{stream}} {{consumer}}",
            ),
            unit="reqps",
        ),
        graph(
            "Consumer lag",
            "Messages pending for each consumer (as of its last fetch).",
            q(
                f"max by (stream, consumer) (hrl_bus_consumer_lag{sel()})",
                "{{stream}} {{consumer}}",
            ),
            w=24,
        ),
    )


def engines() -> dashboard.Dashboard:
    b = board(
        "hrl-engines",
        "harnessrl / engines",
        "The embedded engines (hrl_engine_*) and the weight updaters beside every engine.",
    )
    b = row(
        b,
        "Serving",
        graph(
            "Engines up",
            "1 while Prometheus can scrape the engine.",
            q(f'up{{job="hrl-engine",{RUN}}}', "{{process}}"),
        ),
        graph(
            "Generated tokens / s",
            "Tokens sampled, per engine.",
            q(rate("hrl_engine_generated_tokens_total", by="process"), "{{process}}"),
        ),
        graph(
            "Prompt tokens / s",
            "Prompt tokens of finished requests: computed (prefill) or reused from the prefix cache.",
            q(rate("hrl_engine_prompt_tokens_total"), "prompt"),
            q(rate("hrl_engine_prefill_tokens_total"), "prefilled"),
            q(rate("hrl_engine_cached_tokens_total"), "cached"),
        ),
        graph(
            "Prefix cache",
            "Hit ratio of prefix cache lookups, and bytes held.",
            q(
                f"{rate('hrl_engine_prefix_cache_lookups_total', CACHE_HIT)} / "
                f"{rate('hrl_engine_prefix_cache_lookups_total')}",
                "hit ratio",
            ),
            q(f"sum(hrl_engine_prefix_cache_bytes{sel()}) / 1e9", "GB held"),
        ),
        graph(
            "Batch",
            "Requests decoded in the last step, holding a slot, and waiting for one.",
            q(f"sum by (process) (hrl_engine_batch_size{sel()})", "batch {{process}}"),
            q(f"sum by (process) (hrl_engine_running_requests{sel()})", "running {{process}}"),
            q(f"sum by (process) (hrl_engine_queue_depth{sel()})", "queued {{process}}"),
        ),
        graph(
            "Step time",
            "Duration of one scheduler step.",
            q(quantile(0.5, "hrl_engine_step_seconds"), "p50"),
            q(quantile(0.99, "hrl_engine_step_seconds"), "p99"),
            unit="s",
        ),
        graph(
            "Requests / s by finish",
            "Finished generate requests by finish reason (stop, length, abort).",
            q(rate("hrl_engine_requests_total", by="finish"), "{{finish}}"),
            unit="reqps",
        ),
        graph(
            "Engine tokens / s (engine's view)",
            "Tokens sampled per second over the engine's last 10 s.",
            q(f"sum by (process) (hrl_engine_tokens_per_second{sel()})", "{{process}}"),
        ),
    )
    return row(
        b,
        "Weights",
        graph(
            "Weight version",
            "Version each engine serves, and the version its updater applied.",
            q(f"max by (process) (hrl_engine_weight_version{sel()})", "engine {{process}}"),
            q(f"max by (engine) (hrl_weights_sync_version{sel()})", "updater {{engine}}"),
        ),
        graph(
            "Weight updates",
            "Updates applied by the engines (by source), versions the updaters rejected (by "
            "reason) or skipped.",
            q(rate("hrl_engine_weight_updates_total", by="source"), "engine {{source}}"),
            q(rate("hrl_weights_sync_rejected_total", by="reason"), "rejected {{reason}}"),
            q(rate("hrl_weights_sync_skipped_total", by="engine"), "skipped {{engine}}"),
            unit="reqps",
        ),
        graph(
            "Update time (p90)",
            "Receive + verify + write + apply of one version, per engine.",
            q(quantile(0.9, "hrl_weights_sync_seconds", by="engine"), "{{engine}}"),
            unit="s",
        ),
    )


DASHBOARDS = {
    "overview": overview,
    "proxy": proxy,
    "actors": actors,
    "learner": learner,
    "bus": bus,
    "engines": engines,
}


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def render(build: dashboard.Dashboard) -> str:
    """The dashboard's JSON: stable panel ids and query refIds, sorted keys."""
    doc = json.loads(json.dumps(build.build(), cls=JSONEncoder))
    for i, panel in enumerate(doc.get("panels", []), start=1):
        panel["id"] = i
        for j, target in enumerate(panel.get("targets", [])):
            target["refId"] = chr(ord("A") + j)
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def generate() -> dict[str, str]:
    """``{file name: JSON text}`` of every dashboard."""
    return {f"harnessrl-{name}.json": render(make()) for name, make in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"folder to write (default {OUT})")
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when a file there is stale"
    )
    args = ap.parse_args(argv)
    files = generate()
    stale = [n for n, text in files.items() if _read(args.out / n) != text]
    if args.check:
        for n in stale:
            print(f"stale: {args.out / n} (run python {Path(__file__).name})", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for n in stale:
        (args.out / n).write_text(files[n])
        print(f"wrote {args.out / n}")
    return 0


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


if __name__ == "__main__":
    sys.exit(main())
