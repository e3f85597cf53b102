"""The `extproc` command: serve, print the Envoy config, check the configuration or an engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from . import __version__
from .config import ConfigError, Settings, load_settings
from .endpoints import DEFAULT_GATED_PATHS, DEFAULT_PASS_PATHS
from .envoyconf import DEFAULT_ENVOY_MEMORY_LIMIT_BYTES, DEFAULT_TTFT_ALLOWANCE_SECONDS, ExtprocTls
from .logs import configure
from .settings_table import environment_help

log = logging.getLogger("extproc")

ENVIRONMENT_HELP = environment_help()  # one line per setting, from extproc/settings_table.py


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="extproc",
        description=(
            "Admission control for LLM inference as an Envoy ext_proc service: admit a request, "
            "park it in a bounded FIFO, or answer 503 + Retry-After, from the engine's own gauges."
        ),
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the ext_proc gRPC server and the admin HTTP server",
                           epilog=ENVIRONMENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--grace", type=float, default=10.0,
                       help="seconds to wait for admitted requests' streams on SIGTERM (default: %(default)s)")

    envoy = sub.add_parser("envoy-config", help="print the Envoy config that matches these settings",
                           epilog=ENVIRONMENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    envoy.add_argument("--listen", default="0.0.0.0:8080", help="Envoy's HTTP listener (default: %(default)s)")
    envoy.add_argument("--admin", default="127.0.0.1:9901", help="Envoy's admin listener (default: %(default)s)")
    envoy.add_argument("--extproc", default=None,
                       help="where Envoy reaches this service (default: EXTPROC_LISTEN, 0.0.0.0 read as 127.0.0.1)")
    envoy.add_argument("--failure-mode", choices=("open", "closed"), default="open",
                       help="when the service is down: open = forward ungated, closed = 503 (default: %(default)s)")
    envoy.add_argument("--stream-idle-timeout", type=float, default=None,
                       help="Envoy stream idle timeout in seconds; must exceed the park cap "
                            "(default: park cap + --first-token-allowance)")
    envoy.add_argument("--first-token-allowance", type=float, default=DEFAULT_TTFT_ALLOWANCE_SECONDS,
                       help="seconds a request may wait for its first byte after its park (default: %(default)s)")
    envoy.add_argument("--health-listen", default=None, metavar="HOST:PORT",
                       help="add a listener that forwards only /ready and /stats/prometheus to the admin "
                            "interface, exempt from the connection cap (default: none)")
    envoy.add_argument("--memory-limit", default=str(DEFAULT_ENVOY_MEMORY_LIMIT_BYTES // 2**20) + "Mi",
                       help="Envoy's container memory limit (Kubernetes quantity, e.g. 512Mi), which sizes its "
                            "overload manager and connection cap; 'none' for no overload manager "
                            "(default: %(default)s)")
    envoy.add_argument("--max-downstream-connections", type=int, default=None,
                       help="Envoy's global downstream connection cap (default: sized from --memory-limit "
                            "and MAX_BODY_BYTES)")
    tls = envoy.add_argument_group(
        "mTLS to the service", "Envoy's client certificate, key and the CA it verifies the service with (all three "
        "or none), as paths in Envoy's container. Default: the service's own EXTPROC_TLS_CERT, EXTPROC_TLS_KEY "
        "and EXTPROC_TLS_CLIENT_CA when they are set (one certificate for both sides), else plaintext.")
    tls.add_argument("--extproc-tls-cert", default=None, metavar="PATH", help="PEM certificate Envoy presents")
    tls.add_argument("--extproc-tls-key", default=None, metavar="PATH", help="its private key")
    tls.add_argument("--extproc-tls-ca", default=None, metavar="PATH",
                     help="PEM CA bundle the service's certificate must chain to")
    tls.add_argument("--extproc-tls-server-name", default=None, metavar="NAME",
                     help="the name (DNS or IP) the service's certificate must carry (default: the --extproc host)")
    envoy.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")

    sub.add_parser("check-config", help="validate the configuration, print it as JSON, exit 0 or 2",
                   epilog=ENVIRONMENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)

    check = sub.add_parser(
        "check", help="scrape engines' metrics once and show what the service would parse and decide",
        description=(
            "Scrape each engine's metrics once and print what the service would make of them: dialect and "
            "apparent vLLM version, the series admission needs (found or missing), running, waiting, KV usage, "
            "DP ranks, KV capacity and its source, the effective limits from this environment, and what the "
            "gate would decide now for a 1k, 8k and 65k-token prompt. Exit 0 when all is usable, 1 when an "
            "engine is unreachable or a required series is missing or unparsable, 2 on a configuration error."),
        epilog=ENVIRONMENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("urls", nargs="*", metavar="URL",
                       help="engine base URL (/metrics is added) or metrics URL; default: every configured engine")
    check.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    check.add_argument("--timeout", type=float, default=None,
                       help="seconds to wait for each engine (default: ENGINE_POLL_INTERVAL_SECONDS, as the service)")
    return parser


def _hostport(flag: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"{flag}={value!r}: must be HOST:PORT")
    return host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = os.environ if environ is None else environ
    command = args.command or "serve"
    try:
        settings = load_settings(env)
    except ConfigError as exc:
        print(f"extproc: configuration error: {exc}", file=sys.stderr)
        return 2
    if command == "check-config":
        print(json.dumps(settings.summary(), indent=2))
        return 0
    if command == "envoy-config":
        return _envoy_config(args, settings)
    if command == "check":
        from .check import run

        status, text = run(settings, args.urls, as_json=args.json, timeout=args.timeout)
        sys.stdout.write(text)
        return status
    return _serve(settings, getattr(args, "grace", 10.0))


def _extproc_tls(args: argparse.Namespace) -> ExtprocTls | None:
    """The mTLS flags as an ExtprocTls, or None when none is given (the service's own settings apply)."""
    files = {"--extproc-tls-cert": args.extproc_tls_cert, "--extproc-tls-key": args.extproc_tls_key,
             "--extproc-tls-ca": args.extproc_tls_ca}
    if not any(files.values()) and args.extproc_tls_server_name is None:
        return None
    missing = [flag for flag, value in files.items() if not value]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: mTLS to the service needs --extproc-tls-cert, --extproc-tls-key "
                          "and --extproc-tls-ca together")
    return ExtprocTls(args.extproc_tls_cert, args.extproc_tls_key, args.extproc_tls_ca, args.extproc_tls_server_name)


