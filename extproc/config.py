"""Settings: read once at startup from an injected environment mapping (and an optional YAML file).

Every variable is validated here; a bad value raises `ConfigError` naming the variable and the
value, and the CLI turns that into exit status 2. Nothing else in the package reads `os.environ`.

Engines come from one of two places:
- environment only: one engine called `default` at `ENGINE_URL`, serving the models listed in
  `ADMISSION_OBSERVE_MODELS` (unset or empty = no model is gated, everything passes through);
- `EXTPROC_CONFIG=path.yaml`: a list of engines, each with its URL, its models and optional
  per-engine overrides of the admission limits (see docs/configuration/settings.md).
Either way each engine has a metrics `dialect` (extproc/dialects.py: vllm, sglang, trtllm, or auto
to detect it from the first exposition): `ADMISSION_ENGINE_DIALECT`, or an engine entry's `dialect`.

Each plain typed value (int, float, bool, choice) is read through its row in
extproc/settings_table.py, which holds its type, bounds or choices and default: `_int(env, NAME)`
and its siblings, or `_value(row, where, raw)` for an engines-file key. No default or bound for
those is written here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from .endpoints import DEFAULT_GATED_PATHS, DEFAULT_PASS_PATHS, canonical_path, path_pattern
from .settings_table import BY_ENV, ENGINE_KEYS, Setting

#: A poll may take this many poll intervals before it counts as failed, unless ENGINE_POLL_TIMEOUT_SECONDS
#: says otherwise: a busy vLLM API server (measured on vLLM 0.32, CPU, 2 cores, under load) answered
#: /metrics later than the 2 s interval 17 times in one run, and three such polls in a row made the
#: gate fail open in front of an engine that was answering. A poll that runs past the interval skips
#: the ticks it missed (the cadence is kept); a hung engine still goes stale, after
#: ENGINE_STALE_AFTER_POLLS timed-out polls.
POLL_TIMEOUT_INTERVALS = 2.0


class ConfigError(ValueError):
    """A setting is missing or has a value the service cannot run with."""


@dataclass(frozen=True)
class EngineLimits:
    """The admission limits for one engine (defaults from the environment, overridable per engine)."""

    max_inflight: int
    kv_threshold: float
    max_queue_depth: int
    max_park_seconds: float
    kv_capacity_tokens: int | None  # used when the engine exposes no KV capacity (its dialect's families)


@dataclass(frozen=True)
class EstimateSettings:
    """How prompt tokens are estimated (extproc/estimate.py, extproc/tokencount.py)."""

    mode: str  # counted: the sources below; bytes: the estimate before issue 11
    tokenizer: str | None  # a built-in vocabulary name or a tokenizer.json path
    tokenize_above_bytes: int  # ask the engine's POST /tokenize from this body size; 0 = never
    tokenize_timeout_seconds: float
    learn: bool  # learn bytes-per-token from the engine's prompt-token counter
    bytes_per_token_min: float  # bounds of the learned bytes-per-token
    bytes_per_token_max: float
    template_fixed: int
    template_per_message: int
    template_tools: int


BUILTIN_TOKENIZERS = ("qwen3", "qwen2.5", "llama3")  # extproc/tokenizer.py's vocabularies


@dataclass(frozen=True)
class TlsFiles:
    """mTLS on the gRPC port: the service's certificate and key, and the CA its clients' must chain to."""

    cert: str
    key: str
    client_ca: str


@dataclass(frozen=True)
class EngineConfig:
    name: str
    url: str  # base URL, e.g. http://127.0.0.1:8000
    metrics_url: str
    upstream_host: str
    upstream_port: int
    models: tuple[str, ...]
    limits: EngineLimits
    dialect: str  # a name in dialects.DIALECTS, or auto: detected from the first exposition

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
    poll_timeout: float  # one poll's longest wait (ENGINE_POLL_TIMEOUT_SECONDS, else 2 x poll_interval)
    stale_after_polls: int
    retry_after_seconds: int
    scrape_grace_seconds: float
    engine_done_after_seconds: float
    local_accounting: bool
    kv_budget: bool
    backfill: bool
    engine_queue_slots: int
    wait_estimates: bool
    bytes_per_token: float
    estimate_safety_factor: float
    default_max_tokens: int
    gated_paths: tuple[str, ...]
    pass_paths: tuple[str, ...]  # ungated whatever the method; any other POST is gated
    engines: tuple[EngineConfig, ...]
    max_streams: int
    models_refresh_seconds: float  # 0 = only the configured models; else re-read each engine's /v1/models
    log_level: str
    log_format: str
    config_file: str | None
    ledger: str  # where the gates' state lives: this process, or Redis shared by replicas
    redis_url: str | None
    ledger_lease_seconds: float
    ledger_timeout_seconds: float
    ledger_key_prefix: str
    replica_id: str | None  # this replica's name in the shared ledger (None: host-pid-random)
    generation_reservation: str  # KV reserved for generation: the limit, or learned
    generation_factor: float  # with learned: this x the engine's mean generation
    policy: str  # with the budget: strict, or projected (extproc/projection.py)
    projection_quantile: float  # with projected: the length quantile
    preemption_max_cost_seconds: float  # with projected: above this recompute, the strict budget
    estimate: EstimateSettings
    wait_prediction: str  # with wait_estimates: bound (a lower bound) or expected (extproc/gate.py)
    tls: TlsFiles | None = None  # mTLS on the gRPC port (None: plaintext)
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
            "grpc_tls": dataclasses.asdict(self.tls) if self.tls is not None else None,
            "admin_listen": f"{self.admin_host}:{self.admin_port}",
            "probe_listen": f"{self.probe_host}:{self.probe_port}" if self.probe_host is not None else None,
            "max_body_bytes": self.max_body_bytes,
            "poll_interval_s": self.poll_interval,
            "poll_timeout_s": self.poll_timeout,
            "stale_after_polls": self.stale_after_polls,
            "retry_after_s": self.retry_after_seconds,
            "scrape_grace_s": self.scrape_grace_seconds,
            "engine_done_after_s": self.engine_done_after_seconds,
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
            "pass_paths": list(self.pass_paths),
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
            "policy": self.policy,
            "projection_quantile": self.projection_quantile,
            "preemption_max_cost_s": self.preemption_max_cost_seconds,
            "wait_prediction": self.wait_prediction,
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


def _number(setting: Setting, name: str, raw: object, cast: Callable[[str], _Number]) -> _Number:
    """`raw` as an int or float within `setting`'s bounds; the error names `name` and `raw`."""
    try:
        value = cast(str(raw).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={raw!r}: must be {setting.allowed}") from None
    if (isinstance(value, float) and not math.isfinite(value)) or (
            setting.bounds is not None and not setting.bounds.admits(value)):
        raise ConfigError(f"{name}={raw!r}: must be {setting.allowed}")
    return value


def _value(setting: Setting, name: str, raw: object) -> int | float | bool | str:
    """`raw` parsed as `setting`'s row says (kind, bounds, choices); a bad one names `name` and `raw`."""
    if setting.kind == "int":
        return _number(setting, name, raw, int)
    if setting.kind == "float":
        return _number(setting, name, raw, float)
    text = str(raw).strip()
    if setting.kind == "bool":
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
    elif setting.kind == "choice":
        for choice in setting.choices:  # matched ignoring case, returned as the table spells it
            if text.lower() == choice.lower():
                return choice
    else:
        raise TypeError(f"{setting.env} is a {setting.kind} setting: config.py parses it by hand")
    raise ConfigError(f"{name}={raw!r}: must be {setting.allowed}")


def _raw(env: Mapping[str, str], name: str) -> str:
    """The variable's value, or its row's default when unset or empty."""
    setting = BY_ENV[name]
    if env.get(name):
        return env[name]
    if setting.default is None or not setting.literal:
        raise TypeError(f"{name} has no literal default in extproc/settings_table.py: read it with its fallback")
    return setting.default


def _typed(env: Mapping[str, str], name: str, kind: str) -> int | float | bool | str:
    setting = BY_ENV[name]
    if setting.kind != kind:
        raise TypeError(f"{name} is a {setting.kind} setting in extproc/settings_table.py, read here as {kind}")
    return _value(setting, name, _raw(env, name))


def _int(env: Mapping[str, str], name: str) -> int:
    value = _typed(env, name, "int")
    assert isinstance(value, int)
    return value


def _float(env: Mapping[str, str], name: str) -> float:
    value = _typed(env, name, "float")
    assert isinstance(value, float)
    return value


def _bool(env: Mapping[str, str], name: str) -> bool:
    value = _typed(env, name, "bool")
    assert isinstance(value, bool)
    return value


def _choice(env: Mapping[str, str], name: str) -> str:
    value = _typed(env, name, "choice")
    assert isinstance(value, str)
    return value


#: The park cap's default: long enough for a sustained-load queue to drain on today's vLLM
#: (bench/README.md, "Defaults"): 120 s turned away 8 of 24 `steady` requests the engine would
#: have served, 300 s turned away 2, at about the same TTFT p95 (256 s against 248 s).
DEFAULT_MAX_PARK_SECONDS = _float({}, "ADMISSION_MAX_PARK_SECONDS")


#: Where `:PORT` (no host) listens: loopback. Every interface only when asked for by name
#: (`0.0.0.0:PORT`, `[::]:PORT`): the gRPC port has no authentication unless mTLS is on, and any
#: process that reaches it can open ext_proc streams and hold the engine's slots.
UNNAMED_LISTEN_HOST = "127.0.0.1"


def _listen(name: str, raw: str) -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep:
        raise ConfigError(f"{name}={raw!r}: must be HOST:PORT")
    if not (port.strip().isdigit() and int(port) <= 65535):
        raise ConfigError(f"{name}={raw!r}: the port must be an integer from 0 to 65535")
    return host.strip().strip("[]") or UNNAMED_LISTEN_HOST, int(port)


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
_ENGINE_KEYS = {"name", *ENGINE_KEYS}  # the per-engine rows of extproc/settings_table.py


def _env_limits(env: Mapping[str, str]) -> EngineLimits:
    """Every engine's limits unless its engines-file entry overrides them."""
    return EngineLimits(
        max_inflight=(_int(env, "ADMISSION_MAX_INFLIGHT") if env.get("ADMISSION_MAX_INFLIGHT")
                      else _int(env, "VLLM_MAX_NUM_SEQS")),
        kv_threshold=_float(env, "ADMISSION_KV_THRESHOLD"),
        max_queue_depth=_int(env, "VLLM_MAX_QUEUE_DEPTH"),
        max_park_seconds=_float(env, "ADMISSION_MAX_PARK_SECONDS"),
        kv_capacity_tokens=_int(env, "ADMISSION_KV_CAPACITY_TOKENS") if env.get("ADMISSION_KV_CAPACITY_TOKENS")
        else None,
    )


def _entry_limits(where: str, entry: Mapping[str, Any], defaults: EngineLimits) -> EngineLimits:
    """`defaults` with the limits one engines-file entry sets (its keys are the rows' `engine_key`s)."""
    changes: dict[str, Any] = {f.name: _value(ENGINE_KEYS[f.name], f"{where}.{f.name}", entry[f.name])
               for f in dataclasses.fields(EngineLimits) if f.name in entry}
    return dataclasses.replace(defaults, **changes)


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
        limits = _entry_limits(where, entry, defaults)
        dialect = (str(_value(BY_ENV["ADMISSION_ENGINE_DIALECT"], f"{where}.dialect", entry["dialect"]))
                   if "dialect" in entry else default_dialect)
        engines.append(EngineConfig(name, url, metrics_url, host, port, tuple(models), limits, dialect))
    return tuple(engines)


def load_settings(env: Mapping[str, str]) -> Settings:
    """Build and validate the settings from an environment mapping."""
    defaults = _env_limits(env)
    poll_interval = _float(env, "ENGINE_POLL_INTERVAL_SECONDS")
    config_file = env.get("EXTPROC_CONFIG") or None
    observe = _csv(env.get("ADMISSION_OBSERVE_MODELS"))
    dialect = _choice(env, "ADMISSION_ENGINE_DIALECT")
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
    passes = (_csv(env.get("ADMISSION_PASS_PATHS")) if env.get("ADMISSION_PASS_PATHS") is not None
              else DEFAULT_PASS_PATHS)
    for path in passes:
        where = f"ADMISSION_PASS_PATHS={env.get('ADMISSION_PASS_PATHS')!r}: {path!r}"
        if not path.startswith("/") or canonical_path(path) != path.lower():
            raise ConfigError(f"{where} must be a plain path starting with '/' (no percent-encoding, ';', '?', "
                              "dot segments, doubled or trailing '/'; '*' stands for one segment)")
        if "*" in path and any(segment != "*" and "*" in segment for segment in path.split("/")):
            raise ConfigError(f"{where}: '*' must be a whole segment")
        if any(re.fullmatch(path_pattern(path), gated_path) for gated_path in gated):
            raise ConfigError(f"{where} is also a gated path (ADMISSION_GATED_PATHS): a path is gated or passed")
    tls = _tls_files(env)
    ledger = _choice(env, "ADMISSION_LEDGER")
    redis_url = (_redis_url("ADMISSION_REDIS_URL", env["ADMISSION_REDIS_URL"]) if env.get("ADMISSION_REDIS_URL")
                 else None)
    if ledger == "redis" and redis_url is None:
        raise ConfigError("ADMISSION_LEDGER=redis needs ADMISSION_REDIS_URL (e.g. redis://redis:6379/0)")
    replica = env.get("ADMISSION_REPLICA_ID") or None
    if replica is not None and not re.match(r"^[A-Za-z0-9_.:-]{1,128}$", replica):
        raise ConfigError(f"ADMISSION_REPLICA_ID={replica!r}: must be 1-128 letters, digits, '_', '.', ':' or '-' "
                          "(e.g. the pod name)")
    key_prefix = _raw(env, "ADMISSION_LEDGER_KEY_PREFIX")
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
        max_body_bytes=_int(env, "MAX_BODY_BYTES"),
        poll_interval=poll_interval,
        poll_timeout=(_float(env, "ENGINE_POLL_TIMEOUT_SECONDS") if env.get("ENGINE_POLL_TIMEOUT_SECONDS")
                      else POLL_TIMEOUT_INTERVALS * poll_interval),
        stale_after_polls=_int(env, "ENGINE_STALE_AFTER_POLLS"),
        retry_after_seconds=_int(env, "ADMISSION_RETRY_AFTER_SECONDS"),
        scrape_grace_seconds=_float(env, "ADMISSION_SCRAPE_GRACE_SECONDS"),
        engine_done_after_seconds=_float(env, "ADMISSION_ENGINE_DONE_AFTER_SECONDS"),
        local_accounting=_bool(env, "ADMISSION_LOCAL_ACCOUNTING"),
        kv_budget=_bool(env, "ADMISSION_KV_BUDGET"),
        backfill=_bool(env, "ADMISSION_BACKFILL"),
        wait_estimates=_bool(env, "ADMISSION_WAIT_ESTIMATES"),
        engine_queue_slots=_int(env, "ADMISSION_ENGINE_QUEUE_SLOTS"),
        bytes_per_token=_float(env, "ADMISSION_BYTES_PER_TOKEN"),
        estimate_safety_factor=_float(env, "ADMISSION_ESTIMATE_SAFETY_FACTOR"),
        default_max_tokens=_int(env, "ADMISSION_DEFAULT_MAX_TOKENS"),
        gated_paths=gated,
        pass_paths=passes,
        engines=engines,
        max_streams=_int(env, "EXTPROC_MAX_STREAMS"),
        models_refresh_seconds=_float(env, "ADMISSION_MODELS_REFRESH_SECONDS"),
        log_level=_choice(env, "EXTPROC_LOG_LEVEL"),
        log_format=_choice(env, "EXTPROC_LOG_FORMAT"),
        config_file=config_file,
        ledger=ledger,
        redis_url=redis_url,
        ledger_lease_seconds=_float(env, "ADMISSION_LEDGER_LEASE_SECONDS"),
        ledger_timeout_seconds=_float(env, "ADMISSION_LEDGER_TIMEOUT_MS") / 1000,
        ledger_key_prefix=key_prefix,
        replica_id=replica,
        estimate=_estimate_settings(env),
        generation_reservation=_choice(env, "ADMISSION_GENERATION_RESERVATION"),
        generation_factor=_float(env, "ADMISSION_GENERATION_FACTOR"),
        policy=_choice(env, "ADMISSION_POLICY"),
        projection_quantile=_float(env, "ADMISSION_PROJECTION_QUANTILE"),
        preemption_max_cost_seconds=_float(env, "ADMISSION_PREEMPTION_MAX_COST_SECONDS"),
        wait_prediction=_choice(env, "ADMISSION_WAIT_PREDICTION"),
        tls=tls,
    )


