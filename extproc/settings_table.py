"""Every setting the service reads, in one table: its environment variable, what it is (kind and
allowed values), whether an engines-file entry may set it per engine, its documented default,
one-line help and where the Helm chart sets it.

`extproc/config.py` parses every plain typed value (int, float, bool, choice) through its row, so a
bound, a choice list or a default is written once, here; values with structure (URLs, listen
addresses, lists, files, names) are parsed by hand there and their rows say only what they are.
The engines file's keys are the per-engine rows' `engine_key`s. `extproc --help` is printed from
this table. Tests hold the other places to it: `tests/unit/test_settings_table.py` checks that
config.py reads exactly these variables, that each literal default is what `load_settings` does
when the variable is unset, that every bound and choice is enforced (in the environment and in an
engines file), and that the docs' configuration reference (docs/configuration/settings.md, rendered
from this table by `make generate`) lists each one with its allowed values;
`tests/helm/test_chart_settings.py` checks that the chart's admission container sets each one the
chart is said to set and that values.schema.json allows what the row allows. A new setting is one
row here, one call in `config.py` (plus its `Settings` field), `make generate` for the docs page and,
if the chart passes it, a values key with its schema; the tests name whichever is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .contract import MAX_PARK_SECONDS
from .dialects import CHOICES as DIALECT_CHOICES

#: int, float, bool and choice rows are parsed from the row (config.py's `_int`, `_float`, `_bool`,
#: `_choice`); the others have structure config.py checks by hand.
Kind = Literal["int", "float", "bool", "choice", "url", "listen", "list", "file", "text"]


@dataclass(frozen=True)
class Bounds:
    """The numbers a setting allows: each end closed (the bound itself allowed) unless marked open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def admits(self, value: float) -> bool:
        """Whether `value` lies within these bounds."""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or not (value >= self.high if self.high_open else value > self.high)

    def describe(self) -> str:
        """`> 0.0 and <= 1.0`: the bounds as the error messages, help and README write them."""
        ends = []
        if self.low is not None:
            ends.append(f"{'>' if self.low_open else '>='} {self.low}")
        if self.high is not None:
            ends.append(f"{'<' if self.high_open else '<='} {self.high}")
        return " and ".join(ends)


@dataclass(frozen=True)
class Setting:
    env: str
    help: str
    default: str | None = None  # as documented; None: unset
    literal: bool = True  # the default is a value load_settings accepts (False: a description)
    chart: str | None = None  # the chart's values key that sets it, or None with `chart_note`
    chart_note: str = ""
    kind: Kind = "text"
    bounds: Bounds | None = None  # int and float rows
    choices: tuple[str, ...] = ()  # choice rows, as the service spells them (matched ignoring case)
    engine_key: str | None = None  # the engines-file key that sets it per engine; None: global only
    chart_bounds: Bounds | None = None  # where the chart's schema allows less than the service (why beside it)

    @property
    def scope(self) -> Literal["per-engine", "global"]:
        """per-engine: an engines-file entry may set it too (`engine_key`); global: the environment only."""
        return "per-engine" if self.engine_key is not None else "global"

    @property
    def allowed(self) -> str | None:
        """What a typed setting accepts, as its startup error says it (`must be ...`); None: structural."""
        if self.kind == "int":
            return f"an integer {self.bounds.describe()}".rstrip() if self.bounds else "an integer"
        if self.kind == "float":
            return f"a number {self.bounds.describe()}".rstrip() if self.bounds else "a number"
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        return None

    def __post_init__(self) -> None:
        if (self.bounds is not None) != (self.kind in ("int", "float")):
            raise ValueError(f"{self.env}: int and float rows, and only they, have bounds")
        if bool(self.choices) != (self.kind == "choice"):
            raise ValueError(f"{self.env}: choice rows, and only they, have choices")


_ENGINES_FILE = "the chart writes the engines file (EXTPROC_CONFIG) instead"
_COUNT = Bounds(0)  # a count, 0 allowed
_POSITIVE = Bounds(1)  # a count of at least one

