"""Settings: read once at startup from an injected environment mapping (and an optional YAML file).

Every variable is validated here; a bad value raises `ConfigError` naming the variable and the
value, and the CLI turns that into exit status 2. Nothing else in the package reads `os.environ`.

Engines come from one of two places:
- environment only: one engine called `default` at `ENGINE_URL`, serving the models listed in
  `ADMISSION_OBSERVE_MODELS` (unset or empty = no model is gated, everything passes through);
- `EXTPROC_CONFIG=path.yaml`: a list of engines, each with its URL, its models and optional
  per-engine overrides of the admission limits (see README "Configuration").
Either way each engine has a metrics `dialect` (extproc/dialects.py: vllm, sglang, trtllm, or auto
to detect it from the first exposition): `ADMISSION_ENGINE_DIALECT`, or an engine entry's `dialect`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from .contract import MAX_PARK_SECONDS
from .dialects import AUTO, CHOICES as DIALECT_CHOICES
from .endpoints import DEFAULT_GATED_PATHS, canonical_path

#: The park cap's default: long enough for a sustained-load queue to drain on today's vLLM
#: (bench/README.md, "Defaults"): 120 s turned away 8 of 24 `steady` requests the engine would
#: have served, 300 s turned away 2, at about the same TTFT p95 (256 s against 248 s).
DEFAULT_MAX_PARK_SECONDS = 300.0


class ConfigError(ValueError):
    """A setting is missing or has a value the service cannot run with."""


@dataclass(frozen=True)
class EngineLimits:
    """The admission limits for one engine (defaults from the environment, overridable per engine)."""

    max_inflight: int
    kv_threshold: float
    max_queue_depth: int
    max_park_seconds: float
    kv_capacity_tokens: int | None = None  # used when the engine exposes no KV capacity (its dialect's families)


@dataclass(frozen=True)
class EstimateSettings:
    """How prompt tokens are estimated (extproc/estimate.py, extproc/tokencount.py)."""

    mode: str = "counted"  # counted: the sources below; bytes: the estimate before issue 11
    tokenizer: str | None = None  # a built-in vocabulary name or a tokenizer.json path
    tokenize_above_bytes: int = 8192  # ask the engine's POST /tokenize from this prompt size; 0 = never
    tokenize_timeout_seconds: float = 0.5
    learn: bool = True  # learn bytes-per-token from the engine's prompt-token counter
    bytes_per_token_min: float = 1.0  # bounds of the learned bytes-per-token
    bytes_per_token_max: float = 4.0
    template_fixed: int = 32
    template_per_message: int = 5
    template_tools: int = 100


BUILTIN_TOKENIZERS = ("qwen3", "qwen2.5", "llama3")  # extproc/tokenizer.py's vocabularies


@dataclass(frozen=True)
class EngineConfig:
    name: str
    url: str  # base URL, e.g. http://127.0.0.1:8000
    metrics_url: str
    upstream_host: str
    upstream_port: int
    models: tuple[str, ...]
    limits: EngineLimits
    dialect: str = AUTO  # a name in dialects.DIALECTS, or auto: detected from the first exposition

    @property
    def cluster(self) -> str:
        """The Envoy cluster name that carries this engine's traffic."""
        return f"engine_{self.name}"


