"""Measure the admission service's and Envoy's memory and CPU on the local stack.

The chart's default resource requests and limits (helm/llm-admission/values.yaml) are sized from
what this prints. It starts the same stack as `make run` (simulator + `extproc serve` + Envoy
with one worker) on free loopback ports, lets it idle, then keeps N clients sending chat
completions through Envoy for a while, sampling each process's RSS and CPU time from /proc.

    .venv/bin/python helm/measure_resources.py --clients 64 --seconds 20

The simulator shares the machine, so CPU figures are an upper bound on what the service needs
for the request rate printed next to them, not a capacity test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

from devstack import LocalStack

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


async def drive(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[Counter[str], int]:
    outcomes: Counter[str] = Counter()
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": max_tokens}
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=300)

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                await response.read()
                outcomes[response.headers.get("x-admission-outcome", str(response.status))] += 1

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return outcomes, sum(outcomes.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--queue-depth", type=int, default=256, help="VLLM_MAX_QUEUE_DEPTH (parked streams held)")
    parser.add_argument("--engine-seqs", type=int, default=4,
                        help="the simulator's --max-num-seqs and ADMISSION_MAX_INFLIGHT (raise it to load the gateway, not the engine)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        stack = LocalStack(
            workdir=Path(tmp),
            extproc_env={"ADMISSION_OBSERVE_MODELS": "sim-model", "EXTPROC_LOG_LEVEL": "WARNING",
                         "VLLM_MAX_QUEUE_DEPTH": str(args.queue_depth),
                         "ADMISSION_MAX_INFLIGHT": str(args.engine_seqs)},
            sim_args=("--max-num-seqs", str(args.engine_seqs), "--num-gpu-blocks", "100000", "--max-model-len", "4096"),
        ).start()
        try:
            procs = {"extproc": stack.extproc.process.pid, "envoy": stack.envoy.process.pid}  # type: ignore[union-attr]
            time.sleep(5)
            report: dict[str, object] = {"idle_rss_mib": {n: round(rss_mib(p), 1) for n, p in procs.items()}}
            for clients in args.clients:
                before = {n: cpu_seconds(p) for n, p in procs.items()}
                started = time.monotonic()
                outcomes, total = asyncio.run(drive(stack.url, clients, args.seconds, args.max_tokens))
                wall = time.monotonic() - started
                report[f"clients_{clients}"] = {
                    "requests_per_s": round(total / wall, 1),
                    "outcomes": dict(outcomes),
                    "cpu_cores": {n: round((cpu_seconds(p) - before[n]) / wall, 3) for n, p in procs.items()},
                    "rss_mib": {n: round(rss_mib(p), 1) for n, p in procs.items()},
                }
            report["peak_rss_mib"] = {n: round(rss_mib(p, "VmHWM"), 1) for n, p in procs.items()}
            print(json.dumps(report, indent=2))
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
