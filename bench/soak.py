"""Soak: run the local stack under a mixed load for a bounded time and watch for leaks.

    python -m bench.soak --minutes 10            # the default; loopback only

Starts the engine simulator, the admission service and Envoy (`devstack.LocalStack`, free
loopback ports) and drives, with `--clients` concurrent raw HTTP/1.1 clients, a mix of requests:
admitted ones (plain and streamed to the end), ones that park, ones rejected (queue full, park
timeout), clients that hang up while parked or mid-stream, and bad bodies (not JSON, vertical tab
as whitespace, deep nesting, unknown and duplicate model). Every `--every` seconds it prints the
service's RSS and open fds, its decisions by outcome, and the leak indicators (queue depth,
in-flight, KV reserved tokens). At the end it stops the load and waits (with a deadline) for the
service to be idle: queue depth, in-flight and reservations must all come back to 0. Prints one
JSON object as the last line; exits 1 if a leak indicator did not return to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from devstack import SIM_MODEL, LocalStack, http_get, wait_until

PATH = "/v1/chat/completions"
KINDS = ("admit", "stream", "gone_parked", "gone_midstream", "bad", "park_long")
WEIGHTS = (30, 25, 15, 10, 15, 5)
BAD_BODIES = (
    b"not json",
    b'{"model":\x0b"sim-model","messages":[]}',
    b'{"model":"sim-model","x":' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model":"no-such-model","messages":[]}',
    b'{"model":"sim-model","model":"other"}',
    b'{"model":"sim-model","max_tokens":1.5}',
)


def chat(max_tokens: int, stream: bool, content: str = "Hello there") -> bytes:
    return json.dumps({"model": SIM_MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "stream": stream}).encode()


async def send(port: int, body: bytes, *, hang_up_after: float | None = None,
               hang_up_at_first_chunk: bool = False, timeout: float = 60.0) -> str:
    """One request on its own connection; returns a label for the client-side tally."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        if hang_up_after is not None:
            try:
                line = await asyncio.wait_for(reader.readline(), hang_up_after)
            except TimeoutError:
                return "hung_up_waiting"
            return f"hung_up_after_{line.split(b' ')[1].decode() if line else 'eof'}"
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        status = status_line.split(b" ")[1].decode() if status_line else "eof"
        if hang_up_at_first_chunk:
            chunk = await asyncio.wait_for(reader.readuntil(b"data:"), timeout) if status == "200" else b""
            return f"hung_up_mid_stream_{status}" if chunk else status
        await asyncio.wait_for(reader.read(), timeout)
        return status
    except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
        return type(exc).__name__
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


async def client(port: int, stop: asyncio.Event, tally: Counter[str], rng: random.Random) -> None:
    while not stop.is_set():
        kind = rng.choices(KINDS, WEIGHTS)[0]
        if kind == "admit":
            label = await send(port, chat(rng.randint(1, 24), False))
        elif kind == "stream":
            label = await send(port, chat(rng.randint(8, 48), True))
        elif kind == "gone_parked":
            label = await send(port, chat(16, False), hang_up_after=rng.uniform(0.02, 0.4))
        elif kind == "gone_midstream":
            label = await send(port, chat(64, True), hang_up_at_first_chunk=True)
        elif kind == "park_long":
            label = await send(port, chat(200, True, "x" * 2000))
        else:
            label = await send(port, rng.choice(BAD_BODIES))
        tally[f"{kind}:{label}"] += 1
        # Back off after a 503 as a client honouring Retry-After would (shortened), so the mix
        # is not all queue_full; a little think time otherwise.
        await asyncio.sleep(rng.uniform(0.2, 0.6) if label.endswith("503") else rng.uniform(0.0, 0.05))


def service_metrics(admin_url: str) -> dict[str, Any]:
    status, body = http_get(f"{admin_url}/metrics", timeout=5.0)
    if status != 200:
        raise OSError(f"/metrics answered {status}")
    out: dict[str, Any] = {"outcomes": Counter(), "queue_depth": 0.0, "inflight": 0.0, "reserved": 0.0}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == "admission_admitted_total":
                out["outcomes"][s.labels.get("via", "admitted")] += int(s.value)
            elif s.name == "admission_rejected_total":
                out["outcomes"][s.labels.get("reason", "?")] += int(s.value)
            elif s.name == "admission_passthrough_total":
                out["outcomes"]["passthrough_" + s.labels.get("reason", "?")] += int(s.value)
            elif s.name == "admission_queue_depth":
                out["queue_depth"] += s.value
            elif s.name == "admission_inflight":
                out["inflight"] += s.value
            elif s.name == "admission_kv_reserved_tokens":
                out["reserved"] += s.value
    return out