@dataclass(frozen=True)
class Settings:
    grpc_host: str
    grpc_port: int
    admin_host: str
    admin_port: int
    probe_host: str | None  # a second listener with only /metrics, /healthz and /readyz (unset: none)
    probe_port: int | None
    max_body_bytes: int
    poll_interval: float
    stale_after_polls: int
    retry_after_seconds: int
    scrape_grace_seconds: float
    local_accounting: bool
    kv_budget: bool
    backfill: bool
    engine_queue_slots: int
    wait_estimates: bool
    bytes_per_token: float
    estimate_safety_factor: float
    default_max_tokens: int
    gated_paths: tuple[str, ...]
    engines: tuple[EngineConfig, ...]
    max_streams: int
    models_refresh_seconds: float  # 0 = only the configured models; else re-read each engine's /v1/models
    log_level: str
    log_format: str
    config_file: str | None = None
    ledger: str = "local"  # where the gates' state lives: this process, or Redis shared by replicas
    redis_url: str | None = None
    ledger_lease_seconds: float = 5.0
    ledger_timeout_seconds: float = 0.05
    ledger_key_prefix: str = "llm-admission"
    replica_id: str | None = None  # this replica's name in the shared ledger (None: host-pid-random)
    generation_reservation: str = "max_tokens"  # KV reserved for generation: the limit, or learned
    generation_factor: float = 1.5  # with learned: this x the engine's mean generation
    estimate: EstimateSettings = field(default_factory=lambda: EstimateSettings())
    model_to_engine: Mapping[str, EngineConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = {model: engine for engine in self.engines for model in engine.models}
        object.__setattr__(self, "model_to_engine", table)

    @property
    def gating(self) -> bool:
        """False when no model is configured: every request passes through ungated."""
        return bool(self.model_to_engine)

    @property
    def effective_engine_queue_slots(self) -> int:
        """Requests allowed to wait inside an engine beyond max in-flight: only with the KV budget."""
        return self.engine_queue_slots if self.kv_budget and self.local_accounting else 0

    @property
    def max_park_seconds(self) -> float:
        """The longest park any engine allows; Envoy's timeouts are sized from it."""
        return max((e.limits.max_park_seconds for e in self.engines), default=0.0)

    def summary(self) -> dict[str, Any]:
        """The effective configuration, for the startup log line and `extproc check-config`."""
        return {
            "grpc_listen": f"{self.grpc_host}:{self.grpc_port}",
            "admin_listen": f"{self.admin_host}:{self.admin_port}",
            "probe_listen": f"{self.probe_host}:{self.probe_port}" if self.probe_host is not None else None,
            "max_body_bytes": self.max_body_bytes,
            "poll_interval_s": self.poll_interval,
            "stale_after_polls": self.stale_after_polls,
            "retry_after_s": self.retry_after_seconds,
            "scrape_grace_s": self.scrape_grace_seconds,
            "local_accounting": self.local_accounting,
            "kv_budget": self.kv_budget and self.local_accounting,
            "backfill": self.backfill,
            "wait_estimates": self.wait_estimates,
            "engine_queue_slots": self.effective_engine_queue_slots,
            "bytes_per_token": self.bytes_per_token,
            "estimate_safety_factor": self.estimate_safety_factor,
            "default_max_tokens": self.default_max_tokens,
            "estimate": {
                "mode": self.estimate.mode,
                "tokenizer": self.estimate.tokenizer,
                "tokenize_above_bytes": self.estimate.tokenize_above_bytes,
                "tokenize_timeout_ms": round(self.estimate.tokenize_timeout_seconds * 1000, 3),
                "learn_bytes_per_token": self.estimate.learn,
                "bytes_per_token_bounds": [self.estimate.bytes_per_token_min, self.estimate.bytes_per_token_max],
                "template_tokens": {"fixed": self.estimate.template_fixed,
                                    "per_message": self.estimate.template_per_message,
                                    "tools": self.estimate.template_tools},
            },
            "gated_paths": list(self.gated_paths),
            "models_refresh_s": self.models_refresh_seconds,
            "gating": self.gating,
            "config_file": self.config_file,
            "ledger": self.ledger,
            "redis_url": redact_url(self.redis_url) if self.redis_url else None,
            "ledger_lease_s": self.ledger_lease_seconds,
            "ledger_timeout_ms": round(self.ledger_timeout_seconds * 1000, 3),
            "ledger_key_prefix": self.ledger_key_prefix,
            "replica_id": self.replica_id,
            "generation_reservation": self.generation_reservation,
            "generation_factor": self.generation_factor,
            "engines": [
                {
                    "name": e.name,
                    "metrics_url": e.metrics_url,
                    "upstream": f"{e.upstream_host}:{e.upstream_port}",
                    "models": list(e.models),
                    "max_inflight": e.limits.max_inflight,
                    "kv_threshold": e.limits.kv_threshold,
                    "max_queue_depth": e.limits.max_queue_depth,
                    "max_park_seconds": e.limits.max_park_seconds,
                    "kv_capacity_tokens": e.limits.kv_capacity_tokens or "from the engine's metrics",
                    "dialect": e.dialect,
                }
                for e in self.engines
            ],
        }


# --- typed readers -----------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """`url` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username + ':' if parts.username else ':'}***@{parts.hostname}" + (
        f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


def _redis_url(name: str, raw: str) -> str:
    url = str(raw).strip()
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix") or (parts.scheme != "unix" and not parts.hostname):
        raise ConfigError(f"{name}={redact_url(url)!r}: must be a redis://, rediss:// or unix:// URL "
                          "such as redis://:password@redis:6379/0")
    try:
        _ = parts.port  # reading it raises ValueError for a port that is not a number in range
    except ValueError:
        raise ConfigError(f"{name}={redact_url(url)!r}: has an invalid port") from None
    return url


_Number = TypeVar("_Number", int, float)


def _cast(name: str, raw: object, kind: Callable[[str], _Number], what: str) -> _Number:
    try:
        value = kind(str(raw).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={raw!r}: must be {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r}: must be {what}")
    return value


def _int(name: str, raw: object, minimum: int) -> int:
    value = _cast(name, raw, int, f"an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name}={raw!r}: must be an integer >= {minimum}")
    return value


def _float(name: str, raw: object, low: float, high: float | None = None, low_open: bool = False) -> float:
    bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
    value = _cast(name, raw, float, f"a number {bound}")
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        raise ConfigError(f"{name}={raw!r}: must be a number {bound}")
    return value


def _bool(name: str, raw: object) -> bool:
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: must be true or false")


def _listen(name: str, raw: str) -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep:
        raise ConfigError(f"{name}={raw!r}: must be HOST:PORT")
    return host.strip("[]") or "0.0.0.0", _int(name, port, 0)


def _csv(raw: str | None) -> tuple[str, ...]:
    return tuple(item.strip() for item in (raw or "").split(",") if item.strip())


def _engine_url(name: str, raw: str) -> tuple[str, str, int]:
    parts = urlsplit(str(raw).strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{name}={raw!r}: must be an http(s) URL such as http://127.0.0.1:8000")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: has an invalid port") from None
    return str(raw).strip().rstrip("/"), parts.hostname, port


_ENGINE_NAME = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,40}[a-z0-9])?$")
_ENGINE_KEYS = {
    "name", "url", "metrics_url", "models", "max_inflight", "kv_threshold", "max_queue_depth", "max_park_seconds",
    "kv_capacity_tokens", "dialect",
}


def _dialect(name: str, raw: object) -> str:
    value = str(raw).strip().lower()
    if value not in DIALECT_CHOICES:
        raise ConfigError(f"{name}={raw!r}: must be one of {', '.join(DIALECT_CHOICES)}")
    return value


def _limits(prefix: str, source: Mapping[str, Any], defaults: EngineLimits | None) -> EngineLimits:
    """Limits from env (`defaults is None`) or from one YAML engine entry overriding `defaults`."""

    def pick(key: str, env: str) -> tuple[str, Any] | None:
        if defaults is None:
            return (env, source[env]) if source.get(env) not in (None, "") else None
        return (f"{prefix}.{key}", source[key]) if key in source else None

    d = defaults
    got = pick("max_inflight", "ADMISSION_MAX_INFLIGHT")
    if got is not None:
        max_inflight = _int(*got, 1)
    elif d is not None:
        max_inflight = d.max_inflight
    else:
        max_inflight = _int("VLLM_MAX_NUM_SEQS", source.get("VLLM_MAX_NUM_SEQS") or 4, 1)
    got = pick("kv_threshold", "ADMISSION_KV_THRESHOLD")
    kv = _float(*got, 0.0, 1.0, low_open=True) if got else (d.kv_threshold if d else 0.90)
    got = pick("max_queue_depth", "VLLM_MAX_QUEUE_DEPTH")
    depth = _int(*got, 0) if got else (d.max_queue_depth if d else 8)
    got = pick("max_park_seconds", "ADMISSION_MAX_PARK_SECONDS")
    park = (_float(*got, 0.0, MAX_PARK_SECONDS, low_open=True) if got
            else (d.max_park_seconds if d else DEFAULT_MAX_PARK_SECONDS))
    got = pick("kv_capacity_tokens", "ADMISSION_KV_CAPACITY_TOKENS")
    capacity = _int(*got, 1) if got else (d.kv_capacity_tokens if d else None)
    return EngineLimits(max_inflight=max_inflight, kv_threshold=kv, max_queue_depth=depth, max_park_seconds=park,
                        kv_capacity_tokens=capacity)


def _engines_from_yaml(path: str, env: Mapping[str, str], defaults: EngineLimits,
                       default_dialect: str) -> tuple[EngineConfig, ...]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"EXTPROC_CONFIG={path!r}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"EXTPROC_CONFIG={path!r}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("engines"), list) or not doc["engines"]:
        raise ConfigError(f"EXTPROC_CONFIG={path!r}: must be a mapping with a non-empty list `engines`")
    unknown_top = set(doc) - {"engines"}
    if unknown_top:
        raise ConfigError(f"EXTPROC_CONFIG={path!r}: unknown top-level keys {sorted(unknown_top)}")
    engines: list[EngineConfig] = []
    for index, entry in enumerate(doc["engines"]):
        where = f"engines[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: must be a mapping")
        unknown = set(entry) - _ENGINE_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_ENGINE_KEYS)}")
        name = str(entry.get("name", ""))
        if not _ENGINE_NAME.match(name):
            raise ConfigError(f"{where}.name={entry.get('name')!r}: must be lowercase letters, digits, '-' or '_'")
        where = f"engines[{name}]"
        if "url" not in entry:
            raise ConfigError(f"{where}.url: missing (e.g. http://vllm:8000)")
        url, host, port = _engine_url(f"{where}.url", entry["url"])
        metrics_url = (_engine_url(f"{where}.metrics_url", entry["metrics_url"])[0] if "metrics_url" in entry
                       else f"{url}/metrics")
        models = entry.get("models")
        if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
            raise ConfigError(f"{where}.models={models!r}: must be a non-empty list of model names")
        limits = _limits(where, entry, defaults)
        dialect = _dialect(f"{where}.dialect", entry["dialect"]) if "dialect" in entry else default_dialect
        engines.append(EngineConfig(name, url, metrics_url, host, port, tuple(models), limits, dialect))
    return tuple(engines)


