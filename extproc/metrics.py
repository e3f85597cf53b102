"""The service's own Prometheus series, all on an injected registry (no module-level globals).

Names follow the reference design (no prefix): `admission_parked_total`,
`admission_rejected_total{reason}`, `engine_state_stale_total`, `vllm_requests_running`,
`vllm_kv_usage_perc`, `observer_degraded`; the rest are what an operator needs to see every
decision. Engine-level series carry `engine`; request-level series carry `engine` and `model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .outcomes import REJECTED_REASONS, Outcome

if TYPE_CHECKING:
    from .config import Settings

_PARK_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 300)
#: How an admitted request got through (`admission_admitted_total{via}`).
ADMITTED_VIA: tuple[Outcome, ...] = (Outcome.ADMITTED, Outcome.ADMITTED_AFTER_PARK, Outcome.ADMITTED_FAIL_OPEN)
#: How a park can end (`admission_park_duration_seconds{outcome}`).
PARK_ENDINGS: tuple[Outcome, ...] = (Outcome.ADMITTED_AFTER_PARK, Outcome.ADMITTED_FAIL_OPEN, Outcome.PARK_TIMEOUT,
                                     Outcome.EXPECTED_WAIT_TOO_LONG, Outcome.CLIENT_GONE, Outcome.SHUTTING_DOWN)
#: Why a poll of the engine's /metrics failed (`engine_poll_failures_total{reason}`, extproc/observer.py).
POLL_FAILURE_REASONS = ("unreachable", "timeout", "http_status", "unparsable")
#: Why a request was not subject to admission (`admission_passthrough_total{reason}`, extproc/servicer.py).
PASSTHROUGH_REASONS = ("path_not_gated", "no_models_configured")
#: Where a prompt-token estimate came from (`admission_estimate_source_total{source}`, extproc/tokencount.py).
ESTIMATE_SOURCES = ("tokenizer", "engine", "fallback", "learned", "prior", "bytes")
#: actual - predicted wait of parked-then-admitted requests. No negative bounds (prometheus_client then
#: drops `_sum`): a bound that did not hold lands in le="0" and in admission_wait_bound_violations_total.
#: The rules that can admit a request under each ADMISSION_POLICY (`admission_policy_admitted_total{policy}`).
POLICY_RULES = {"strict": ("strict",), "projected": ("projected", "price", "cold", "strict")}
_ERROR_BUCKETS = (0, 1, 5, 10, 30, 60, 120, 300, 600)
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        r = registry
        # Decisions.
        self.admitted = Counter(
            "admission_admitted", "Requests sent to the engine, by how they were admitted.",
            ["engine", "model", "via"], registry=r)
        self.parked = Counter(
            "admission_parked", "Requests that had to wait in the park.", ["engine", "model"], registry=r)
        self.rejected = Counter(
            "admission_rejected", "Requests answered by the gateway and never sent to the engine, by reason.",
            ["engine", "model", "reason"], registry=r)
        self.passthrough = Counter(
            "admission_passthrough", "Requests not subject to admission (path not gated, or no models configured).",
            ["reason"], registry=r)
        self.park_duration = Histogram(
            "admission_park_duration_seconds", "Time spent parked, by how the park ended.",
            ["engine", "outcome"], buckets=_PARK_BUCKETS, registry=r)
        self.predicted_wait = Histogram(
            "admission_predicted_wait_seconds",
            "The gate's prediction of a request's wait from the work ahead (KV budget), per park or early rejection "
            "that had one: kind=bound, a lower bound (the least prompt work that frees room, over the engine's peak "
            "throughput); kind=expected, the expected wait (ADMISSION_WAIT_PREDICTION).",
            ["engine", "kind"], buckets=_PARK_BUCKETS, registry=r)
        self.wait_prediction_error = Histogram(
            "admission_wait_prediction_error_seconds",
            "Actual wait minus the wait predicted when it parked, for parked requests then admitted "
            "(kind=bound: >= 0 while the bound holds; kind=expected: negative values land in le=\"0\", _sum keeps "
            "the sign).",
            ["engine", "kind"], buckets=_ERROR_BUCKETS, registry=r)
        self.throughput_bound = Gauge(
            "admission_engine_throughput_bound_tokens_per_second",
            "The throughput the wait bound assumes the engine never exceeds: its peak measured KV growth while busy, "
            "times the margin (NaN before the first measurement; used only with the KV budget).",
            ["engine"], registry=r)
        self.wait_bound_answers = Counter(
            "admission_wait_bound_answers",
            "Requests answered expected_wait_too_long because the wait predicted from the work ahead (kind=bound: "
            "the lower bound proved it; kind=expected: the expected wait) runs past the park cap (on arrival, or "
            "while parked); the rest of that reason came from the completion-rate estimate.",
            ["engine", "kind"], registry=r)
        self.wait_bound_violations = Counter(
            "admission_wait_bound_violations",
            "Parked requests admitted sooner than their predicted lower bound (the bound was wrong: the engine ran "
            "faster than its measured peak throughput times the margin).",
            ["engine"], registry=r)
        self.decision_latency = Histogram(
            "admission_decision_latency_seconds",
            "Service time to answer Envoy's body message, excluding time parked.",
            ["engine", "outcome"], buckets=_DECISION_BUCKETS, registry=r)
        self.park_deadline_local = Counter(
            "admission_park_deadline_local",
            "Parked requests this replica answered park_timeout at their cap by its own deadline, because the "
            "ledger had not decided them in time (its state lost them, or it did not answer); 0 while the ledger "
            "is whole.",
            ["engine"], registry=r)
        self.backfilled = Counter(
            "admission_backfilled", "Requests admitted ahead of a queue head that was waiting for KV (backfill).",
            ["engine", "model"], registry=r)
        self.estimated_prompt_tokens = Counter(
            "admission_estimated_prompt_tokens",
            "Estimated prompt tokens of admitted requests (n sequences count n prompts, as the engine does); "
            "compare with the engine's prompt-token counter (admission_engine_prompt_tokens_total).",
            ["engine", "model"], registry=r)
        self.estimate_source = Counter(
            "admission_estimate_source",
            "Gated requests by where their prompt-token estimate came from: tokenizer (ADMISSION_TOKENIZER), "
            "engine (its POST /tokenize), fallback (the engine did not answer in time: bytes rule), learned or "
            "prior (bytes rule at the learned or the configured bytes-per-token), bytes (ADMISSION_ESTIMATE=bytes).",
            ["engine", "model", "source"], registry=r)
        self.engine_prompt_tokens = Counter(
            "admission_engine_prompt_tokens",
            "The engine's prompt-token counter (its dialect's, e.g. vLLM's prompt_tokens_total) as this replica "
            "saw it grow between its polls: compare with "
            "admission_estimated_prompt_tokens_total (every replica sees the same engine: take max by engine).",
            ["engine"], registry=r)
        self.estimate_ratio = Gauge(
            "admission_estimate_ratio",
            "Estimated prompt tokens of what this replica admitted over what the engine counted "
            "(its prompt-token counter), both decayed by half every 1M tokens; NaN until 50k counted. Below 1: "
            "the budget under-reserves.",
            ["engine", "model"], registry=r)
        self.bytes_per_token = Gauge(
            "admission_bytes_per_token",
            "Bytes per prompt token the bytes rule uses now: learned from the engine's counter, or the prior.",
            ["engine"], registry=r)
        self.tokenize_duration = Histogram(
            "admission_tokenize_duration_seconds", "Time to have the engine count a prompt (POST /tokenize).",
            ["engine"], buckets=_DECISION_BUCKETS + (0.5, 1.0, 2.5), registry=r)
        self.kv_reserved = Gauge(
            "admission_kv_reserved_tokens", "KV tokens reserved by requests this replica admitted, stream still open.",
            ["engine"], registry=r)
        self.kv_available = Gauge(
            "admission_kv_available_tokens",
            "KV tokens the budget would still admit (NaN when the budget does not apply).",
            ["engine"], registry=r)
        self.policy_admitted = Counter(
            "admission_policy_admitted",
            "Requests admitted by the KV budget, by the rule that decided: strict (ADMISSION_POLICY=strict), or with "
            "projected: projected (the projected peak fits), price (its preemption would cost more than "
            "ADMISSION_PREEMPTION_MAX_COST_SECONDS: the strict budget), cold (no prefill rate yet: the strict "
            "budget) or strict (no KV capacity known: slots only).",
            ["engine", "policy"], registry=r)
        self.projected_peak = Gauge(
            "admission_projected_peak_tokens",
            "With ADMISSION_POLICY=projected: the peak KV tokens this replica's open requests are projected to hold, "
            "plus the KV the last scrape shows that they cannot explain; compare with vllm_kv_capacity_tokens "
            "(NaN otherwise).", ["engine"], registry=r)
        self.engine_preemptions = Gauge(
            "admission_engine_preemptions",
            "Preemptions the engine counted between its last two scrapes (its preemption counter).",
            ["engine"], registry=r)
        self.engine_done = Gauge(
            "admission_engine_done_requests",
            "Engine requests of admitted requests whose HTTP stream is still open but which the last scrape shows "
            "the engine has finished (clients that read slowly or never): they hold no slot or KV at the gate.",
            ["engine"], registry=r)
        self.queue_depth = Gauge("admission_queue_depth", "Requests parked now.", ["engine"], registry=r)
        self.inflight = Gauge(
            "admission_inflight", "Requests this replica admitted whose HTTP stream is still open.",
            ["engine"], registry=r)
        self.effective_load = Gauge(
            "admission_effective_load",
            "running + waiting as the gate sees it: last scrape corrected by local admissions and completions.",
            ["engine"], registry=r)
        # Engine observation.
        self.running = Gauge("vllm_requests_running", "The engine's running requests at the last good poll.",
                             ["engine"], registry=r)
        self.waiting = Gauge("vllm_requests_waiting", "The engine's waiting requests at the last good poll.",
                             ["engine"], registry=r)
        self.kv_usage = Gauge("vllm_kv_usage_perc",
                              "The engine's KV cache usage (fraction 0..1) at the last good poll.",
                              ["engine"], registry=r)
        self.kv_capacity = Gauge(
            "vllm_kv_capacity_tokens", "KV cache capacity in tokens from the engine's metrics (0 = unknown).",
            ["engine"], registry=r)
        self.engine_dialect = Gauge(
            "admission_engine_dialect",
            "1 for the metrics dialect (vllm, sglang, trtllm) the engine is read with: configured, or detected "
            "from its first exposition (no series until then).", ["engine", "dialect"], registry=r)
        self.degraded = Gauge(
            "observer_degraded", "1 while the engine's metrics cannot be parsed into the three required gauges.",
            ["engine"], registry=r)
        self.stale = Gauge("engine_state_is_stale", "1 while the engine state is stale and admission fails open.",
                           ["engine"], registry=r)
        self.stale_total = Counter(
            "engine_state_stale", "Transitions into stale engine state (fail-open).", ["engine"], registry=r)
        # The configured max in-flight must equal the engine's --max-num-seqs, which no engine gauge
        # shows; an engine running more requests than the limit proves a larger --max-num-seqs.
        self.running_over_limit = Gauge(
            "admission_engine_running_over_limit",
            "Running requests above the configured max in-flight at the last good poll (0 = within it); above 0 the "
            "engine's --max-num-seqs is larger than max_inflight.", ["engine"], registry=r)
        self.limit_drift = Counter(
            "admission_engine_limit_drift",
            "Transitions into limit drift: the engine reported more running requests than the configured "
            "max in-flight.",
            ["engine"], registry=r)
        self.poll_failures = Counter(
            "engine_poll_failures", "Failed polls of the engine's /metrics, by reason.", ["engine", "reason"],
            registry=r)
        self.poll_duration = Histogram(
            "engine_poll_duration_seconds", "Time to fetch and parse the engine's /metrics.", ["engine"], registry=r)
        self.internal_errors = Counter(
            "extproc_internal_errors", "Requests admitted because the service hit an unexpected error.", registry=r)

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept after the first call: what the per-request path uses.

        `labels()` takes the metric's lock and checks and converts every value on each call (a
        third of a counter increment's cost); here a known child is one dict lookup. The label
        sets are bounded (engines, served models, outcomes), and children are never removed.
        """
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def initialise(self, settings: Settings) -> None:
        """Create every series whose labels the configuration already fixes, at 0.

        A labelled series appears only once it is first touched, so a fresh dashboard would show
        "No data" and `rate()`, `increase()` and alerts on it would have nothing to work on until
        the first event. Every engine/model pair the configuration names gets its decision
        counters (each way of being admitted, parks, each rejection reason, backfills), every
        gated engine its stale transitions, poll failures by reason and park durations by ending.
        Models an engine only serves (learnt from /v1/models at runtime) appear with their first
        request.
        """
        for reason in PASSTHROUGH_REASONS:
            self.passthrough.labels(reason)
        for engine in settings.engines:
            if not engine.models:  # not gated, never polled
                continue
            name = engine.name
            self.stale_total.labels(name)
            self.limit_drift.labels(name)
            self.running_over_limit.labels(name).set(0)
            for reason in POLL_FAILURE_REASONS:
                self.poll_failures.labels(name, reason)
            for outcome in PARK_ENDINGS:
                self.park_duration.labels(name, outcome.value)
            self.predicted_wait.labels(name, settings.wait_prediction)
            self.wait_prediction_error.labels(name, settings.wait_prediction)
            self.wait_bound_violations.labels(name)
            self.park_deadline_local.labels(name)
            self.wait_bound_answers.labels(name, settings.wait_prediction)
            for policy in POLICY_RULES[settings.policy]:
                self.policy_admitted.labels(name, policy)
            for model in engine.models:
                for via in ADMITTED_VIA:
                    self.admitted.labels(name, model, via.value)
                self.parked.labels(name, model)
                for reason in REJECTED_REASONS:
                    self.rejected.labels(name, model, reason.value)
                self.backfilled.labels(name, model)
                self.estimated_prompt_tokens.labels(name, model)
                for source in ESTIMATE_SOURCES:
                    self.estimate_source.labels(name, model, source)
                self.estimate_ratio.labels(name, model).set(float("nan"))
            self.engine_prompt_tokens.labels(name)