_TLS = ("EXTPROC_TLS_CERT", "EXTPROC_TLS_KEY", "EXTPROC_TLS_CLIENT_CA")


def _tls_files(env: Mapping[str, str]) -> TlsFiles | None:
    """The gRPC port's mTLS files, all three or none, each readable and what it says it is (the
    certificate matches the key, the CA bundle parses): a bad one fails at startup, naming it,
    instead of failing every Envoy's handshake later."""
    given = {name: env[name] for name in _TLS if env.get(name)}
    if not given:
        return None
    if len(given) < len(_TLS):
        missing = [name for name in _TLS if name not in given]
        raise ConfigError(f"{', '.join(missing)} unset while {', '.join(given)} set: mTLS on the gRPC port needs "
                          "all three of EXTPROC_TLS_CERT, EXTPROC_TLS_KEY and EXTPROC_TLS_CLIENT_CA (or none)")
    for name, path in given.items():
        try:
            with open(path, "rb") as fh:
                fh.read(1)
        except OSError as exc:
            raise ConfigError(f"{name}={path!r}: cannot read: {exc.strerror}") from None
    cert, key, ca = (given[name] for name in _TLS)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(f"EXTPROC_TLS_CERT={cert!r}, EXTPROC_TLS_KEY={key!r}: not a PEM certificate and its "
                          f"private key ({exc.reason or exc})") from None
    try:
        context.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise ConfigError(f"EXTPROC_TLS_CLIENT_CA={ca!r}: not a PEM CA bundle ({exc.reason or exc})") from None
    return TlsFiles(cert, key, ca)


