"""Latency and CPU the admission service adds to an admitted request, side by side with Envoy alone.

    python -m bench.latency [--requests 1000] [--body-bytes 1024] [--ledger local|redis]

Two Envoys front one simulator: one with the ext_proc filter (and the service), one without.
Requests alternate between them on keep-alive connections, so drift in the simulator or the
machine hits both equally. Each request is a non-streaming chat completion with a ~1 KB body and
max_tokens=1. With `--ledger redis` the service keeps its ledger in a local redis-server (one
round trip per decision), which measures what the shared ledger adds. Prints a table and, last,
one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devstack import LocalStack, RedisServer, http_get


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _body(size: int) -> bytes:
    skeleton: dict[str, Any] = {"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    pad = size - len(json.dumps(skeleton))
    skeleton["messages"][0]["content"] = "x" * max(0, pad)
    return json.dumps(skeleton).encode()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per path (default: %(default)s)")
    parser.add_argument("--body-bytes", type=int, default=1024, help="request body size (default: %(default)s)")
    parser.add_argument("--ledger", choices=("local", "redis"), default="local",
                        help="the service's ledger; redis starts a local redis-server (default: %(default)s)")
    args = parser.parse_args(argv)

    body = _body(args.body_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"ADMISSION_OBSERVE_MODELS": "sim-model", "EXTPROC_LOG_LEVEL": "WARNING"}
        redis = RedisServer(Path(tmp) / "redis").start() if args.ledger == "redis" else None
        if redis is not None:
            env.update({"ADMISSION_LEDGER": "redis", "ADMISSION_REDIS_URL": redis.url})
        try:
            gated = LocalStack(Path(tmp) / "gated", extproc_env=env).start()
        except BaseException:
            if redis is not None:
                redis.stop()
            raise
        plain = LocalStack(Path(tmp) / "plain", engine_url=gated.engine_base, with_extproc=False)
        try:
            plain.start()
            conns = {
                "envoy+extproc": http.client.HTTPConnection("127.0.0.1", gated.envoy_port, timeout=30),
                "envoy only": http.client.HTTPConnection("127.0.0.1", plain.envoy_port, timeout=30),
            }
            samples: dict[str, list[float]] = {name: [] for name in conns}
            headers = {"content-type": "application/json"}
            for _ in range(50):  # warm-up: connections, grpc channel, caches
                for conn in conns.values():
                    conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
                    conn.getresponse().read()
            assert gated.extproc is not None and gated.extproc.process is not None
            pid = gated.extproc.process.pid
            cpu_before = _cpu_seconds(pid)
            for i in range(args.requests):
                order = list(conns.items()) if i % 2 == 0 else list(reversed(conns.items()))
                for name, conn in order:
                    t0 = time.perf_counter()
                    conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
                    response = conn.getresponse()
                    response.read()
                    samples[name].append(time.perf_counter() - t0)
                    if response.status != 200:
                        print(f"unexpected status {response.status} on {name}", file=sys.stderr)
                        return 1
                if (i + 1) % max(1, args.requests // 10) == 0:
                    print(f"  {i + 1}/{args.requests}", file=sys.stderr, flush=True)
            cpu = _cpu_seconds(pid) - cpu_before
            rss = _rss_mib(pid)
            status, text = http_get(f"{gated.admin_url}/metrics")
            decision_sum = decision_count = 0.0
            ledger_sum = ledger_count = 0.0
            for line in text.decode().splitlines():
                if line.startswith("admission_decision_latency_seconds_sum"):
                    decision_sum += float(line.rsplit(" ", 1)[1])
                elif line.startswith("admission_decision_latency_seconds_count"):
                    decision_count += float(line.rsplit(" ", 1)[1])
                elif line.startswith("admission_ledger_round_trip_seconds_sum"):
                    ledger_sum += float(line.rsplit(" ", 1)[1])
                elif line.startswith("admission_ledger_round_trip_seconds_count"):
                    ledger_count += float(line.rsplit(" ", 1)[1])
        finally:
            plain.stop()
            gated.stop()
            if redis is not None:
                redis.stop()

    ms = {name: [v * 1000 for v in values] for name, values in samples.items()}
    result = {
        "requests": args.requests,
        "body_bytes": len(body),
        "ledger": args.ledger,
        "envoy_only_p50_ms": round(_pct(ms["envoy only"], 0.5), 3),
        "envoy_only_p99_ms": round(_pct(ms["envoy only"], 0.99), 3),
        "with_extproc_p50_ms": round(_pct(ms["envoy+extproc"], 0.5), 3),
        "with_extproc_p99_ms": round(_pct(ms["envoy+extproc"], 0.99), 3),
        "added_p50_ms": round(_pct(ms["envoy+extproc"], 0.5) - _pct(ms["envoy only"], 0.5), 3),
        "added_p99_ms": round(_pct(ms["envoy+extproc"], 0.99) - _pct(ms["envoy only"], 0.99), 3),
        "added_mean_ms": round(statistics.mean(ms["envoy+extproc"]) - statistics.mean(ms["envoy only"]), 3),
        "service_decision_mean_ms": round(decision_sum / decision_count * 1000, 4) if decision_count else None,
        "service_cpu_ms_per_request": round(cpu / args.requests * 1000, 3),
        "service_rss_mib": round(rss, 1),
        "ledger_round_trip_mean_ms": round(ledger_sum / ledger_count * 1000, 4) if ledger_count else None,
        "ledger_round_trips_per_request": round(ledger_count / (args.requests + 50), 2) if ledger_count else None,
    }
    print(f"{'path':<16}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, values in ms.items():
        print(f"{name:<16}{_pct(values, 0.5):>10.3f}{_pct(values, 0.99):>10.3f}{statistics.mean(values):>10.3f}")
    print(f"added by the service: p50 {result['added_p50_ms']} ms, p99 {result['added_p99_ms']} ms; "
          f"service CPU {result['service_cpu_ms_per_request']} ms/request; "
          f"decision time in the service {result['service_decision_mean_ms']} ms; RSS {result['service_rss_mib']} MiB")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