def load_settings(env: Mapping[str, str]) -> Settings:
    """Build and validate the settings from an environment mapping."""
    defaults = _limits("", env, None)
    config_file = env.get("EXTPROC_CONFIG") or None
    observe = _csv(env.get("ADMISSION_OBSERVE_MODELS"))
    dialect = _dialect("ADMISSION_ENGINE_DIALECT", env.get("ADMISSION_ENGINE_DIALECT") or AUTO)
    if config_file:
        if observe:
            raise ConfigError(
                "ADMISSION_OBSERVE_MODELS and EXTPROC_CONFIG are both set: list the models in the "
                "config file's engines[].models instead"
            )
        engines = _engines_from_yaml(config_file, env, defaults, dialect)
    else:
        url, host, port = _engine_url("ENGINE_URL", env.get("ENGINE_URL") or "http://127.0.0.1:8000")
        metrics_url = env.get("ENGINE_METRICS_URL") or f"{url}/metrics"
        _engine_url("ENGINE_METRICS_URL", metrics_url)
        engines = (EngineConfig("default", url, metrics_url, host, port, observe, defaults, dialect),)
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise ConfigError(f"EXTPROC_CONFIG={config_file!r}: engine names must be unique, got {names}")
    seen: dict[str, str] = {}
    for engine in engines:
        for model in engine.models:
            if model in seen:
                raise ConfigError(
                    f"model {model!r} is listed for engines {seen[model]!r} and {engine.name!r}: "
                    "each model must map to exactly one engine"
                )
            seen[model] = engine.name

    grpc_host, grpc_port = _listen("EXTPROC_LISTEN", env.get("EXTPROC_LISTEN") or "127.0.0.1:9002")
    admin_host, admin_port = _listen("EXTPROC_ADMIN_LISTEN", env.get("EXTPROC_ADMIN_LISTEN") or "127.0.0.1:9003")
    probe_host, probe_port = (_listen("EXTPROC_PROBE_LISTEN", env["EXTPROC_PROBE_LISTEN"])
                              if env.get("EXTPROC_PROBE_LISTEN") else (None, None))
    gated = (_csv(env.get("ADMISSION_GATED_PATHS")) if env.get("ADMISSION_GATED_PATHS") is not None
             else DEFAULT_GATED_PATHS)
    for path in gated:
        if not path.startswith("/"):
            raise ConfigError(f"ADMISSION_GATED_PATHS={env.get('ADMISSION_GATED_PATHS')!r}: "
                              "every path must start with '/'")
        if canonical_path(path) != path.lower():
            raise ConfigError(
                f"ADMISSION_GATED_PATHS={env.get('ADMISSION_GATED_PATHS')!r}: {path!r} must be a plain path as the "
                "engine routes it (no percent-encoding, ';', '?', dot segments, doubled or trailing '/')")
    log_level = (env.get("EXTPROC_LOG_LEVEL") or "INFO").upper()
    if log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"EXTPROC_LOG_LEVEL={env.get('EXTPROC_LOG_LEVEL')!r}: must be DEBUG, INFO, WARNING or ERROR")
    log_format = (env.get("EXTPROC_LOG_FORMAT") or "json").lower()
    if log_format not in ("json", "text"):
        raise ConfigError(f"EXTPROC_LOG_FORMAT={env.get('EXTPROC_LOG_FORMAT')!r}: must be json or text")

    def opt(name: str, default: str) -> str:
        return env.get(name) or default

    ledger = opt("ADMISSION_LEDGER", "local").strip().lower()
    if ledger not in ("local", "redis"):
        raise ConfigError(f"ADMISSION_LEDGER={env.get('ADMISSION_LEDGER')!r}: must be local or redis")
    redis_url = (_redis_url("ADMISSION_REDIS_URL", env["ADMISSION_REDIS_URL"]) if env.get("ADMISSION_REDIS_URL")
                 else None)
    if ledger == "redis" and redis_url is None:
        raise ConfigError("ADMISSION_LEDGER=redis needs ADMISSION_REDIS_URL (e.g. redis://redis:6379/0)")
    generation_reservation = opt("ADMISSION_GENERATION_RESERVATION", "max_tokens").strip().lower()
    if generation_reservation not in ("max_tokens", "learned"):
        raise ConfigError(f"ADMISSION_GENERATION_RESERVATION={env.get('ADMISSION_GENERATION_RESERVATION')!r}: "
                          "must be max_tokens or learned")
    replica = env.get("ADMISSION_REPLICA_ID") or None
    if replica is not None and not re.match(r"^[A-Za-z0-9_.:-]{1,128}$", replica):
        raise ConfigError(f"ADMISSION_REPLICA_ID={replica!r}: must be 1-128 letters, digits, '_', '.', ':' or '-' "
                          "(e.g. the pod name)")
    key_prefix = opt("ADMISSION_LEDGER_KEY_PREFIX", "llm-admission")
    if not re.match(r"^[A-Za-z0-9_.:-]{1,64}$", key_prefix):
        raise ConfigError(f"ADMISSION_LEDGER_KEY_PREFIX={key_prefix!r}: "
                          "must be 1-64 letters, digits, '_', '.', ':' or '-'")

    return Settings(
        grpc_host=grpc_host,
        grpc_port=grpc_port,
        admin_host=admin_host,
        admin_port=admin_port,
        probe_host=probe_host,
        probe_port=probe_port,
        max_body_bytes=_int("MAX_BODY_BYTES", opt("MAX_BODY_BYTES", "1048576"), 1024),
        poll_interval=_float("ENGINE_POLL_INTERVAL_SECONDS", opt("ENGINE_POLL_INTERVAL_SECONDS", "2"), 0.0, 300.0,
                             low_open=True),
        stale_after_polls=_int("ENGINE_STALE_AFTER_POLLS", opt("ENGINE_STALE_AFTER_POLLS", "3"), 1),
        retry_after_seconds=_int("ADMISSION_RETRY_AFTER_SECONDS", opt("ADMISSION_RETRY_AFTER_SECONDS", "5"), 1),
        scrape_grace_seconds=_float(
            "ADMISSION_SCRAPE_GRACE_SECONDS", opt("ADMISSION_SCRAPE_GRACE_SECONDS", "0.5"), 0.0, 60.0),
        local_accounting=_bool("ADMISSION_LOCAL_ACCOUNTING", opt("ADMISSION_LOCAL_ACCOUNTING", "true")),
        kv_budget=_bool("ADMISSION_KV_BUDGET", opt("ADMISSION_KV_BUDGET", "true")),
        backfill=_bool("ADMISSION_BACKFILL", opt("ADMISSION_BACKFILL", "true")),
        wait_estimates=_bool("ADMISSION_WAIT_ESTIMATES", opt("ADMISSION_WAIT_ESTIMATES", "true")),
        engine_queue_slots=_int("ADMISSION_ENGINE_QUEUE_SLOTS", opt("ADMISSION_ENGINE_QUEUE_SLOTS", "1"), 0),
        bytes_per_token=_float(
            "ADMISSION_BYTES_PER_TOKEN", opt("ADMISSION_BYTES_PER_TOKEN", "2.5"), 0.0, 64.0, low_open=True),
        estimate_safety_factor=_float(
            "ADMISSION_ESTIMATE_SAFETY_FACTOR", opt("ADMISSION_ESTIMATE_SAFETY_FACTOR", "1.0"), 0.5, 4.0),
        default_max_tokens=_int("ADMISSION_DEFAULT_MAX_TOKENS", opt("ADMISSION_DEFAULT_MAX_TOKENS", "1024"), 0),
        gated_paths=gated,
        engines=engines,
        max_streams=_int("EXTPROC_MAX_STREAMS", opt("EXTPROC_MAX_STREAMS", "10000"), 16),
        models_refresh_seconds=_float(
            "ADMISSION_MODELS_REFRESH_SECONDS", opt("ADMISSION_MODELS_REFRESH_SECONDS", "30"), 0.0, 3600.0),
        log_level=log_level,
        log_format=log_format,
        config_file=config_file,
        ledger=ledger,
        redis_url=redis_url,
        ledger_lease_seconds=_float(
            "ADMISSION_LEDGER_LEASE_SECONDS", opt("ADMISSION_LEDGER_LEASE_SECONDS", "5"), 0.1, 300.0),
        ledger_timeout_seconds=_float(
            "ADMISSION_LEDGER_TIMEOUT_MS", opt("ADMISSION_LEDGER_TIMEOUT_MS", "50"), 1.0, 10_000.0) / 1000,
        ledger_key_prefix=key_prefix,
        replica_id=replica,
        estimate=_estimate_settings(env),
        generation_reservation=generation_reservation,
        generation_factor=_float("ADMISSION_GENERATION_FACTOR", opt("ADMISSION_GENERATION_FACTOR", "1.5"), 0.1, 10.0),
    )


