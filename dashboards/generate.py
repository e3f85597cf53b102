"""The Grafana dashboard, as code (grafana-foundation-sdk), and the files the Helm chart ships.

    make generate                                     # every generated file (scripts/generate.py)
    .venv/bin/python -m dashboards.generate           # only these
    .venv/bin/python -m dashboards.generate --check   # exit 1 if any is stale

Writes `dashboards/llm-admission.json` and the chart's copies, `helm/llm-admission/files/`
`llm-admission.json` and `llm-admission.rules.yml` (Helm can only read files inside the chart;
the rules' source is `alerts/llm-admission.rules.yml`).

Series come from two places: the admission service's /metrics (docs/metrics.md; label `engine`
is the engine's name in the service's config) and vLLM's own /metrics (`vllm:*`, label
`model_name`; vLLM's `engine` label is a data-parallel rank, unrelated). Nothing maps an engine
name to its models in PromQL, so the gateway's view and vLLM's own series sit side by side in
one panel each: a gap between the two lines is the disagreement to look at.

Every query must return data on a live stack: tests/observability evaluates each one against a
real Prometheus scraping the service and the simulator. The service there runs the redis ledger
(ADMISSION_LEDGER=redis on a throwaway redis-server), the only configuration in which the
`admission_ledger_*` series of the "Shared ledger (Redis)" row exist; every other series is the
same with either ledger.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders, dashboard as db, prometheus, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, dashboard as model

from extproc.outcomes import CAPACITY_REASONS_REGEX

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "llm-admission.json"
RULES = ROOT / "alerts" / "llm-admission.rules.yml"
CHART_FILES = ROOT / "helm" / "llm-admission" / "files"

UID = "llm-admission"
TITLE = "LLM admission"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Label filters: the gateway's series by engine name, vLLM's by served model.
GW = 'engine=~"$engine"'


def vllm(name: str) -> str:
    """A selector for vLLM's own series `vllm:NAME`, whichever way it was stored.

    prometheus_client (0.26 checked) writes `vllm_NAME` instead of `vllm:NAME` on sample lines
    when the scraper negotiates OpenMetrics without UTF-8 escaping, as Prometheus 2.x does; plain
    text and Prometheus 3 keep the colon. Matching both makes the dashboard work with either.
    """
    return f'{{__name__=~"vllm[:_]{name}",model_name=~"$model"}}'


RATE = "$__rate_interval"
# The error histogram's lowest bucket (actual <= predicted): prometheus_client writes le="0.0",
# Prometheus 3 normalises it to le="0".
LE_ZERO = 'le=~"0|0.0"'
ALL = model.VariableOption(selected=True, text=["All"], value=["$__all"])

# Capacity rejections over all decisions, per engine; the `or ... * 0` keeps the ratio defined
# (at 1) for an engine that has rejected everything and admitted nothing yet. The alert
# LLMAdmissionHighRejectionRatio uses the same expression.
REJECTION_RATIO = (
    f'sum by (engine) (rate(admission_rejected_total{{reason=~"{CAPACITY_REASONS_REGEX}",'
    f"{GW}}}[{RATE}]))\n"
    f"/\n"
    f"(sum by (engine) (rate(admission_rejected_total{{{GW}}}[{RATE}]))\n"
    f" + (sum by (engine) (rate(admission_admitted_total{{{GW}}}[{RATE}]))"
    f" or sum by (engine) (rate(admission_rejected_total{{{GW}}}[{RATE}])) * 0))"
)


def query(ref: str, expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().ref_id(ref).expr(expr).legend_format(legend).range()


def panel(title: str, description: str, unit: str, *targets: prometheus.Dataquery, width: int = 12,
          bars: bool = False) -> timeseries.Panel:
    built = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
    )
    if bars:
        built = built.draw_style(common.GraphDrawStyle.BARS).fill_opacity(60)
    for target in targets:
        built = built.with_target(target)
    return built


def variables() -> list[cogbuilder.Builder[model.VariableModel]]:
    return [
        db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
        db.QueryVariable("engine")
        .label("engine (gateway)")
        .datasource(DATASOURCE)
        .query("label_values(admission_queue_depth, engine)")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL),
        db.QueryVariable("namespace")
        .label("namespace (containers)")
        .datasource(DATASOURCE)
        .query('label_values(container_cpu_cfs_periods_total{container=~"envoy|admission"}, namespace)')
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL),
        db.QueryVariable("model")
        .label("model (vLLM)")
        .datasource(DATASOURCE)
        .query('label_values({__name__=~"vllm[:_]num_requests_running"}, model_name)')
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL),
    ]


def build() -> dict[str, object]:
    dash = (
        db.Dashboard(TITLE)
        .uid(UID)
        .tags(["llm", "vllm", "envoy", "admission"])
        .description("Admission decisions of the llm-admission gateway, and the vLLM engines behind it. "
                     "Runbook: docs/runbook.md.")
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .variables(variables())
        .with_row(db.Row("Admission"))
        .with_panel(panel(
            "Admission decisions per second, by outcome",
            "Admitted by path (admitted, admitted_after_park, admitted_fail_open), rejected by reason "
            "(queue_full, park_timeout, body_too_large, ...), parks begun, and requests not subject to "
            "admission (ungated paths).",
            "reqps",
            query("A", f"sum by (via) (rate(admission_admitted_total{{{GW}}}[{RATE}]))", "admitted: {{via}}"),
            query("B", f"sum by (reason) (rate(admission_rejected_total{{{GW}}}[{RATE}]))", "rejected: {{reason}}"),
            query("C", f"sum(rate(admission_parked_total{{{GW}}}[{RATE}]))", "parked"),
            query("D", f"sum by (reason) (rate(admission_passthrough_total[{RATE}]))", "not gated: {{reason}}"),
        ))
        .with_panel(panel(
            "Capacity rejection ratio",
            "queue_full + park_timeout + expected_wait_too_long over all decisions. "
            "Alert LLMAdmissionHighRejectionRatio fires above 0.10 for 10 minutes.",
            "percentunit",
            query("A", REJECTION_RATIO, "{{engine}}"),
        ))
        .with_panel(panel(
            "Parked and in flight",
            "Parked now (bounded by the queue depth), admitted by this gateway and still streaming, and "
            "running + waiting as the gate counts it (last poll corrected by local admissions and "
            "completions).",
            "short",
            query("A", f"sum by (engine) (admission_queue_depth{{{GW}}})", "parked: {{engine}}"),
            query("B", f"sum by (engine) (admission_inflight{{{GW}}})", "in flight: {{engine}}"),
            query("C", f"sum by (engine) (admission_effective_load{{{GW}}})", "effective load: {{engine}}"),
        ))
        .with_panel(panel(
            "Park time p50 / p95",
            "How long parked requests waited, whatever ended the park (admission, timeout, client gone).",
            "s",
            query("A", "histogram_quantile(0.5, sum by (le, engine) "
                       f"(rate(admission_park_duration_seconds_bucket{{{GW}}}[{RATE}])))", "p50: {{engine}}"),
            query("B", "histogram_quantile(0.95, sum by (le, engine) "
                       f"(rate(admission_park_duration_seconds_bucket{{{GW}}}[{RATE}])))", "p95: {{engine}}"),
        ))
        .with_panel(panel(
            "KV-token budget",
            "KV tokens this gateway reserved for admitted requests still streaming, what the budget "
            "would still admit (empty when the budget does not apply), and the engine's capacity "
            "(vllm:cache_config_info, or the configured kvCapacityTokens).",
            "short",
            query("A", f"sum by (engine) (admission_kv_reserved_tokens{{{GW}}})", "reserved: {{engine}}"),
            query("B", f"sum by (engine) (admission_kv_available_tokens{{{GW}}})", "available: {{engine}}"),
            query("C", f"max by (engine) (vllm_kv_capacity_tokens{{{GW}}})", "capacity: {{engine}}"),
        ))
        .with_panel(panel(
            "Prompt tokens per second: gateway estimate vs vLLM",
            "The budget's estimate (prompt bytes / bytesPerToken) of admitted requests against the "
            "prompt tokens vLLM counted. A gateway line far below vLLM's means bytesPerToken is too "
            "high for this traffic and the budget over-admits.",
            "short",
            query("A", f"sum by (engine) (rate(admission_estimated_prompt_tokens_total{{{GW}}}[{RATE}]))",
                  "gateway estimate: {{engine}}"),
            query("B", f"sum by (model_name) (rate({vllm('prompt_tokens_total')}[{RATE}]))",
                  "vLLM: {{model_name}}"),
        ))
        .with_panel(panel(
            "Prompt estimate / what the engine counted",
            "The gateway's estimated prompt tokens (all replicas) over the engine's own count "
            "(admission_engine_prompt_tokens_total, the growth of vllm:prompt_tokens_total the gateway "
            "saw). Below 1 the KV budget under-reserves; below 0.9 for 10 minutes the alert "
            "LLMAdmissionEstimateUnderCounts fires. Large prompts waiting for their prefill make it read "
            "high for a while.",
            "short",
            query("A", f"sum by (engine) (rate(admission_estimated_prompt_tokens_total{{{GW}}}[{RATE}])) / "
                       f"max by (engine) (rate(admission_engine_prompt_tokens_total{{{GW}}}[{RATE}]))",
                  "estimate / engine: {{engine}}"),
            query("B", f"max by (engine) (admission_bytes_per_token{{{GW}}})",
                  "bytes per token (bytes rule): {{engine}}"),
        ))
        .with_panel(panel(
            "Where prompt counts came from",
            "Decisions per second by the source of their prompt-token count: tokenizer (ADMISSION_TOKENIZER), "
            "engine (its POST /tokenize), fallback (the engine did not answer in time), learned / prior "
            "(the bytes rule), bytes (ADMISSION_ESTIMATE=bytes).",
            "reqps",
            query("A", f"sum by (engine, source) (rate(admission_estimate_source_total{{{GW}}}[{RATE}]))",
                  "{{engine}}: {{source}}"),
        ))
        .with_panel(panel(
            "Predicted wait p50 / p90",
            "The wait the gate predicted for each park or early answer, by kind (ADMISSION_WAIT_PREDICTION: "
            "expected, or bound, a lower bound). Predictions past the park cap were answered at once "
            "(expected_wait_too_long).",
            "s",
            query("A", "histogram_quantile(0.5, sum by (le, engine, kind) "
                       f"(rate(admission_predicted_wait_seconds_bucket{{{GW}}}[{RATE}])))",
                  "p50: {{engine}} ({{kind}})"),
            query("B", "histogram_quantile(0.9, sum by (le, engine, kind) "
                       f"(rate(admission_predicted_wait_seconds_bucket{{{GW}}}[{RATE}])))",
                  "p90: {{engine}} ({{kind}})"),
            width=8,
        ))
        .with_panel(panel(
            "Wait prediction error: actual - predicted",
            "Parked requests then admitted: how much later than predicted they started. The mean is signed; "
            "p50 / p90 read 0 for any request that started sooner (the histogram has no negative buckets). "
            "A negative mean: predictions run long and early answers may turn away servable requests "
            "(alert LLMAdmissionWaitPredictionTooLong).",
            "s",
            # _sum falls with every negative error: delta(), not rate() (which reads a fall as a restart).
            query("A", "sum by (engine, kind) "
                       f"(delta(admission_wait_prediction_error_seconds_sum{{{GW}}}[{RATE}])) / sum by (engine, kind) "
                       f"(increase(admission_wait_prediction_error_seconds_count{{{GW}}}[{RATE}]))",
                  "mean: {{engine}} ({{kind}})"),
            query("B", "histogram_quantile(0.5, sum by (le, engine, kind) "
                       f"(rate(admission_wait_prediction_error_seconds_bucket{{{GW}}}[{RATE}])))",
                  "p50: {{engine}} ({{kind}})"),
            query("C", "histogram_quantile(0.9, sum by (le, engine, kind) "
                       f"(rate(admission_wait_prediction_error_seconds_bucket{{{GW}}}[{RATE}])))",
                  "p90: {{engine}} ({{kind}})"),
            width=8,
        ))
        .with_panel(panel(
            "Started no later than predicted",
            "Share of parked-then-admitted requests whose wait was at most the prediction. Expected waits: "
            "about half is normal, most means predictions run long. Bound: above 0 means the bound failed "
            "(alert LLMAdmissionWaitBoundViolated).",
            "percentunit",
            query("A", "sum by (engine, kind) "
                       f"(rate(admission_wait_prediction_error_seconds_bucket{{{LE_ZERO},{GW}}}[{RATE}])) / "
                       f"sum by (engine, kind) (rate(admission_wait_prediction_error_seconds_count{{{GW}}}[{RATE}]))",
                  "{{engine}} ({{kind}})"),
            width=8,
        ))
        .with_row(db.Row("Engine: the gateway's view next to vLLM's own"))
        .with_panel(panel(
            "Running requests: gateway view vs vLLM",
            "vllm_requests_running is what the gateway read at its last good poll; "
            "vllm:num_requests_running is vLLM's own gauge (summed over data-parallel ranks). They "
            "should overlap, a poll interval apart.",
            "short",
            query("A", f"sum by (engine) (vllm_requests_running{{{GW}}})", "gateway view: {{engine}}"),
            query("B", f"sum by (model_name) ({vllm('num_requests_running')})", "vLLM: {{model_name}}"),
            width=8,
        ))
        .with_panel(panel(
            "Waiting requests: gateway view vs vLLM",
            "vllm_requests_waiting (gateway, last good poll) vs vllm:num_requests_waiting (vLLM).",
            "short",
            query("A", f"sum by (engine) (vllm_requests_waiting{{{GW}}})", "gateway view: {{engine}}"),
            query("B", f"sum by (model_name) ({vllm('num_requests_waiting')})", "vLLM: {{model_name}}"),
            width=8,
        ))
        .with_panel(panel(
            "KV cache usage: gateway view vs vLLM",
            "vllm_kv_usage_perc (gateway, last good poll) vs vllm:kv_cache_usage_perc (vLLM, the "
            "fullest rank). Requests park at the configured threshold (0.90 by default).",
            "percentunit",
            query("A", f"max by (engine) (vllm_kv_usage_perc{{{GW}}})", "gateway view: {{engine}}"),
            query("B", f"max by (model_name) ({vllm('kv_cache_usage_perc')})", "vLLM: {{model_name}}"),
            width=8,
        ))
        .with_panel(panel(
            "Engine state stale / observer degraded",
            "1 = stale: polls failed ENGINE_STALE_AFTER_POLLS times in a row and admission fails open. "
            "1 = degraded: the engine's /metrics does not parse into the three gauges admission needs.",
            "short",
            query("A", f"max by (engine) (engine_state_is_stale{{{GW}}})", "stale (failing open): {{engine}}"),
            query("B", f"max by (engine) (observer_degraded{{{GW}}})", "observer degraded: {{engine}}"),
        ))
        .with_panel(panel(
            "Engine poll failures per second",
            "Failed polls of the engine's /metrics by reason (unreachable, timeout, http_status, "
            "unparsable), and transitions into the stale (fail-open) state.",
            "reqps",
            query("A", f"sum by (engine, reason) (rate(engine_poll_failures_total{{{GW}}}[{RATE}]))",
                  "{{reason}}: {{engine}}"),
            query("B", f"sum by (engine) (rate(engine_state_stale_total{{{GW}}}[{RATE}]))",
                  "went stale: {{engine}}"),
        ))
        .with_panel(panel(
            "Running over max in-flight (limit drift)",
            "Running requests above the configured max in-flight at the last poll, and transitions into that "
            "state. vLLM never runs more than its --max-num-seqs, so anything above 0 means the engine's "
            "limit is larger than max_inflight (no gauge shows it): the gate parks requests the engine could "
            "run. Alert LLMAdmissionEngineLimitDrift.",
            "short",
            query("A", f"max by (engine) (admission_engine_running_over_limit{{{GW}}})", "over the limit: {{engine}}"),
            query("B", f"sum by (engine) (increase(admission_engine_limit_drift_total{{{GW}}}[{RATE}]))",
                  "went over: {{engine}}"),
        ))
        .with_row(db.Row("vLLM"))
        .with_panel(panel(
            "vLLM preemptions",
            "Requests vLLM preempted (KV cache exhausted; a preempted prefill is recomputed from "
            "zero). Admission exists to keep this at zero; alert VLLMPreemptions fires on any.",
            "short",
            query("A", f"sum by (model_name) (increase({vllm('num_preemptions_total')}[{RATE}]))",
                  "preempted: {{model_name}}"),
            bars=True,
        ))
        .with_panel(panel(
            "vLLM time to first token p50 / p95",
            "From vLLM's own histogram; includes vLLM's internal queueing, not the time parked "
            "at the gateway.",
            "s",
            query("A", "histogram_quantile(0.5, sum by (le, model_name) "
                       f"(rate({vllm('time_to_first_token_seconds_bucket')}[{RATE}])))", "p50: {{model_name}}"),
            query("B", "histogram_quantile(0.95, sum by (le, model_name) "
                       f"(rate({vllm('time_to_first_token_seconds_bucket')}[{RATE}])))", "p95: {{model_name}}"),
        ))
        # cAdvisor's series (the kubelet's): only in a cluster; the local stack has none.
        .with_row(db.Row("Gateway containers"))
        .with_panel(panel(
            "CPU throttling: the service and Envoy",
            "Share of CFS periods in which the container hit its CPU limit (cAdvisor, containers envoy and "
            "admission). Throttling adds latency to every decision and every proxied byte while the CPU graph "
            "looks flat at the limit; alert LLMAdmissionCPUThrottled fires above 25% for 15 minutes. Empty "
            "without the kubelet's cAdvisor metrics.",
            "percentunit",
            query("A", 'sum by (pod, container) (rate(container_cpu_cfs_throttled_periods_total'
                       '{container=~"envoy|admission",'
                       f'namespace=~"$namespace"}}[{RATE}]))\n/\n'
                       'sum by (pod, container) (rate(container_cpu_cfs_periods_total{container=~"envoy|admission",'
                       f'namespace=~"$namespace"}}[{RATE}]))',
                  "{{pod}}: {{container}}"),
            width=24,
        ))
        # Only with ADMISSION_LEDGER=redis (chart: ledger.backend) do these series exist; with a
        # local ledger the row stays empty.
        .with_row(db.Row("Shared ledger (Redis)"))
        .with_panel(panel(
            "Ledger degraded: replicas deciding alone",
            "Replicas whose Redis calls fail or take longer than ADMISSION_LEDGER_TIMEOUT_MS, per engine: "
            "each decides alone from its last view (the soft budget of a local ledger) until Redis "
            "answers. Alert LLMAdmissionLedgerDegraded fires after 1 minute. Also the transitions into "
            "degraded mode, all engines together. Empty unless the ledger is redis.",
            "short",
            query("A", f"sum by (engine) (admission_ledger_degraded{{{GW}}})", "deciding alone: {{engine}}"),
            query("B", f"sum(increase(admission_ledger_degraded_transitions_total[{RATE}]))", "went degraded"),
        ))
        .with_panel(panel(
            "Ledger round trip p50 / p99, by operation",
            "One Redis call: commit (write a new gate state if nobody else did), check (a decision that "
            "changed nothing still checks the version), read. A decision takes one, two under "
            "contention; ADMISSION_LEDGER_TIMEOUT_MS bounds each.",
            "s",
            query("A", "histogram_quantile(0.5, sum by (le, op) "
                       f"(rate(admission_ledger_round_trip_seconds_bucket[{RATE}])))", "p50: {{op}}"),
            query("B", "histogram_quantile(0.99, sum by (le, op) "
                       f"(rate(admission_ledger_round_trip_seconds_bucket[{RATE}])))", "p99: {{op}}"),
        ))
        .with_panel(panel(
            "Ledger conflicts per second",
            "Commits that met another replica's newer state and ran the event again on it (one more "
            "round trip each): contention between replicas on one engine.",
            "reqps",
            query("A", f"sum by (engine) (rate(admission_ledger_conflicts_total{{{GW}}}[{RATE}]))",
                  "conflicts: {{engine}}"),
        ))
        .with_panel(panel(
            "Ledger lease expiries",
            "Requests dropped from the shared state because their replica stopped renewing its lease: "
            "it died (SIGKILL, OOM, node lost) or lost Redis. Their capacity returned to the other "
            "replicas. Alert LLMAdmissionLedgerLeasesExpiring fires on any.",
            "short",
            query("A", f"sum by (engine) (increase(admission_ledger_lease_expiries_total{{{GW}}}[{RATE}]))",
                  "expired: {{engine}}"),
            bars=True,
        ))
    )
    return json.loads(JSONEncoder(sort_keys=True).encode(dash.build()))


def render_json() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def outputs() -> dict[Path, str]:
    """Every generated file and the text it must hold."""
    dashboard = render_json()
    return {
        DASHBOARD: dashboard,
        CHART_FILES / "llm-admission.json": dashboard,
        CHART_FILES / "llm-admission.rules.yml": RULES.read_text(),
    }


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    stale = [path for path, text in outputs().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {_shown(path)} (run: .venv/bin/python -m dashboards.generate)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {_shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
