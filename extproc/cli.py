"""The `extproc` command: serve, print the Envoy config, check the configuration or an engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from . import __version__
from .config import ConfigError, Settings, load_settings
from .logs import configure

log = logging.getLogger("extproc")

ENVIRONMENT_HELP = """\
configuration (environment variables, read once at startup; a bad value exits with status 2):
  ENGINE_URL                     engine base URL when no config file is used  [http://127.0.0.1:8000]
  ENGINE_METRICS_URL             its metrics URL                              [$ENGINE_URL/metrics]
  ADMISSION_OBSERVE_MODELS       comma-separated models to gate on that engine; unset = gate nothing
  ADMISSION_MODELS_REFRESH_SECONDS  re-read each engine's /v1/models; its names are gated too; 0 = off  [30]
  EXTPROC_CONFIG                 YAML file mapping engines to models, with per-engine overrides
  ADMISSION_MAX_INFLIGHT         park while running + waiting >= this          [$VLLM_MAX_NUM_SEQS or 4]
  VLLM_MAX_NUM_SEQS              the engine's --max-num-seqs (default for the line above)  [4]
  ADMISSION_KV_THRESHOLD         park while KV cache usage (fraction) >= this  [0.90]
  VLLM_MAX_QUEUE_DEPTH           parked requests per engine before rejecting at once (503)  [8]
  ADMISSION_MAX_PARK_SECONDS     longest park before 503 + Retry-After        [300]
  ADMISSION_RETRY_AFTER_SECONDS  Retry-After on 503 answers                    [5]
  MAX_BODY_BYTES                 request body cap; larger bodies get 413       [1048576]
  ENGINE_POLL_INTERVAL_SECONDS   engine /metrics poll interval                 [2]
  ENGINE_STALE_AFTER_POLLS       failed polls before failing open              [3]
  ADMISSION_LOCAL_ACCOUNTING     count own admissions/completions between polls  [true]
  ADMISSION_SCRAPE_GRACE_SECONDS how long after admission a scrape may still miss a request  [0.5]
  ADMISSION_KV_BUDGET            admit only what fits the engine's free KV tokens  [true]
  ADMISSION_KV_CAPACITY_TOKENS   KV capacity when the engine has no vllm:cache_config_info  [unset]
  ADMISSION_ESTIMATE             counted (tokenizer, engine /tokenize, learned bytes rule) or bytes (before issue 11)  [counted]
  ADMISSION_TOKENIZER            served model's tokenizer.json path, or qwen3, qwen2.5, llama3: exact prompt counts  [unset]
  ADMISSION_TOKENIZE_ABOVE_BYTES prompts this large are counted by the engine's POST /tokenize; 0 = never  [8192]
  ADMISSION_TOKENIZE_TIMEOUT_MS  longest wait for the engine's count before the bytes rule  [500]
  ADMISSION_BYTES_PER_TOKEN      bytes rule: prompt bytes per token until one is learned  [2.5]
  ADMISSION_LEARN_BYTES_PER_TOKEN  learn bytes per token from vllm:prompt_tokens_total  [true]
  ADMISSION_BYTES_PER_TOKEN_MIN  lower bound of the learned bytes per token  [1.0]
  ADMISSION_BYTES_PER_TOKEN_MAX  upper bound of the learned bytes per token  [4.0]
  ADMISSION_TEMPLATE_TOKENS_FIXED  chat template tokens added once per request  [32]
  ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE  chat template tokens added per message  [5]
  ADMISSION_TEMPLATE_TOKENS_TOOLS  chat template tokens added when tools are given  [100]
  ADMISSION_ESTIMATE_SAFETY_FACTOR  multiplier on the prompt token estimate    [1.0]
  ADMISSION_DEFAULT_MAX_TOKENS   generation allowance when a request sets no max_tokens  [1024]
  ADMISSION_BACKFILL             let small requests pass a KV-blocked head when it cannot delay it  [true]
  ADMISSION_WAIT_ESTIMATES       Retry-After from the completion rate; reject at once if the wait exceeds the park cap  [true]
  ADMISSION_ENGINE_QUEUE_SLOTS   with the budget: requests that may wait inside the engine beyond max in-flight  [1]
  ADMISSION_GATED_PATHS          POST paths subject to admission  [every vLLM generation/pooling endpoint]
  ADMISSION_GENERATION_RESERVATION  KV reserved for generation: max_tokens (the limit) or learned (factor x the engine's mean)  [max_tokens]
  ADMISSION_GENERATION_FACTOR    with learned: reserve this x the engine's recent mean generation, at most the limit  [1.5]
  ADMISSION_LEDGER               where the gates' state lives: local (this process) or redis (shared by replicas)  [local]
  ADMISSION_REDIS_URL            redis://[:password@]host:port/db, rediss:// (TLS) or unix://; needed by redis  [unset]
  ADMISSION_LEDGER_LEASE_SECONDS a dead replica's reservations and parked requests expire after this  [5]
  ADMISSION_LEDGER_TIMEOUT_MS    longest wait for one Redis call before deciding alone (degraded)  [50]
  ADMISSION_LEDGER_KEY_PREFIX    Redis key prefix, for several deployments on one Redis  [llm-admission]
  ADMISSION_REPLICA_ID           this replica's name in the shared ledger and its logs (e.g. the pod name)  [host-pid-random]
  EXTPROC_LISTEN                 gRPC ext_proc listen address                  [127.0.0.1:9002]
  EXTPROC_ADMIN_LISTEN           /metrics /healthz /readyz /debug listen address  [127.0.0.1:9003]
  EXTPROC_PROBE_LISTEN           optional second listener: /metrics /healthz /readyz only  [unset]
  EXTPROC_MAX_STREAMS            concurrent ext_proc streams (parked + in flight)  [10000]
  EXTPROC_LOG_LEVEL              DEBUG, INFO, WARNING or ERROR                 [INFO]
  EXTPROC_LOG_FORMAT             json or text                                  [json]
"""


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
                            "(default: park cap + 600)")
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


def _envoy_config(args: argparse.Namespace, settings: Settings) -> int:
    from .envoyconf import render_envoy_config

    try:
        listen = _hostport("--listen", args.listen)
        admin = _hostport("--admin", args.admin)
        extproc = _hostport("--extproc", args.extproc) if args.extproc else (None, None)
        text = render_envoy_config(
            settings, listen_host=listen[0], listen_port=listen[1], admin_host=admin[0], admin_port=admin[1],
            extproc_host=extproc[0], extproc_port=extproc[1], failure_mode=args.failure_mode,
            stream_idle_timeout=args.stream_idle_timeout,
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


def _serve(settings: Settings, grace: float) -> int:
    from .server import serve

    configure(settings.log_level, settings.log_format)
    log.info("effective configuration", extra={"config": settings.summary()})
    if not settings.gating:
        log.warning("no models configured (ADMISSION_OBSERVE_MODELS / EXTPROC_CONFIG): every request passes through ungated")
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