SETTINGS: tuple[Setting, ...] = (
    Setting("ENGINE_URL", "engine base URL when no config file is used", "http://127.0.0.1:8000",
            chart_note=_ENGINES_FILE, kind="url", engine_key="url"),
    Setting("ENGINE_METRICS_URL", "its metrics URL", "$ENGINE_URL/metrics", literal=False, chart_note=_ENGINES_FILE,
            kind="url", engine_key="metrics_url"),
    Setting("ADMISSION_OBSERVE_MODELS", "comma-separated models to gate on that engine; unset = gate nothing",
            chart_note=_ENGINES_FILE, kind="list", engine_key="models"),
    Setting("ADMISSION_ENGINE_DIALECT", "engine metrics names (auto: detected from the first exposition)", "auto",
            chart_note="the chart writes each engine's `dialect` into the engines file instead",
            kind="choice", choices=DIALECT_CHOICES, engine_key="dialect"),
    Setting("ADMISSION_MODELS_REFRESH_SECONDS",
            "re-read each engine's /v1/models; its names are gated too; 0 = off", "30",
            chart="admission.modelsRefreshSeconds", kind="float", bounds=Bounds(0.0, 3600.0)),
    Setting("EXTPROC_CONFIG", "YAML file mapping engines to models, with per-engine overrides",
            chart="engines", kind="file"),
    Setting("ADMISSION_MAX_INFLIGHT", "park while running + waiting >= this", "$VLLM_MAX_NUM_SEQS or 4",
            literal=False, chart="admission.maxInflight", kind="int", bounds=_POSITIVE, engine_key="max_inflight"),
    Setting("VLLM_MAX_NUM_SEQS", "the engine's --max-num-seqs (default for the line above)", "4",
            chart_note="the chart sets ADMISSION_MAX_INFLIGHT itself", kind="int", bounds=_POSITIVE),
    Setting("ADMISSION_KV_THRESHOLD", "park while KV cache usage (fraction) >= this", "0.90",
            chart="admission.kvThreshold", kind="float", bounds=Bounds(0.0, 1.0, low_open=True),
            engine_key="kv_threshold"),
    Setting("VLLM_MAX_QUEUE_DEPTH", "parked requests per engine before rejecting at once (503)", "8",
            chart="admission.maxQueueDepth", kind="int", bounds=_COUNT, engine_key="max_queue_depth"),
    # At most what Envoy's ext_proc message timeout leaves after its margins (extproc/contract.py).
    Setting("ADMISSION_MAX_PARK_SECONDS", "longest park before 503 + Retry-After", "300",
            chart="admission.maxParkSeconds", kind="float", bounds=Bounds(0.0, MAX_PARK_SECONDS, low_open=True),
            engine_key="max_park_seconds"),
    Setting("ADMISSION_RETRY_AFTER_SECONDS", "Retry-After on 503 answers", "5", chart="admission.retryAfterSeconds",
            kind="int", bounds=_POSITIVE),
    Setting("MAX_BODY_BYTES", "request body cap; larger bodies get 413", "1048576", chart="admission.maxBodyBytes",
            kind="int", bounds=Bounds(1024)),
    Setting("ENGINE_POLL_INTERVAL_SECONDS", "engine /metrics poll interval", "2",
            chart="admission.pollIntervalSeconds", kind="float", bounds=Bounds(0.0, 300.0, low_open=True)),
    Setting("ENGINE_POLL_TIMEOUT_SECONDS",
            "longest wait for one /metrics answer before the poll counts as failed (default: 2 x the poll interval)",
            chart="admission.pollTimeoutSeconds", kind="float", bounds=Bounds(0.0, 600.0, low_open=True)),
    Setting("ENGINE_STALE_AFTER_POLLS", "failed polls before failing open", "3", chart="admission.staleAfterPolls",
            kind="int", bounds=_POSITIVE),
    Setting("ADMISSION_LOCAL_ACCOUNTING", "count own admissions/completions between polls", "true",
            chart="admission.localAccounting", kind="bool"),
    Setting("ADMISSION_SCRAPE_GRACE_SECONDS", "how long after admission a scrape may still miss a request", "0.5",
            chart="admission.scrapeGraceSeconds", kind="float", bounds=Bounds(0.0, 60.0)),
    Setting("ADMISSION_ENGINE_DONE_AFTER_SECONDS",
            "how long after admission a scrape must show a request for its slot to outlive the engine's work",
            "10", chart="admission.engineDoneAfterSeconds", kind="float", bounds=Bounds(0.0, 3600.0)),
    Setting("ADMISSION_KV_BUDGET", "admit only what fits the engine's free KV tokens", "true",
            chart="admission.kvBudget", kind="bool"),
    Setting("ADMISSION_KV_CAPACITY_TOKENS", "KV capacity when the engine's metrics show none",
            chart="admission.kvCapacityTokens", kind="int", bounds=_POSITIVE, engine_key="kv_capacity_tokens"),
    Setting("ADMISSION_ESTIMATE",
            "prompt token estimate: counted = tokenizer, engine /tokenize, learned bytes rule; "
            "bytes = text bytes / ADMISSION_BYTES_PER_TOKEN (no template, tools or n)",
            "counted",
            chart="admission.estimate.mode", kind="choice", choices=("counted", "bytes")),
    Setting("ADMISSION_TOKENIZER",
            "served model's tokenizer.json path, or qwen3, qwen2.5, llama3: exact prompt counts",
            chart="admission.estimate.tokenizer", kind="text"),
    Setting("ADMISSION_TOKENIZE_ABOVE_BYTES",
            "request bodies this large are counted by the engine's POST /tokenize; 0 = never", "8192",
            chart="admission.estimate.tokenizeAboveBytes", kind="int", bounds=_COUNT),
    Setting("ADMISSION_TOKENIZE_TIMEOUT_MS", "longest wait for the engine's count before the bytes rule", "500",
            chart="admission.estimate.tokenizeTimeoutMs", kind="float", bounds=Bounds(1.0, 60_000.0)),
    Setting("ADMISSION_BYTES_PER_TOKEN", "bytes rule: prompt bytes per token until one is learned", "2.5",
            chart="admission.bytesPerToken", kind="float", bounds=Bounds(0.0, 64.0, low_open=True)),
    Setting("ADMISSION_LEARN_BYTES_PER_TOKEN", "learn bytes per token from the engine's prompt-token counter", "true",
            chart="admission.estimate.learnBytesPerToken", kind="bool"),
    Setting("ADMISSION_BYTES_PER_TOKEN_MIN", "lower bound of the learned bytes per token", "1.0",
            chart="admission.estimate.bytesPerTokenMin", kind="float", bounds=Bounds(0.0, 64.0, low_open=True)),
    Setting("ADMISSION_BYTES_PER_TOKEN_MAX", "upper bound of the learned bytes per token", "4.0",
            chart="admission.estimate.bytesPerTokenMax", kind="float", bounds=Bounds(0.0, 64.0, low_open=True)),
    Setting("ADMISSION_TEMPLATE_TOKENS_FIXED", "chat template tokens added once per request", "32",
            chart="admission.estimate.templateTokens.fixed", kind="int", bounds=_COUNT),
    Setting("ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE", "chat template tokens added per message", "5",
            chart="admission.estimate.templateTokens.perMessage", kind="int", bounds=_COUNT),
    Setting("ADMISSION_TEMPLATE_TOKENS_TOOLS", "chat template tokens added when tools are given", "100",
            chart="admission.estimate.templateTokens.tools", kind="int", bounds=_COUNT),
    Setting("ADMISSION_ESTIMATE_SAFETY_FACTOR", "multiplier on the prompt token estimate", "1.0",
            chart="admission.estimateSafetyFactor", kind="float", bounds=Bounds(0.5, 4.0)),
    Setting("ADMISSION_DEFAULT_MAX_TOKENS", "generation allowance when a request sets no max_tokens", "1024",
            chart="admission.defaultMaxTokens", kind="int", bounds=_COUNT),
    Setting("ADMISSION_BACKFILL", "let small requests pass a KV-blocked head when it cannot delay it", "true",
            chart="admission.backfill", kind="bool"),
    Setting("ADMISSION_WAIT_ESTIMATES",
            "Retry-After from the predicted wait (completion rate; with the KV budget, the work ahead: "
            "ADMISSION_WAIT_PREDICTION); answer at once when it runs past the park cap (an estimate: twice the cap)",
            "true",
            chart="admission.waitEstimates", kind="bool"),
    Setting("ADMISSION_ENGINE_QUEUE_SLOTS",
            "with the budget: requests that may wait inside the engine beyond max in-flight", "1",
            chart="admission.engineQueueSlots", kind="int", bounds=_COUNT),
    Setting("ADMISSION_GATED_PATHS", "POST paths subject to admission", "every vLLM generation/pooling endpoint",
            literal=False, chart="admission.gatedPaths", kind="list"),
    Setting("ADMISSION_PASS_PATHS",
            "paths passed ungated whatever the method ('*' = one segment); every other POST is gated",
            "vLLM's cheap routes: /tokenize, /detokenize, /v1/models, /health, /ping, /version, /metrics, "
            "/v1/responses/*/cancel", literal=False, chart="admission.passPaths", kind="list"),
    Setting("ADMISSION_GENERATION_RESERVATION",
            "KV reserved for generation: max_tokens = the limit, learned = factor x the engine's mean",
            "max_tokens", chart="admission.generationReservation", kind="choice", choices=("max_tokens", "learned")),
    Setting("ADMISSION_GENERATION_FACTOR",
            "with learned: reserve this x the engine's recent mean generation, at most the limit", "1.5",
            chart="admission.generationFactor", kind="float", bounds=Bounds(0.1, 10.0)),
    Setting("ADMISSION_POLICY",
            "with the budget: strict = every request holds prompt + its generation reservation for its life; "
            "projected = admit when the projected peak KV of the running set fits (docs/concepts/kv-budget.md)",
            "strict", chart="admission.policy", kind="choice", choices=("strict", "projected")),
    Setting("ADMISSION_PROJECTION_QUANTILE",
            "with projected: each request's final generation length is this quantile of the engine's own "
            "length distribution, given what it has generated", "0.99",
            chart="admission.projectionQuantile", kind="float", bounds=Bounds(0.0, 1.0, low_open=True)),
    Setting("ADMISSION_PREEMPTION_MAX_COST_SECONDS",
            "with projected: a candidate whose preemption would cost more recompute than this (its context x "
            "(1 - prefix hit rate) / prefill rate) is admitted by the strict budget", "10.0",
            chart="admission.preemptionMaxCostSeconds", kind="float", bounds=Bounds(0.0, 3600.0)),
    Setting("ADMISSION_LEDGER", "where the gates' state lives: local = this process, redis = shared by replicas",
            "local", chart="ledger.backend", kind="choice", choices=("local", "redis")),
    Setting("ADMISSION_REDIS_URL",
            "redis://[:password@]host:port/db, rediss:// (TLS) or unix://; needed by redis", chart="ledger.redis.url",
            kind="url"),
    # The chart's floor is 0.5 s (a pod renews every third of it; less is churn, not safety); the
    # service goes down to 0.1 s for bench/admission.py's time-scaled runs.
    Setting("ADMISSION_LEDGER_LEASE_SECONDS", "a dead replica's reservations and parked requests expire after this",
            "5", chart="ledger.leaseSeconds", kind="float", bounds=Bounds(0.1, 300.0),
            chart_bounds=Bounds(0.5, 300.0)),
    Setting("ADMISSION_LEDGER_TIMEOUT_MS", "longest wait for one Redis call before deciding alone (degraded)", "50",
            chart="ledger.timeoutMs", kind="float", bounds=Bounds(1.0, 10_000.0)),
    Setting("ADMISSION_LEDGER_KEY_PREFIX", "Redis key prefix, for several deployments on one Redis",
            "llm-admission", chart="ledger.keyPrefix", kind="text"),
    Setting("ADMISSION_REPLICA_ID", "this replica's name in the shared ledger and its logs (e.g. the pod name)",
            "host-pid-random", literal=False, chart="ledger (the pod's name)", kind="text"),
    # ":PORT" (no host) is loopback for every listener: another interface only when it is named.
    Setting("EXTPROC_LISTEN", "gRPC ext_proc listen address; HOST:PORT, :PORT = 127.0.0.1:PORT, "
            "0.0.0.0:PORT = every interface", "127.0.0.1:9002", chart="admission.grpcPort", kind="listen"),
    Setting("EXTPROC_ADMIN_LISTEN", "/metrics /healthz /readyz /debug listen address; :PORT = 127.0.0.1:PORT",
            "127.0.0.1:9003", chart="admission.debugPort", kind="listen"),
    Setting("EXTPROC_PROBE_LISTEN", "optional second listener: /metrics /healthz /readyz only; "
            ":PORT = 127.0.0.1:PORT", chart="admission.adminPort", kind="listen"),
    # mTLS on the gRPC port, for a service reached over the network (the chart's shared shape).
    Setting("EXTPROC_TLS_CERT", "PEM certificate (chain) the gRPC port serves; with EXTPROC_TLS_KEY and "
            "EXTPROC_TLS_CLIENT_CA (all three or none): mTLS, every client must present a certificate",
            chart="extproc.tls.secretName", kind="file"),
    Setting("EXTPROC_TLS_KEY", "PEM private key of EXTPROC_TLS_CERT", chart="extproc.tls.secretName", kind="file"),
    Setting("EXTPROC_TLS_CLIENT_CA", "PEM CA bundle a client's certificate must chain to (Envoy's); "
            "`extproc envoy-config` also verifies the service with it", chart="extproc.tls.secretName", kind="file"),
    Setting("EXTPROC_MAX_STREAMS", "concurrent ext_proc streams (parked + in flight)", "10000",
            chart="admission.maxStreams", kind="int", bounds=Bounds(16)),
    Setting("EXTPROC_LOG_LEVEL", "log level; DEBUG adds a line per admitted request with its prompt estimate "
            "(prompt_tokens, estimate_source)", "INFO", chart="admission.logLevel", kind="choice",
            choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Setting("EXTPROC_LOG_FORMAT", "log line format", "json", chart="admission.logFormat", kind="choice",
            choices=("json", "text")),
    Setting("ADMISSION_WAIT_PREDICTION",
            "with wait estimates: bound = a lower bound on the wait (never turns away a request that could be "
            "served), expected = the expected wait from the work ahead (answers sooner, can be wrong)",
            "expected", chart="admission.waitPrediction", kind="choice", choices=("bound", "expected")),
)

BY_ENV = {s.env: s for s in SETTINGS}
ENGINE_KEYS = {s.engine_key: s for s in SETTINGS if s.engine_key is not None}  # the engines file's per-engine keys


def environment_help() -> str:
    """The `--help` epilog: one line per setting, what it accepts, its scope and its default in brackets."""
    width = 31
    lines = ["configuration (environment variables, read once at startup; a bad value exits with status 2;",
             "'per engine: KEY' = an EXTPROC_CONFIG engine entry may set it as KEY):"]
    for s in SETTINGS:
        name = s.env if len(s.env) < width else s.env + " "
        text = "; ".join(part for part in (s.help, s.allowed, s.engine_key and f"per engine: {s.engine_key}") if part)
        lines.append(f"  {name:<{width}}{text}  [{s.default if s.default is not None else 'unset'}]")
    return "\n".join(lines) + "\n"