def _envoy_config(args: argparse.Namespace, settings: Settings) -> int:
    from .envoyconf import memory_bytes, render_envoy_config

    try:
        listen = _hostport("--listen", args.listen)
        admin = _hostport("--admin", args.admin)
        extproc = _hostport("--extproc", args.extproc) if args.extproc else (None, None)
        health = _hostport("--health-listen", args.health_listen) if args.health_listen else ("0.0.0.0", None)
        memory = None if args.memory_limit == "none" else memory_bytes(args.memory_limit)
        text = render_envoy_config(
            settings, listen_host=listen[0], listen_port=listen[1], admin_host=admin[0], admin_port=admin[1],
            extproc_host=extproc[0], extproc_port=extproc[1], failure_mode=args.failure_mode,
            stream_idle_timeout=args.stream_idle_timeout, first_token_allowance=args.first_token_allowance,
            health_host=health[0], health_port=health[1], memory_limit_bytes=memory,
            downstream_connections=args.max_downstream_connections, extproc_tls=_extproc_tls(args),
        )
    except (ConfigError, ValueError) as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


#: The start-up log's groups of the effective configuration (`Settings.summary()` keys), one INFO
#: line each; a key in no group goes to "other", so a new setting is never left out.
CONFIGURATION_GROUPS: dict[str, tuple[str, ...]] = {
    "listen": ("grpc_listen", "admin_listen", "probe_listen", "max_body_bytes"),
    "paths": ("gated_paths", "pass_paths"),
    "polling": ("poll_interval_s", "poll_timeout_s", "stale_after_polls", "scrape_grace_s", "models_refresh_s",
                "config_file"),
    "admission": ("gating", "local_accounting", "kv_budget", "backfill", "wait_estimates", "engine_queue_slots",
                  "retry_after_s", "generation_reservation", "generation_factor", "wait_prediction"),
    "estimate": ("estimate",),
    "sizes": ("bytes_per_token", "estimate_safety_factor", "default_max_tokens"),
    "ledger": ("ledger", "redis_url", "ledger_lease_s", "ledger_timeout_ms", "ledger_key_prefix", "replica_id"),
}
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


#: Path lists logged by name when they are the defaults: the gated list is every vLLM engine route
#: (two dozen, and growing with vLLM), too long for a readable line.
_DEFAULT_PATHS = {"gated_paths": DEFAULT_GATED_PATHS, "pass_paths": DEFAULT_PASS_PATHS}


def _paths(paths: Any, default: tuple[str, ...]) -> Any:
    return f"default ({len(default)} paths)" if tuple(paths) == default else paths


def configuration_lines(summary: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The effective configuration as (group, settings) pairs: one per group, then one per engine.
    Nested settings are flattened (`template_tokens.fixed`) so each pair is one short line of key=value."""
    def flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, Mapping):
                out.update(flat(value, f"{prefix}{key}."))
            else:  # a key that names a log record field would be refused by logging: prefix it
                name = f"{prefix}{key}" if f"{prefix}{key}" not in _RECORD_FIELDS else f"setting_{key}"
                out[name] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        return out

    summary = {**summary, **{key: _paths(summary[key], default) for key, default in _DEFAULT_PATHS.items()
                             if key in summary}}
    grouped = {key for keys in CONFIGURATION_GROUPS.values() for key in keys} | {"engines"}
    lines = []
    for group, keys in CONFIGURATION_GROUPS.items():
        nested = summary.get(group)
        values = flat(nested) if keys == (group,) and isinstance(nested, Mapping) else \
            flat({k: summary[k] for k in keys if k in summary})
        lines.append((group, values))
    other = {k: v for k, v in summary.items() if k not in grouped}
    if other:
        lines.append(("other", flat(other)))
    for engine in summary.get("engines", ()):
        lines.append((f"engine {engine['name']}", flat({k: v for k, v in engine.items() if k != "name"})))
    return lines


def log_configuration(settings: Settings) -> None:
    """The effective configuration at start-up: one readable INFO line per group and per engine;
    the whole of it as one JSON document at DEBUG."""
    summary = settings.summary()
    for group, values in configuration_lines(summary):
        log.info("configuration: %s", group, extra=values)
    log.debug("effective configuration", extra={"config": summary})


def _serve(settings: Settings, grace: float) -> int:
    from .server import serve

    configure(settings.log_level, settings.log_format)
    log_configuration(settings)
    if not settings.gating:
        log.warning("no models configured (ADMISSION_OBSERVE_MODELS / EXTPROC_CONFIG): "
                    "every request passes through ungated")
    for engine in settings.engines:
        if engine.models:
            log.info(
                "admission limits: park while kv_usage >= %.2f or running + waiting >= %d; this must match the "
                "engine's --max-num-seqs, which no gauge exposes",
                engine.limits.kv_threshold, engine.limits.max_inflight, extra={"engine": engine.name},
            )
    try:
        asyncio.run(serve(settings, grace))
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0
