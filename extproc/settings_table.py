"""Every setting the service reads, in one table: its environment variable, documented default,
one-line help and where the Helm chart sets it.

`extproc --help` is printed from this table. Tests hold the other places to it:
`tests/unit/test_settings_table.py` checks that `extproc/config.py` reads exactly these variables,
that each literal default is what `load_settings` does when the variable is unset, and that the
README's configuration table lists each one; `tests/helm/test_chart_settings.py` checks that the
chart's admission container sets each one the chart is said to set. A new setting is one row
here, its parsing in `config.py`, a README row and (if the chart passes it) a values key; the
tests name whichever is missing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    env: str
    help: str
    default: str | None = None  # as documented; None: unset
    literal: bool = True  # the default is a value load_settings accepts (False: a description)
    chart: str | None = None  # the chart's values key that sets it, or None with `chart_note`
    chart_note: str = ""


_ENGINES_FILE = "the chart writes the engines file (EXTPROC_CONFIG) instead"

SETTINGS: tuple[Setting, ...] = (
    Setting("ENGINE_URL", "engine base URL when no config file is used", "http://127.0.0.1:8000",
            chart_note=_ENGINES_FILE),
    Setting("ENGINE_METRICS_URL", "its metrics URL", "$ENGINE_URL/metrics", literal=False, chart_note=_ENGINES_FILE),
    Setting("ADMISSION_OBSERVE_MODELS", "comma-separated models to gate on that engine; unset = gate nothing",
            chart_note=_ENGINES_FILE),
    Setting("ADMISSION_ENGINE_DIALECT", "engine metrics names: vllm, sglang, trtllm or auto (detected)", "auto",
            chart_note="the chart writes each engine's `dialect` into the engines file instead"),
    Setting("ADMISSION_MODELS_REFRESH_SECONDS",
            "re-read each engine's /v1/models; its names are gated too; 0 = off", "30",
            chart="admission.modelsRefreshSeconds"),
    Setting("EXTPROC_CONFIG", "YAML file mapping engines to models, with per-engine overrides",
            chart="engines"),
    Setting("ADMISSION_MAX_INFLIGHT", "park while running + waiting >= this", "$VLLM_MAX_NUM_SEQS or 4",
            literal=False, chart="admission.maxInflight"),
    Setting("VLLM_MAX_NUM_SEQS", "the engine's --max-num-seqs (default for the line above)", "4",
            chart_note="the chart sets ADMISSION_MAX_INFLIGHT itself"),
    Setting("ADMISSION_KV_THRESHOLD", "park while KV cache usage (fraction) >= this", "0.90",
            chart="admission.kvThreshold"),
    Setting("VLLM_MAX_QUEUE_DEPTH", "parked requests per engine before rejecting at once (503)", "8",
            chart="admission.maxQueueDepth"),
    Setting("ADMISSION_MAX_PARK_SECONDS", "longest park before 503 + Retry-After", "300",
            chart="admission.maxParkSeconds"),
    Setting("ADMISSION_RETRY_AFTER_SECONDS", "Retry-After on 503 answers", "5", chart="admission.retryAfterSeconds"),
    Setting("MAX_BODY_BYTES", "request body cap; larger bodies get 413", "1048576", chart="admission.maxBodyBytes"),
    Setting("ENGINE_POLL_INTERVAL_SECONDS", "engine /metrics poll interval", "2",
            chart="admission.pollIntervalSeconds"),
    Setting("ENGINE_STALE_AFTER_POLLS", "failed polls before failing open", "3", chart="admission.staleAfterPolls"),
    Setting("ADMISSION_LOCAL_ACCOUNTING", "count own admissions/completions between polls", "true",
            chart="admission.localAccounting"),
    Setting("ADMISSION_SCRAPE_GRACE_SECONDS", "how long after admission a scrape may still miss a request", "0.5",
            chart="admission.scrapeGraceSeconds"),
    Setting("ADMISSION_KV_BUDGET", "admit only what fits the engine's free KV tokens", "true",
            chart="admission.kvBudget"),
    Setting("ADMISSION_KV_CAPACITY_TOKENS", "KV capacity when the engine's metrics show none",
            chart="admission.kvCapacityTokens"),
    Setting("ADMISSION_ESTIMATE",
            "counted (tokenizer, engine /tokenize, learned bytes rule) or bytes (before issue 11)", "counted",
            chart="admission.estimate.mode"),
    Setting("ADMISSION_TOKENIZER",
            "served model's tokenizer.json path, or qwen3, qwen2.5, llama3: exact prompt counts",
            chart="admission.estimate.tokenizer"),
    Setting("ADMISSION_TOKENIZE_ABOVE_BYTES",
            "prompts this large are counted by the engine's POST /tokenize; 0 = never", "8192",
            chart="admission.estimate.tokenizeAboveBytes"),
    Setting("ADMISSION_TOKENIZE_TIMEOUT_MS", "longest wait for the engine's count before the bytes rule", "500",
            chart="admission.estimate.tokenizeTimeoutMs"),
    Setting("ADMISSION_BYTES_PER_TOKEN", "bytes rule: prompt bytes per token until one is learned", "2.5",
            chart="admission.bytesPerToken"),
    Setting("ADMISSION_LEARN_BYTES_PER_TOKEN", "learn bytes per token from the engine's prompt-token counter", "true",
            chart="admission.estimate.learnBytesPerToken"),
    Setting("ADMISSION_BYTES_PER_TOKEN_MIN", "lower bound of the learned bytes per token", "1.0",
            chart="admission.estimate.bytesPerTokenMin"),
    Setting("ADMISSION_BYTES_PER_TOKEN_MAX", "upper bound of the learned bytes per token", "4.0",
            chart="admission.estimate.bytesPerTokenMax"),
    Setting("ADMISSION_TEMPLATE_TOKENS_FIXED", "chat template tokens added once per request", "32",
            chart="admission.estimate.templateTokens.fixed"),
    Setting("ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE", "chat template tokens added per message", "5",
            chart="admission.estimate.templateTokens.perMessage"),
    Setting("ADMISSION_TEMPLATE_TOKENS_TOOLS", "chat template tokens added when tools are given", "100",
            chart="admission.estimate.templateTokens.tools"),
    Setting("ADMISSION_ESTIMATE_SAFETY_FACTOR", "multiplier on the prompt token estimate", "1.0",
            chart="admission.estimateSafetyFactor"),
    Setting("ADMISSION_DEFAULT_MAX_TOKENS", "generation allowance when a request sets no max_tokens", "1024",
            chart="admission.defaultMaxTokens"),
    Setting("ADMISSION_BACKFILL", "let small requests pass a KV-blocked head when it cannot delay it", "true",
            chart="admission.backfill"),
    Setting("ADMISSION_WAIT_ESTIMATES",
            "Retry-After from the completion rate; reject at once if the wait exceeds the park cap", "true",
            chart="admission.waitEstimates"),
    Setting("ADMISSION_ENGINE_QUEUE_SLOTS",
            "with the budget: requests that may wait inside the engine beyond max in-flight", "1",
            chart="admission.engineQueueSlots"),
    Setting("ADMISSION_GATED_PATHS", "POST paths subject to admission", "every vLLM generation/pooling endpoint",
            literal=False, chart="admission.gatedPaths"),
    Setting("ADMISSION_GENERATION_RESERVATION",
            "KV reserved for generation: max_tokens (the limit) or learned (factor x the engine's mean)",
            "max_tokens", chart="admission.generationReservation"),
    Setting("ADMISSION_GENERATION_FACTOR",
            "with learned: reserve this x the engine's recent mean generation, at most the limit", "1.5",
            chart="admission.generationFactor"),
    Setting("ADMISSION_LEDGER", "where the gates' state lives: local (this process) or redis (shared by replicas)",
            "local", chart="ledger.backend"),
    Setting("ADMISSION_REDIS_URL",
            "redis://[:password@]host:port/db, rediss:// (TLS) or unix://; needed by redis", chart="ledger.redis.url"),
    Setting("ADMISSION_LEDGER_LEASE_SECONDS", "a dead replica's reservations and parked requests expire after this",
            "5", chart="ledger.leaseSeconds"),
    Setting("ADMISSION_LEDGER_TIMEOUT_MS", "longest wait for one Redis call before deciding alone (degraded)", "50",
            chart="ledger.timeoutMs"),
    Setting("ADMISSION_LEDGER_KEY_PREFIX", "Redis key prefix, for several deployments on one Redis",
            "llm-admission", chart="ledger.keyPrefix"),
    Setting("ADMISSION_REPLICA_ID", "this replica's name in the shared ledger and its logs (e.g. the pod name)",
            "host-pid-random", literal=False, chart="ledger (the pod's name)"),
    Setting("EXTPROC_LISTEN", "gRPC ext_proc listen address", "127.0.0.1:9002", chart="admission.grpcPort"),
    Setting("EXTPROC_ADMIN_LISTEN", "/metrics /healthz /readyz /debug listen address", "127.0.0.1:9003",
            chart="admission.debugPort"),
    Setting("EXTPROC_PROBE_LISTEN", "optional second listener: /metrics /healthz /readyz only",
            chart="admission.adminPort"),
    Setting("EXTPROC_MAX_STREAMS", "concurrent ext_proc streams (parked + in flight)", "10000",
            chart="admission.maxStreams"),
    Setting("EXTPROC_LOG_LEVEL", "DEBUG, INFO, WARNING or ERROR", "INFO", chart="admission.logLevel"),
    Setting("EXTPROC_LOG_FORMAT", "json or text", "json", chart="admission.logFormat"),
)

BY_ENV = {s.env: s for s in SETTINGS}


def environment_help() -> str:
    """The `--help` epilog: one line per setting, its default in brackets."""
    width = 31
    lines = ["configuration (environment variables, read once at startup; a bad value exits with status 2):"]
    for s in SETTINGS:
        name = s.env if len(s.env) < width else s.env + " "
        lines.append(f"  {name:<{width}}{s.help}  [{s.default if s.default is not None else 'unset'}]")
    return "\n".join(lines) + "\n"