def process_figures(pid: int) -> tuple[float, int]:
    """(RSS in MB, open fds) of a process, from /proc."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def report(t0: float, pid: int, admin_url: str) -> dict[str, Any]:
    rss, fds = process_figures(pid)
    m = service_metrics(admin_url)
    sample = {"t": round(time.monotonic() - t0), "rss_mb": round(rss, 1), "fds": fds,
              "queue_depth": m["queue_depth"], "inflight": m["inflight"], "kv_reserved": m["reserved"],
              "outcomes": dict(sorted(m["outcomes"].items()))}
    outcomes = " ".join(f"{k}={v}" for k, v in sample["outcomes"].items())
    print(f"t={sample['t']:>5}s rss={sample['rss_mb']:>6.1f}MB fds={fds:>3} queue={m['queue_depth']:.0f} "
          f"inflight={m['inflight']:.0f} reserved={m['reserved']:.0f} | {outcomes}", flush=True)
    return sample


async def soak(args: argparse.Namespace, stack: LocalStack) -> dict[str, Any]:
    assert stack.extproc is not None and stack.extproc.process is not None
    pid = stack.extproc.process.pid
    stop = asyncio.Event()
    tally: Counter[str] = Counter()
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    tasks = [asyncio.create_task(client(stack.envoy_port, stop, tally, random.Random(rng.random())))
             for _ in range(args.clients)]
    samples = [await asyncio.to_thread(report, t0, pid, stack.admin_url)]
    deadline = t0 + args.minutes * 60
    while time.monotonic() < deadline:
        await asyncio.sleep(min(args.every, max(0.0, deadline - time.monotonic())))
        samples.append(await asyncio.to_thread(report, t0, pid, stack.admin_url))
    stop.set()
    await asyncio.wait(tasks, timeout=120)
    for task in tasks:
        task.cancel()

    def idle() -> dict[str, Any] | None:
        m = service_metrics(stack.admin_url)
        return m if m["queue_depth"] == 0 and m["inflight"] == 0 and m["reserved"] == 0 else None

    try:
        await asyncio.to_thread(wait_until, idle, 30.0, "queue depth, in-flight and reservations back to 0")
        leak = None
    except TimeoutError as exc:
        leak = str(exc)
    final = await asyncio.to_thread(report, t0, pid, stack.admin_url)
    warm = [s for s in samples if s["t"] >= args.warmup] or samples
    return {"minutes": args.minutes, "clients": args.clients, "samples": len(samples),
            "rss_mb_after_warmup": warm[0]["rss_mb"], "rss_mb_end": final["rss_mb"],
            "rss_mb_max": max(s["rss_mb"] for s in samples + [final]),
            "fds_after_warmup": warm[0]["fds"], "fds_end": final["fds"],
            "idle_after_load": leak is None, "leak": leak,
            "final": {k: final[k] for k in ("queue_depth", "inflight", "kv_reserved")},
            "outcomes": final["outcomes"], "client_side": dict(sorted(tally.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to drive load (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between reports (default: %(default)s)")
    parser.add_argument("--warmup", type=float, default=30.0,
                        help="seconds before RSS counts as warm (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 24 * 60:
        parser.error("--minutes must be in (0, 1440]")
    env = {
        "ADMISSION_OBSERVE_MODELS": SIM_MODEL, "EXTPROC_LOG_LEVEL": "WARNING",
        "ENGINE_POLL_INTERVAL_SECONDS": "0.5", "ADMISSION_MAX_INFLIGHT": "4", "VLLM_MAX_QUEUE_DEPTH": "6",
        "ADMISSION_MAX_PARK_SECONDS": "3", "ADMISSION_RETRY_AFTER_SECONDS": "1",
    }
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        stack = LocalStack(Path(tmp), sim_args=("--log-level", "WARNING"), extproc_env=env)
        stack.start()
        print(f"soak: {args.minutes:g} min, {args.clients} clients, Envoy {stack.url}, service {stack.admin_url} "
              f"(pid {stack.extproc.process.pid if stack.extproc and stack.extproc.process else '?'})", flush=True)
        try:
            result = asyncio.run(soak(args, stack))
        finally:
            stack.stop()
    print(f"soak: RSS {result['rss_mb_after_warmup']} MB after warm-up -> {result['rss_mb_end']} MB at the end "
          f"(max {result['rss_mb_max']}), fds {result['fds_after_warmup']} -> {result['fds_end']}, "
          f"idle after load: {result['idle_after_load']}", flush=True)
    print(json.dumps(result, separators=(",", ":")))
    return 0 if result["idle_after_load"] else 1


if __name__ == "__main__":
    sys.exit(main())