def _estimate_settings(env: Mapping[str, str]) -> EstimateSettings:
    tokenizer = (env.get("ADMISSION_TOKENIZER") or "").strip() or None
    if tokenizer is not None and tokenizer not in BUILTIN_TOKENIZERS:
        if not tokenizer.endswith(".json"):
            raise ConfigError(f"ADMISSION_TOKENIZER={tokenizer!r}: must be a built-in vocabulary "
                              f"({', '.join(BUILTIN_TOKENIZERS)}) or the path of the served model's tokenizer.json")
        if not os.path.isfile(tokenizer) or not os.access(tokenizer, os.R_OK):
            raise ConfigError(f"ADMISSION_TOKENIZER={tokenizer!r}: no readable file there (mount the served "
                              "model's tokenizer.json, or unset it to ask the engine's /tokenize)")
    low = _float(env, "ADMISSION_BYTES_PER_TOKEN_MIN")
    high = _float(env, "ADMISSION_BYTES_PER_TOKEN_MAX")
    if low > high:
        raise ConfigError(f"ADMISSION_BYTES_PER_TOKEN_MIN={low:g} is above ADMISSION_BYTES_PER_TOKEN_MAX={high:g}")
    return EstimateSettings(
        mode=_choice(env, "ADMISSION_ESTIMATE"),
        tokenizer=tokenizer,
        tokenize_above_bytes=_int(env, "ADMISSION_TOKENIZE_ABOVE_BYTES"),
        tokenize_timeout_seconds=_float(env, "ADMISSION_TOKENIZE_TIMEOUT_MS") / 1000,
        learn=_bool(env, "ADMISSION_LEARN_BYTES_PER_TOKEN"),
        bytes_per_token_min=low,
        bytes_per_token_max=high,
        template_fixed=_int(env, "ADMISSION_TEMPLATE_TOKENS_FIXED"),
        template_per_message=_int(env, "ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE"),
        template_tools=_int(env, "ADMISSION_TEMPLATE_TOKENS_TOOLS"),
    )