def _estimate_settings(env: Mapping[str, str]) -> EstimateSettings:
    def opt(name: str, default: str) -> str:
        return env.get(name) or default

    mode = opt("ADMISSION_ESTIMATE", "counted").strip().lower()
    if mode not in ("counted", "bytes"):
        raise ConfigError(f"ADMISSION_ESTIMATE={env.get('ADMISSION_ESTIMATE')!r}: must be counted (the default: "
                          "tokenizer, engine /tokenize, learned bytes-per-token) "
                          "or bytes (the estimate before issue 11)")
    tokenizer = (env.get("ADMISSION_TOKENIZER") or "").strip() or None
    if tokenizer is not None and tokenizer not in BUILTIN_TOKENIZERS:
        if not tokenizer.endswith(".json"):
            raise ConfigError(f"ADMISSION_TOKENIZER={tokenizer!r}: must be a built-in vocabulary "
                              f"({', '.join(BUILTIN_TOKENIZERS)}) or the path of the served model's tokenizer.json")
        if not os.path.isfile(tokenizer) or not os.access(tokenizer, os.R_OK):
            raise ConfigError(f"ADMISSION_TOKENIZER={tokenizer!r}: no readable file there (mount the served "
                              "model's tokenizer.json, or unset it to ask the engine's /tokenize)")
    low = _float("ADMISSION_BYTES_PER_TOKEN_MIN", opt("ADMISSION_BYTES_PER_TOKEN_MIN", "1.0"), 0.0, 64.0,
                 low_open=True)
    high = _float("ADMISSION_BYTES_PER_TOKEN_MAX", opt("ADMISSION_BYTES_PER_TOKEN_MAX", "4.0"), 0.0, 64.0,
                  low_open=True)
    if low > high:
        raise ConfigError(f"ADMISSION_BYTES_PER_TOKEN_MIN={low:g} is above ADMISSION_BYTES_PER_TOKEN_MAX={high:g}")
    return EstimateSettings(
        mode=mode,
        tokenizer=tokenizer,
        tokenize_above_bytes=_int("ADMISSION_TOKENIZE_ABOVE_BYTES", opt("ADMISSION_TOKENIZE_ABOVE_BYTES", "8192"), 0),
        tokenize_timeout_seconds=_float(
            "ADMISSION_TOKENIZE_TIMEOUT_MS", opt("ADMISSION_TOKENIZE_TIMEOUT_MS", "500"), 1.0, 60_000.0) / 1000,
        learn=_bool("ADMISSION_LEARN_BYTES_PER_TOKEN", opt("ADMISSION_LEARN_BYTES_PER_TOKEN", "true")),
        bytes_per_token_min=low,
        bytes_per_token_max=high,
        template_fixed=_int("ADMISSION_TEMPLATE_TOKENS_FIXED", opt("ADMISSION_TEMPLATE_TOKENS_FIXED", "32"), 0),
        template_per_message=_int(
            "ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE", opt("ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE", "5"), 0),
        template_tools=_int("ADMISSION_TEMPLATE_TOKENS_TOOLS", opt("ADMISSION_TEMPLATE_TOKENS_TOOLS", "100"), 0),
    )
