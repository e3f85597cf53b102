"""What admission control changes for the engine: a scenario through Envoy, with and without the gate.

    python -m bench.admission --scenario reference-65k --mode full [--replicas 3] [--time-scale 20]
    python -m bench.admission --scenario three-65k --all

One engine simulator (`enginesim --preset reference --time-scale K`: 9527 blocks x 16 tokens,
max_num_seqs 4, ~525 tok/s prefill, 30 tok/s decode) sits behind N Envoys (`--replicas`), each
with its own admission service in the gated modes; the load is spread round-robin over the
Envoys and sent with the official `openai` async client, streaming, so TTFT is what a client sees.

Modes:
- `none`: Envoy straight to the engine (no ext_proc filter);
- `reference`: the reference gate as it shipped: decisions from the last poll only
  (`ADMISSION_LOCAL_ACCOUNTING=false`), park while KV >= 0.90 or running + waiting >= 4, and no
  bound on Envoy's engine cluster;
- `full`: the service with its defaults (only the limits and the scaled clocks are set).

Time scale: the engine runs K times faster than real time, so the gateway's own clocks are scaled
by 1/K (poll interval 2/K s, which is also the poll timeout; park cap 300/K s; scrape grace 0.5/K
s; Retry-After stays 1 s, its minimum, since the benchmark's clients never retry). The gateway
thus polls as often per engine second as it would in production. All durations reported are
ENGINE seconds (wall seconds x K).

Prints a table, then one JSON object as the last line of stdout (see bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import functools
import json
import math
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
from prometheus_client.parser import text_string_to_metric_families

from devstack import SIM_MODEL, LocalStack, RedisServer, engine_models, http_get, wait_until
from extproc.config import DEFAULT_MAX_PARK_SECONDS
from extproc.tokenizer import DEFAULT_TOKENIZER, TOKENIZERS

from .goodput import Job, edf_goodput, measured_capacity
from .scenarios import CLASSES, SCENARIOS, LoadShape, RequestSpec, Scenario, build_requests, prompt_content
from .text import DEFAULT_TEXT, TEXT_KINDS, sized_content

MODES = ("none", "vllm-builtin", "reference", "full")
GATED_MODES = ("reference", "full")  # the modes with an admission service
POLICIES = ("strict", "projected")  # ADMISSION_POLICY (--policy): the service's admission policy
ENGINES = ("vllm-0.33", "vllm-0.11")  # the simulator's profiles (enginesim --profile)
REAL_ENGINE = "real"  # --engine real / --engine-url: the real vLLM (CPU build, `realengine`), wall clock
#: vllm-builtin: the engine runs with --max-num-queued-reqs (started so by --engine real; with
#: --engine-url, started so by whoever started it: `python -m realengine PORT --max-num-queued-reqs N`)
REAL_MODES = ("none", "vllm-builtin", "reference", "full")
REAL_SAMPLE_INTERVAL_S = 0.5  # wall seconds between /metrics samples of the real engine
REAL_IDLE_TIMEOUT_S = 180.0  # wall seconds the real engine may take to drain before and after a run
DEFAULT_TIME_SCALE = 20.0
SAMPLE_INTERVAL_S = 0.02  # wall seconds between /control/state samples
CLIENT_TIMEOUT_S = 900.0  # wall seconds; the openai client's per-request timeout
#: Engine seconds after the first send from which `gateway_estimate_ratio_window` counts requests
#: (issue 11's "after the first minute": the estimate's cold start is left out).
ESTIMATE_WINDOW_FROM_S = 60.0

# Settings that make the service behave like the reference gate: decisions from the last poll
# only. Every feature that is on by default gets its switch here, so `reference` keeps meaning
# "as it shipped" (the service ignores variables it does not know).
REFERENCE_ENV = {"ADMISSION_LOCAL_ACCOUNTING": "false", "ADMISSION_KV_BUDGET": "false",
                 "ADMISSION_WAIT_ESTIMATES": "false"}


@dataclass(frozen=True)
class BenchConfig:
    scenario: str
    mode: str
    engine: str = ENGINES[0]  # the vLLM version the simulator behaves as
    replicas: int = 1
    shared: bool = False  # the replicas' Envoys share ONE admission service (one ledger)
    ledger: str = "local"  # each replica's own ledger, or one shared ledger on a redis-server started for the run
    fault: str | None = None  # kill-replica@S or redis-restart@S+D (engine seconds after the first send)
    time_scale: float = DEFAULT_TIME_SCALE
    seed: int | None = None
    shape: LoadShape = LoadShape()
    max_inflight: int = 4
    kv_threshold: float = 0.90
    queue_depth: int = 8
    park_cap: float = DEFAULT_MAX_PARK_SECONDS  # engine seconds
    poll_interval: float = 2.0  # engine seconds
    scrape_grace: float = 0.5  # engine seconds
    extra_env: tuple[tuple[str, str], ...] = ()
    sim_args: tuple[str, ...] = ()  # extra enginesim flags, after the preset
    workdir: Path | None = None
    progress: bool = True
    text: str = DEFAULT_TEXT  # what the prompts are made of (bench.text)
    tokenizer: str = DEFAULT_TOKENIZER  # the simulator's (enginesim --tokenizer); prompts are sized with it
    output_len: str | None = None  # enginesim --output-len (None: the scenario's, else max)
    # engine seconds after the first send from which `gateway_estimate_ratio_window` counts requests
    estimate_window_from: float = ESTIMATE_WINDOW_FROM_S
    engine_url: str | None = None  # the real engine's address (--engine-url, or the one --engine real started)
    model: str = SIM_MODEL  # the model the requests name (a real engine's: its /v1/models)
    # ADMISSION_POLICY for the gated modes (--policy); None: not passed, the service's default
    policy: str | None = None

    @property
    def real(self) -> bool:
        """A real vLLM (wall clock, no /control endpoints) rather than the simulator."""
        return self.engine == REAL_ENGINE

    @property
    def builtin_queued_reqs(self) -> int:
        """vllm-builtin's --max-num-queued-reqs: what the gate lets into the engine plus its park.

        By default max in-flight + one engine queue slot + the queue depth; a scenario whose gate
        is bound by KV rather than by max in-flight names its own (`builtin_queued_reqs`)."""
        own = self.scenario_def.builtin_queued_reqs
        return own if own is not None else self.max_inflight + 1 + self.queue_depth

    @property
    def deadline(self) -> float | None:
        """Engine seconds after which a client gives up, or None."""
        return self.shape.deadline if self.shape.deadline is not None else self.scenario_def.deadline

    @property
    def gated(self) -> bool:
        return self.mode in GATED_MODES

    @property
    def scenario_def(self) -> Scenario:
        return SCENARIOS[self.scenario]

    def engine_args(self) -> list[str]:
        """The simulator's flags: the scenario's preset, the profile, the clock, and vllm-builtin's
        queue limit (what the gate holds: max in-flight + one engine queue slot + the park)."""
        args = ["--preset", self.scenario_def.preset, *self.scenario_def.sim_args, "--profile", self.engine,
                "--time-scale", f"{self.time_scale:g}", "--log-level", "WARNING", "--tokenizer", self.tokenizer]
        if self.output_len is not None:
            args += ["--output-len", self.output_len]
        if self.mode == "vllm-builtin":
            args += ["--max-num-queued-reqs", str(self.builtin_queued_reqs)]
        return [*args, *self.sim_args]

    @property
    def concurrency(self) -> int | None:
        """Closed-loop clients, or None for a scenario sent at its arrival offsets."""
        return self.shape.concurrency or self.scenario_def.concurrency

    def service_env(self) -> dict[str, str]:
        """The admission service's environment for the gated modes (clocks scaled by 1/K)."""
        k = self.time_scale
        env = {
            "ADMISSION_OBSERVE_MODELS": self.model,
            "ADMISSION_MAX_INFLIGHT": str(self.max_inflight),
            "ADMISSION_KV_THRESHOLD": f"{self.kv_threshold:g}",
            "VLLM_MAX_QUEUE_DEPTH": str(self.queue_depth),
            "ADMISSION_MAX_PARK_SECONDS": f"{self.park_cap / k:g}",
            "ENGINE_POLL_INTERVAL_SECONDS": f"{self.poll_interval / k:g}",
            "ADMISSION_SCRAPE_GRACE_SECONDS": f"{self.scrape_grace / k:g}",
            "ADMISSION_RETRY_AFTER_SECONDS": "1",
            # DEBUG: a line per admission with the service's prompt estimate, per park and per
            # answer (a few per request), and the "wait prediction" lines the report reads
            # (`Deployment.service_lines`).
            "EXTPROC_LOG_LEVEL": "DEBUG",
        }
        if self.mode == "reference":
            env.update(REFERENCE_ENV)
        if self.policy is not None:
            env["ADMISSION_POLICY"] = self.policy
        env.update(dict(self.extra_env))
        return env

    def effective_policy(self) -> str | None:
        """The policy the service runs: --policy, else its default (the ADMISSION_POLICY row of
        extproc/settings_table.py). A service without that setting ignores the variable and admits
        as `strict` does, whatever --policy says. None for the ungated modes."""
        if not self.gated:
            return None
        from extproc.settings_table import BY_ENV

        row = BY_ENV.get("ADMISSION_POLICY")
        if row is None:
            return "strict"
        return self.policy if self.policy is not None else str(row.default)


@dataclass
class RequestRecord:
    spec: RequestSpec
    replica: int
    sent: float | None = None  # wall, loop clock
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0  # chunks with text (one generated token each; the EOS token carries none)
    finish_reason: str | None = None
    outcome: str = "pending"  # completed, rejected, incomplete, gave_up (the client's deadline passed)
    reason: str | None = None
    retry_after: float | None = None  # a rejection's Retry-After, gateway seconds
    prompt_tokens: int | None = None  # the engine's count, from the stream's usage (real engine only)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.sent is None else self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None or self.sent is None else self.finished - self.sent


@dataclass
class EngineSampler:
    """Samples the engine's /control/state; keeps the peaks the engine does not report itself."""

    url: str
    samples: int = 0
    failures: int = 0
    peak_running_plus_waiting: int = 0
    peak_kv_usage: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)

    def note(self, state: dict[str, Any]) -> None:
        self.samples += 1
        self.last = state
        self.peak_running_plus_waiting = max(self.peak_running_plus_waiting, state["running"] + state["waiting"])
        self.peak_kv_usage = max(self.peak_kv_usage, state["kv_usage"])

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with session.get(f"{self.url}/control/state") as response:
                    self.note(await response.json())
            except (TimeoutError, aiohttp.ClientError, ValueError):
                self.failures += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)


def vllm_readings(text: str) -> dict[str, Any]:
    """What a real vLLM's /metrics says, summed over its ranks: the gauges sampled during a run
    (running, waiting, KV usage as a fraction) and the counters differenced over it."""
    out: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0, "preemptions": 0.0, "prompt_tokens": 0.0,
                           "generation_tokens": 0.0, "finished": {}, "kv_tokens": 0, "admission_rejections": 0.0}
    ranks_kv: list[float] = []
    for name, labels, value in _metric_samples(text):
        if name == "vllm:num_requests_running":
            out["running"] += int(value)
        elif name == "vllm:num_requests_waiting":
            out["waiting"] += int(value)
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):  # a fraction, per rank
            ranks_kv.append(value)
        elif name == "vllm:num_preemptions_total":
            out["preemptions"] += value
        elif name == "vllm:prompt_tokens_total":
            out["prompt_tokens"] += value
        elif name == "vllm:generation_tokens_total":
            out["generation_tokens"] += value
        elif name == "vllm:admission_rejections_total":  # its own queue limits (vllm-builtin)
            out["admission_rejections"] += value
        elif name == "vllm:request_success_total":
            reason = labels.get("finished_reason", "?")
            out["finished"][reason] = out["finished"].get(reason, 0.0) + value
        elif name == "vllm:cache_config_info" and labels.get("num_gpu_blocks", "").isdigit():
            out["kv_tokens"] += int(labels["num_gpu_blocks"]) * int(labels.get("block_size", "0") or 0)
    out["kv_usage"] = max(ranks_kv, default=0.0)
    return out


def read_vllm(engine_url: str, timeout: float = 30.0) -> dict[str, Any]:
    status, body = http_get(f"{engine_url}/metrics", timeout=timeout)
    if status != 200:
        raise RuntimeError(f"{engine_url}/metrics answered {status}")
    return vllm_readings(body.decode())


def wait_real_engine_idle(engine_url: str, timeout: float = REAL_IDLE_TIMEOUT_S) -> dict[str, Any]:
    """Poll the real engine until it holds no request (running + waiting == 0); its readings then."""
    readings: list[dict[str, Any]] = []

    def idle() -> bool:
        readings.append(read_vllm(engine_url))
        return readings[-1]["running"] + readings[-1]["waiting"] == 0

    wait_until(idle, timeout, f"the engine at {engine_url} idle", interval=0.5)
    return readings[-1]


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The real engine's counters over a run (after - before)."""
    reasons = sorted(set(after["finished"]) | set(before["finished"]))
    finished = {r: int(after["finished"].get(r, 0.0) - before["finished"].get(r, 0.0)) for r in reasons}
    return {"preemptions": int(after["preemptions"] - before["preemptions"]),
            "prompt_tokens": int(after["prompt_tokens"] - before["prompt_tokens"]),
            "generation_tokens": int(after["generation_tokens"] - before["generation_tokens"]),
            "finished": {r: n for r, n in finished.items() if n}, "kv_tokens": after.get("kv_tokens", 0),
            "admission_rejections": int(after["admission_rejections"] - before["admission_rejections"])}


@dataclass
class VllmSampler(EngineSampler):
    """Samples a real vLLM's /metrics (no /control endpoints there): peak running + waiting, the
    largest waiting and running, peak KV usage; `last` in EngineSampler's shape for the progress
    line (preemptions since `baseline`). In a thread of its own: the clients' event loop, parsing
    thousands of streamed chunks a second on a machine the engine keeps busy, would delay it."""

    baseline: float = 0.0  # the engine's preemption counter when the run began
    max_waiting: int = 0
    max_running: int = 0
    spans: list[tuple[float, float]] = field(default_factory=list)  # each good sample's read, monotonic clock

    def samples_within(self, start: float, end: float) -> int:
        """Good samples whose whole read fell within [start, end] (the load, on the monotonic clock
        asyncio's loop.time() also reads)."""
        return sum(1 for a, b in self.spans if start <= a and b <= end)

    def note_reading(self, reading: dict[str, Any]) -> None:
        self.note({"running": reading["running"], "waiting": reading["waiting"], "kv_usage": reading["kv_usage"],
                   "num_preemptions": int(reading["preemptions"] - self.baseline)})
        self.max_waiting = max(self.max_waiting, reading["waiting"])
        self.max_running = max(self.max_running, reading["running"])

    def sample_until(self, halt: threading.Event) -> None:
        while not halt.is_set():
            try:
                begun = time.monotonic()
                self.note_reading(read_vllm(self.url, timeout=10.0))
                self.spans.append((begun, time.monotonic()))
            except (OSError, RuntimeError, ValueError):
                self.failures += 1
            halt.wait(REAL_SAMPLE_INTERVAL_S)

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        halt = threading.Event()
        sampling = asyncio.create_task(asyncio.to_thread(self.sample_until, halt))
        try:
            await stop.wait()
        finally:
            halt.set()
            await sampling


# --- faults (shared ledger) ---------------------------------------------------------------------

LEDGER_LEASE_S = 5.0  # engine seconds: the service's default lease, scaled like its other clocks


def parse_fault(text: str) -> tuple[str, float, float]:
    """`kill-replica@S` or `redis-restart@S+D` -> (kind, at, down), engine seconds."""
    kind, sep, when = text.partition("@")
    if not sep or kind not in ("kill-replica", "redis-restart"):
        raise ValueError("must be kill-replica@S or redis-restart@S+D")
    at, _, down = when.partition("+")
    at_s, down_s = float(at), float(down or 0)
    if at_s < 0 or down_s < 0 or (kind == "redis-restart") != bool(down):
        raise ValueError("S and D are engine seconds >= 0; redis-restart needs +D, kill-replica takes none")
    return kind, at_s, down_s


def _ledger_owners(url: str) -> list[str]:
    """The replica of every ticket (parked or admitted) in the shared state of engine `default`."""
    import redis as redis_sync

    client = redis_sync.Redis.from_url(url, socket_timeout=1.0, decode_responses=True)
    try:
        state = client.hget("{llm-admission:default}:state", "state")
    finally:
        client.close()
    doc = json.loads(state) if state else {}
    return [t["o"] for t in (*doc.get("q", []), *doc.get("in", []))]


async def inject_fault(cfg: BenchConfig, deployment: Deployment, t0: float) -> dict[str, Any]:
    """Inject `cfg.fault` and measure what it cost: for a killed replica, how long its tickets
    stayed in the shared state (the capacity it held); for a Redis restart, how long until every
    replica decided on the shared state again."""
    assert cfg.fault is not None and deployment.redis is not None
    kind, at, down = parse_fault(cfg.fault)
    k, loop = cfg.time_scale, asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + at / k - loop.time()))
    report: dict[str, Any] = {"kind": kind, "at_s": at}
    if kind == "kill-replica":
        victim = deployment.stacks[-1]
        name = f"replica{len(deployment.stacks) - 1}"
        assert victim.extproc is not None and victim.extproc.process is not None
        held = _ledger_owners(deployment.redis.url).count(name)
        victim.extproc.process.send_signal(signal.SIGKILL)
        killed = loop.time()
        while _ledger_owners(deployment.redis.url).count(name):
            await asyncio.sleep(0.02)
        report.update(replica=name, tickets_held=held, capacity_returned_s=round((loop.time() - killed) * k, 2),
                      capacity_returned_wall_s=round(loop.time() - killed, 3))
    else:
        deployment.redis.stop()
        await asyncio.sleep(down / k)
        deployment.redis.start()
        restarted = loop.time()

        def all_shared() -> bool:
            for stack in deployment.stacks:
                status, body = http_get(f"{stack.admin_url}/metrics", timeout=2.0)
                degraded = (v for n, _, v in _metric_samples(body.decode()) if n == "admission_ledger_degraded")
                if status != 200 or any(degraded):
                    return False
            return True

        while not await asyncio.to_thread(all_shared):
            await asyncio.sleep(0.02)
        report.update(down_s=down, recovered_after_restart_s=round((loop.time() - restarted) * k, 2),
                      recovered_after_restart_wall_s=round(loop.time() - restarted, 3))
    return report


# --- stacks --------------------------------------------------------------------------------------


class Deployment:
    """One enginesim behind N Envoys (each with its own admission service unless mode is none)."""

    def __init__(self, cfg: BenchConfig, workdir: Path) -> None:
        gated = cfg.gated
        env = cfg.service_env()
        sim_args = cfg.engine_args()
        # The reference gate had no bound on the engine cluster: reproduce it as it shipped.
        self._envoy_args = {"bound_engines": False} if cfg.mode == "reference" else {}
        if cfg.real:  # Envoy (+ service) in front of the engine already serving at cfg.engine_url
            first = LocalStack(workdir / "replica0", engine_url=cfg.engine_url, extproc_env=env, with_extproc=gated,
                               envoy_args=self._envoy_args)
        else:
            first = LocalStack(workdir / "replica0", sim_args=sim_args, extproc_env=env, with_extproc=gated,
                               envoy_args=self._envoy_args)
        self.stacks = [first]
        self._first = first
        self._cfg = cfg
        self.redis: RedisServer | None = None
        self._workdir, self._env, self._gated = workdir, env, gated

    @property
    def engine_url(self) -> str:
        return self._first.engine_base

    def start(self) -> None:
        first, cfg = self._first, self._cfg
        if cfg.ledger == "redis" and self._gated:
            self.redis = RedisServer(self._workdir / "redis").start()
            # The lease is a gateway clock like the others: 5 s of engine time, scaled by 1/K.
            self._env = {**self._env, "ADMISSION_LEDGER": "redis", "ADMISSION_REDIS_URL": self.redis.url,
                         "ADMISSION_LEDGER_LEASE_SECONDS": f"{max(0.1, LEDGER_LEASE_S / cfg.time_scale):g}"}
            first.extproc_env = {**self._env, "ADMISSION_REPLICA_ID": "replica0"}
        first.start()
        shared = first if cfg.shared and self._gated else None
        for i in range(1, cfg.replicas):  # built once the engine's port is final
            env = {**self._env, "ADMISSION_REPLICA_ID": f"replica{i}"} if self.redis is not None else self._env
            stack = LocalStack(self._workdir / f"replica{i}", engine_url=first.engine_base, extproc_env=env,
                               with_extproc=self._gated, shared_extproc=shared, envoy_args=self._envoy_args)
            self.stacks.append(stack)
            stack.start()
        if self._cfg.gated:
            for stack in self.stacks:  # before the first good poll the service fails open
                wait_until(functools.partial(_engine_fresh, stack), 30.0, f"first good poll at {stack.admin_url}")

    def stop(self) -> None:
        for stack in reversed(self.stacks):  # the first one owns the simulator: stop it last
            stack.stop()
        if self.redis is not None:
            self.redis.stop()

    def logs(self) -> str:
        return "\n".join(stack.logs() for stack in self.stacks)

    def service_lines(self, msg: str) -> list[dict[str, Any]]:
        """The services' JSON log lines whose message is `msg`, every replica's."""
        lines: list[dict[str, Any]] = []
        for path in sorted(self._workdir.glob("replica*/extproc.log")):
            for line in path.read_text(errors="replace").splitlines():
                if f'"msg": "{msg}"' not in line:
                    continue
                with contextlib.suppress(ValueError):
                    lines.append(json.loads(line))
        return lines

    def wait_predictions(self) -> list[dict[str, Any]]:
        """The services' "wait prediction" log lines (extproc/admission.py): one per early answer and
        per parked-then-admitted request that had a prediction, gateway seconds."""
        return self.service_lines("wait prediction")

    def admitted_estimates(self) -> dict[int, int]:
        """The services' own prompt estimate of each bench request they admitted (the "admitted"
        debug line, extproc/servicer.py), by request index."""
        out = {}
        for d in self.service_lines("admitted"):
            rid, tokens = d.get("request_id", ""), d.get("prompt_tokens")
            if rid.startswith("bench-") and rid[6:].isdigit() and isinstance(tokens, int):
                out[int(rid[6:])] = tokens
        return out


def _engine_fresh(stack: LocalStack) -> bool:
    status, body = http_get(f"{stack.admin_url}/debug/engines")
    return status == 200 and json.loads(body)["default"]["state"] == "fresh"


def _metric_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def gateway_counters(stacks: Sequence[LocalStack]) -> dict[str, Any]:
    """Sums over the replicas' /metrics of the counters the report needs."""
    parked = stale = 0.0
    rejected: Counter[str] = Counter()
    admitted: Counter[str] = Counter()
    poll_failures: Counter[str] = Counter()
    degraded = expiries = 0.0
    bound: dict[str, float] = {}  # the wait bound's histograms, summed (gateway seconds)
    error_buckets: dict[float, float] = {}
    live = [s for s in stacks if s.service.extproc is not None and s.service.extproc.alive()]  # a fault may kill one
    for admin_url in dict.fromkeys(stack.admin_url for stack in live):  # a shared service once
        status, body = http_get(f"{admin_url}/metrics", timeout=5.0)
        if status != 200:
            raise RuntimeError(f"{admin_url}/metrics answered {status}")
        for name, labels, value in _metric_samples(body.decode()):
            if name == "admission_parked_total":
                parked += value
            elif name == "engine_state_stale_total":
                stale += value
            elif name == "admission_rejected_total" and value:
                rejected[labels.get("reason", "?")] += int(value)
            elif name == "admission_admitted_total" and value:
                admitted[labels.get("via", "?")] += int(value)
            elif name == "engine_poll_failures_total" and value:
                poll_failures[labels.get("reason", "?")] += int(value)
            elif name == "admission_ledger_degraded_transitions_total":
                degraded += value
            elif name == "admission_ledger_lease_expiries_total":
                expiries += value
            elif name.startswith(("admission_predicted_wait_seconds", "admission_wait_prediction_error_seconds")):
                if name.endswith("_bucket"):
                    if name.startswith("admission_wait_prediction_error"):
                        le = float(labels["le"])
                        error_buckets[le] = error_buckets.get(le, 0.0) + value
                elif name.endswith(("_sum", "_count")):
                    bound[name] = bound.get(name, 0.0) + value
            elif name in ("admission_wait_bound_violations_total", "admission_wait_bound_answers_total"):
                bound[name] = bound.get(name, 0.0) + value
            elif name == "admission_engine_throughput_bound_tokens_per_second" and math.isfinite(value):
                bound[name] = max(bound.get(name, 0.0), value)
            elif (name.startswith("admission_park_duration_seconds_") and name.endswith(("_sum", "_count"))
                  and labels.get("outcome") == "admitted_after_park"):
                bound[name] = bound.get(name, 0.0) + value
    return {"parked": int(parked), "stale_transitions": int(stale), "rejected": dict(rejected),
            "admitted": dict(admitted), "poll_failures": dict(poll_failures),
            "ledger_degraded_transitions": int(degraded), "ledger_lease_expiries": int(expiries),
            "bound": bound, "error_buckets": error_buckets}


def prediction_report(lines: Sequence[dict[str, Any]], k: float) -> dict[str, Any]:
    """Per-request predictions from the services' logs, engine seconds: each early answer (its
    prediction from the moment of the answer, how long it had waited, its size), and for parked
    requests then admitted the signed error actual - predicted (mean, p10, p50, p90)."""
    early = [{"tokens": d.get("tokens"), "waited_s": _r(d["waited"] * k),
              "predicted_s": _r(d["predicted_from_now"] * k)}
             for d in lines if d.get("outcome") == "expected_wait_too_long" and "predicted_from_now" in d]
    errors = [(d["waited"] - d["predicted"]) * k for d in lines
              if d.get("outcome") == "admitted_after_park" and "predicted" in d]
    return {
        "kind": next((d.get("kind") for d in lines), None),
        "early": sorted(early, key=lambda e: e["waited_s"] or 0.0),
        "admitted_with_prediction": len(errors),
        "error_mean_s": _r(sum(errors) / len(errors)) if errors else None,
        "error_p10_s": _r(percentile(errors, 0.10)),
        "error_p50_s": _r(percentile(errors, 0.50)),
        "error_p90_s": _r(percentile(errors, 0.90)),
        "errors_s": sorted(round(e, 1) for e in errors),
    }


def wait_bound_report(records: Sequence[RequestRecord], gateway: dict[str, Any] | None, k: float) -> dict[str, Any]:
    """The gate's wait bound (extproc/gate.py, "Waits from work") as the run saw it, engine seconds.

    From the service's metrics: how many parks and early answers had a bound and its mean; for
    parked requests then admitted, the mean of actual wait - bound (>= 0 while the bound holds),
    its cumulative distribution and the violations. From the clients: each early answer
    (`expected_wait_too_long`), in engine seconds after the request was sent.
    """
    early = sorted(round((r.finished - r.sent) * k, 1) for r in records if r.reason == "expected_wait_too_long"
                   and r.finished is not None and r.sent is not None)
    out: dict[str, Any] = {"early_answers": len(early), "early_answer_after_s": early}  # by either rule
    if gateway is None:
        return out
    b = gateway["bound"]
    predictions = b.get("admission_predicted_wait_seconds_count", 0.0)
    with_bound = b.get("admission_wait_prediction_error_seconds_count", 0.0)
    after_park = b.get("admission_park_duration_seconds_count", 0.0)
    rate = b.get("admission_engine_throughput_bound_tokens_per_second")
    out.update({
        # tokens per ENGINE second (the gateway's clock runs K times slower than the engine's)
        "throughput_bound_tok_s": _r(rate / k) if rate else None,
        "predictions": int(predictions),
        "predicted_mean_s": _r(b["admission_predicted_wait_seconds_sum"] / predictions * k) if predictions else None,
        "parked_admitted": int(after_park),
        "parked_admitted_wait_mean_s": _r(b["admission_park_duration_seconds_sum"] / after_park * k)
        if after_park else None,
        "parked_admitted_with_bound": int(with_bound),
        "error_mean_s": _r(b["admission_wait_prediction_error_seconds_sum"] / with_bound * k) if with_bound else None,
        "error_cdf": {f"<={le * k:g}s": int(n) for le, n in sorted(gateway["error_buckets"].items())
                      if math.isfinite(le)} if with_bound else {},
        "violations": int(b.get("admission_wait_bound_violations_total", 0.0)),
        "answers_by_bound": int(b.get("admission_wait_bound_answers_total", 0.0)),  # the rest: completion rate
    })
    return out


def false_early_rejections(records: Sequence[RequestRecord], park_cap: float, k: float) -> dict[str, Any]:
    """Early answers (`expected_wait_too_long`) that turned away a request which would have started
    within its park cap, by a test on the run's own data (bench/README.md, "False early rejections").

    Request R, sent at s and answered early, with park cap c (engine seconds), is a FALSE early
    rejection when either witness exists:

    - `later`: some request Q sent after R, whose class needs no less KV (prompt + max_tokens) than
      R's, had its first token before s + c: the gate admits in FIFO order and R, parked ahead of
      Q, needed no more than Q did, so R would have been admitted no later than Q, within its cap.
      Q's first token is later than its admission, so the test only undercounts. Backfill (a small
      request passing a KV-blocked head) is why Q must be no smaller than R.
    - `drained`: every request sent before R that the engine served had ended before s + c (and
      at least one did): by then nothing ahead of R held the engine (the benchmark is its only
      client), so R, which fits the engine's capacity (else it is `exceeds_kv_capacity`), would
      have been admitted; what came after R cannot delay it in FIFO order.
    """
    def cost(r: RequestRecord) -> int:
        return r.spec.prompt_tokens + r.spec.max_tokens

    early = [r for r in records if r.reason == "expected_wait_too_long" and r.sent is not None]
    false = []
    for r in early:
        assert r.sent is not None
        before = r.sent + park_cap / k
        witness = next((q for q in records if q.spec.index > r.spec.index and q.sent is not None
                        and q.sent >= r.sent and cost(q) >= cost(r) and q.first_token is not None
                        and q.first_token < before), None)
        if witness is not None:
            false.append({"i": r.spec.index, "cls": r.spec.cls.name, "witness": "later", "q": witness.spec.index,
                          "started_after_s": _r((witness.first_token - r.sent) * k)
                          if witness.first_token is not None else None})
            continue
        ahead = [q for q in records if q.spec.index < r.spec.index and q.first_token is not None]
        ends = [q.finished for q in ahead]
        if ahead and all(end is not None and end < before for end in ends):
            last = max(end for end in ends if end is not None)
            false.append({"i": r.spec.index, "cls": r.spec.cls.name, "witness": "drained",
                          "drained_after_s": _r((last - r.sent) * k)})
    return {"false_early_rejections": len(false), "early_rejections": len(early),
            "false_early_rejection_cases": false}


def engine_preemptions(engine_url: str) -> int:
    """The engine's own `vllm:num_preemptions_total`, summed over its ranks."""
    return int(engine_totals(engine_url)["preemptions"])


def engine_totals(engine_url: str) -> dict[str, float]:
    """The engine's own `vllm:num_preemptions_total` and `vllm:prompt_tokens_total` (the prompt
    tokens of the requests it started, counted once each at their first token), summed over ranks."""
    readings = read_vllm(engine_url, timeout=5.0)
    return {"preemptions": readings["preemptions"], "prompt_tokens": readings["prompt_tokens"]}


# --- load ----------------------------------------------------------------------------------------


def _rejection_reason(exc: openai.APIStatusError) -> str:
    reason = exc.response.headers.get("x-admission-outcome")
    if reason:
        return reason
    code = exc.code  # openai unwraps {"error": {...}} into .body and .code
    if isinstance(code, str) and code:
        return code
    return f"http_{exc.status_code}"


async def _send(client: openai.AsyncOpenAI, record: RequestRecord, content: str, deadline: float | None = None,
                model: str = SIM_MODEL, usage: bool = False) -> None:
    """One streamed request; with a `deadline` (wall seconds) the client gives up and disconnects.
    `usage`: ask for the stream's usage chunk (the real engine), whose counts then stand."""
    loop = asyncio.get_running_loop()
    record.sent = loop.time()
    try:
        async with asyncio.timeout(deadline):
            await _stream(client, record, content, model, usage)
    except TimeoutError:
        record.finished = loop.time()
        record.outcome, record.reason = "gave_up", "deadline"


async def _stream(client: openai.AsyncOpenAI, record: RequestRecord, content: str, model: str = SIM_MODEL,
                  usage: bool = False) -> None:
    loop = asyncio.get_running_loop()
    extra: dict[str, Any] = {}
    if usage:
        extra["stream_options"] = {"include_usage": True}
    if record.spec.cls.ignore_eos:
        extra["extra_body"] = {"ignore_eos": True}
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=record.spec.max_tokens,
            stream=True,
            extra_headers={"x-request-id": f"bench-{record.spec.index}"},
            **extra,
        )
        async with stream:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if record.first_token is None:
                        record.first_token = loop.time()
                    record.tokens += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    record.finish_reason = chunk.choices[0].finish_reason
                if chunk.usage is not None:  # the engine's own counts (a token may stream no text)
                    record.tokens = chunk.usage.completion_tokens
                    record.prompt_tokens = chunk.usage.prompt_tokens
        record.finished = loop.time()
        # a sequence the model ended (EOS: `stop`, --output-len) is as complete as one at its limit
        if record.tokens == record.spec.max_tokens or record.finish_reason == "stop":
            record.outcome = "completed"
        else:
            record.outcome, record.reason = "incomplete", f"{record.tokens}/{record.spec.max_tokens} tokens"
    except openai.APIStatusError as exc:
        record.finished = loop.time()
        record.outcome, record.reason = "rejected", _rejection_reason(exc)
        retry_after = exc.response.headers.get("retry-after")
        record.retry_after = float(retry_after) if retry_after and retry_after.isdigit() else None
    except openai.APIError as exc:  # connection errors, timeouts, an error event mid-stream
        record.finished = loop.time()
        record.outcome, record.reason = "incomplete", type(exc).__name__


def _progress_line(t: float, k: float, records: list[RequestRecord], total: int, sampler: EngineSampler) -> str:
    counts = Counter(r.outcome for r in records)
    sent = sum(1 for r in records if r.sent is not None)
    inflight = sent - counts["completed"] - counts["rejected"] - counts["incomplete"] - counts["gave_up"]
    state = sampler.last
    engine = (f" | engine running {state['running']} waiting {state['waiting']} kv {state['kv_usage']:.2f} "
              f"preempted {state['num_preemptions']}") if state else ""
    return (f"  {t:6.1f}s wall ({t * k:7.0f}s engine)  sent {sent}/{total}  completed {counts['completed']}  "
            f"rejected {counts['rejected']}  in-flight {inflight}"
            + (f"  incomplete {counts['incomplete']}" if counts["incomplete"] else "")
            + (f"  gave up {counts['gave_up']}" if counts["gave_up"] else "") + engine)


async def drive(cfg: BenchConfig, deployment: Deployment, specs: list[RequestSpec], seed: int) -> dict[str, Any]:
    """Send the scenario's load; returns the records and the engine sampler's findings."""
    k = cfg.time_scale
    clients = [
        openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="bench", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        for stack in deployment.stacks
    ]
    records = [RequestRecord(spec, spec.index % len(clients)) for spec in specs]
    deadline = cfg.deadline / k if cfg.deadline is not None else None
    if cfg.real:  # sized on the engine's own tokenizer (/tokenize), before the clock starts
        contents = await asyncio.to_thread(real_prompt_contents, cfg, specs, seed)
        before = await asyncio.to_thread(wait_real_engine_idle, deployment.engine_url)
        sampler: EngineSampler = VllmSampler(deployment.engine_url, baseline=before["preemptions"])
    else:
        contents = {spec.index: prompt_content(spec, seed, cfg.text, cfg.tokenizer) for spec in specs}
        sampler = EngineSampler(deployment.engine_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # a busy real vLLM's API server may answer /metrics late (seconds on 2 cores)
    timeout = aiohttp.ClientTimeout(total=10.0 if cfg.real else 2.0)
    send = functools.partial(_send, model=cfg.model, usage=cfg.real)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sampler_task = asyncio.create_task(sampler.run(session, stop))

        async def progress() -> None:
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                if cfg.progress:
                    print(_progress_line(loop.time() - t0, k, records, len(records), sampler), file=sys.stderr,
                          flush=True)

        async def one(record: RequestRecord) -> None:
            delay = t0 + record.spec.at / k - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(clients[record.replica], record, contents[record.spec.index], deadline)

        async def client_loop(queue: Iterator[RequestRecord]) -> None:
            for record in queue:  # closed loop: the next request as soon as this one ends
                await send(clients[record.replica], record, contents[record.spec.index], deadline)

        for client in clients:  # connections and the client's lazy set-up, before the clock starts
            await client.models.list()
        t0 = loop.time()
        progress_task = asyncio.create_task(progress())
        fault_task = asyncio.create_task(inject_fault(cfg, deployment, t0)) if cfg.fault else None
        concurrency = cfg.concurrency
        try:
            if concurrency:
                queue = iter(records)
                await asyncio.gather(*(client_loop(queue) for _ in range(concurrency)))
            else:
                await asyncio.gather(*(one(r) for r in records))
            wall = loop.time() - t0
        finally:
            stop.set()
            await asyncio.gather(sampler_task, progress_task, return_exceptions=True)
            fault = None
            if fault_task is not None:  # a fault due after the last request still happens, and is measured
                done = (await asyncio.gather(fault_task, return_exceptions=True))[0]
                fault = done if isinstance(done, dict) else {"error": repr(done)}
            for client in clients:
                await client.close()
        if cfg.real:
            return await finish_real(cfg, deployment, records, sampler, before, t0, wall, contents, specs)
        async with session.get(f"{deployment.engine_url}/control/state") as response:
            sampler.note(await response.json())
        async with session.get(f"{deployment.engine_url}/control/arrivals") as response:
            arrivals = (await response.json())["arrivals"]
        async with session.get(f"{deployment.engine_url}/control/timeline") as response:
            occupancy = await response.json()
    return {"fault": fault, "records": records, "sampler": sampler, "t0": t0, "wall": wall, "arrivals": arrivals,
            "occupancy": occupancy, "estimates": service_estimates(cfg, specs, contents)}


async def finish_real(cfg: BenchConfig, deployment: Deployment, records: list[RequestRecord], sampler: EngineSampler,
                      before: dict[str, Any], t0: float, wall: float, contents: dict[int, str],
                      specs: list[RequestSpec]) -> dict[str, Any]:
    """A real engine's run: its counters over the run, once it has drained (an aborted request
    leaves it at its next step), and each request's prompt count from its usage chunk in place of
    the simulator's arrivals; no occupancy timeline (no work-conservation figures)."""
    after = await asyncio.to_thread(wait_real_engine_idle, deployment.engine_url)
    arrivals = [{"id": f"bench-{r.spec.index}", "prompt_tokens": r.prompt_tokens}
                for r in records if r.prompt_tokens is not None]
    return {"fault": None, "records": records, "sampler": sampler, "t0": t0, "wall": wall, "arrivals": arrivals,
            "occupancy": None, "estimates": service_estimates(cfg, specs, contents),
            "engine_counters": counter_delta(after, before)}


# --- prompts sized on a real engine's tokenizer ----------------------------------------------------

TOKENIZE_TRIES = 24  # /tokenize calls per prompt at most (a secant search converges in ~4-8)


def _engine_count(engine_url: str, model: str, content: str) -> int:
    """The real engine's count of a one-message chat request's prompt (its /tokenize, template and
    generation prompt included: what it counts when the request arrives)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "add_generation_prompt": True}).encode()
    request = urllib.request.Request(f"{engine_url}/tokenize", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60.0) as response:
        return int(json.loads(response.read())["count"])


def real_prompt_content(cfg: BenchConfig, spec: RequestSpec, seed: int) -> str:
    """A user message whose chat request the real engine counts at the class's prompt tokens
    (exactly, or the closest below where no cut lands on it): the simulator's text for the class
    (bench.text, distinct per request and seed) cut where the engine's /tokenize says."""
    target = spec.prompt_tokens
    head = f"[bench request {spec.index} seed {seed} class {spec.cls.name}] "
    text = sized_content(cfg.text, target * 2, seed, spec.index, head=head, tokenizer_name="bytes4")
    assert cfg.engine_url is not None
    count = functools.partial(_engine_count, cfg.engine_url, cfg.model)
    while count(text) < target:  # 8 bytes per token is more than any byte-level tokenizer compresses
        text += text
    lo, lo_n, hi, hi_n = 0, count(""), len(text), count(text)
    for _ in range(TOKENIZE_TRIES):
        if hi - lo <= 1 or lo_n == target:
            break
        guess = lo + round((hi - lo) * (target - lo_n) / max(1, hi_n - lo_n))
        guess = min(hi - 1, max(lo + 1, guess))
        n = count(text[:guess])
        if n <= target:
            lo, lo_n = guess, n
        else:
            hi, hi_n = guess, n
    return text[:lo]


def real_prompt_contents(cfg: BenchConfig, specs: Sequence[RequestSpec], seed: int) -> dict[int, str]:
    return {spec.index: real_prompt_content(cfg, spec, seed) for spec in specs}


# --- the service's prompt estimate ---------------------------------------------------------------


def request_body(spec: RequestSpec, content: str, model: str = SIM_MODEL) -> bytes:
    """The body `_stream` sends (the openai client's JSON; key order does not matter to the service)."""
    return json.dumps({"messages": [{"role": "user", "content": content}], "model": model,
                       "max_tokens": spec.max_tokens, "stream": True}).encode()


def service_estimates(cfg: BenchConfig, specs: Sequence[RequestSpec],
                      contents: dict[int, str]) -> dict[int, int] | None:
    """The bytes rule's estimated prompt tokens for each request's body (extproc's own body facts
    and `estimate_cost`, imported, not copied), at this run's configured bytes per token: what the
    service reserves before it has learned anything and below the /tokenize threshold. The
    service's own figure, whichever source it used, is `gateway_estimate_ratio`. None (and a
    warning) where the estimator's interface is not the one this was written against."""
    from extproc import endpoints, estimate
    from extproc.config import load_settings

    env = cfg.service_env()
    try:
        settings = load_settings(env)
        bytes_per_token, safety = settings.bytes_per_token, settings.estimate_safety_factor
        endpoint = endpoints.endpoint_for("/v1/chat/completions")
        out = {}
        for spec in specs:
            body = request_body(spec, contents[spec.index], cfg.model)
            facts = endpoints.body_facts(endpoint, body, "application/json", True, bytes_per_token)
            out[spec.index] = estimate.estimate_cost(facts, bytes_per_token, safety, 0).prompt_tokens
        return out
    except (TypeError, AttributeError, ValueError) as exc:  # the estimator changed shape
        print(f"warning: cannot compute the service's estimate ({exc}); estimate_ratio omitted", file=sys.stderr)
        return None


def estimate_ratios(records: Sequence[RequestRecord], arrivals: Sequence[dict[str, Any]],
                    estimates: dict[int, int] | None) -> dict[str, Any]:
    """The service's estimated prompt tokens over the engine's counted ones, overall and per class,
    over the requests that reached the engine (the engine's count is in its arrivals)."""
    if estimates is None:
        return {"estimate_ratio": None, "estimate_ratio_by_class": {}}
    counted = {a["id"]: a.get("prompt_tokens", 0) for a in arrivals}
    est: Counter[str] = Counter()
    true: Counter[str] = Counter()
    for r in records:
        engine = counted.get(f"bench-{r.spec.index}")
        if engine and r.spec.index in estimates:
            est[r.spec.cls.name] += estimates[r.spec.index]
            true[r.spec.cls.name] += engine
    total_true = sum(true.values())
    return {
        "estimate_ratio": round(sum(est.values()) / total_true, 3) if total_true else None,
        "estimate_ratio_by_class": {c: round(est[c] / true[c], 3) for c in true},
        "engine_prompt_tokens": total_true,
        "estimated_prompt_tokens": sum(est.values()),
    }


def gateway_estimate_ratios(records: Sequence[RequestRecord], arrivals: Sequence[dict[str, Any]],
                            estimates: dict[int, int] | None, t0: float, k: float,
                            window_from: float) -> dict[str, Any]:
    """`estimate_ratios` of the services' OWN per-request estimates (`Deployment.admitted_estimates`),
    per class, and over the requests sent `window_from` engine seconds or more after the first
    send (None when there were none). Request by request, unlike `gateway_estimate_ratio`, whose
    two counters move at different moments (admission, prefill's end)."""
    if not estimates:
        return {}
    whole = estimate_ratios(records, arrivals, estimates)
    late = [r for r in records if r.sent is not None and (r.sent - t0) * k >= window_from]
    window = estimate_ratios(late, arrivals, estimates)
    return {
        "gateway_estimate_ratio_by_class": whole["estimate_ratio_by_class"],
        "gateway_estimate_ratio_window": {"from_s": window_from, "ratio": window["estimate_ratio"],
                                          "by_class": window["estimate_ratio_by_class"]}
        if window["estimate_ratio"] is not None else None,
    }


def gateway_estimate_ratio(stacks: Sequence[LocalStack], engine_url: str,
                           engine_prompt_tokens: int | None = None) -> float | None:
    """`admission_estimated_prompt_tokens_total` (where the service exports it) over the engine's
    `vllm:prompt_tokens_total` (or `engine_prompt_tokens`, a real engine's count over the run: it
    served before the run): the same ratio as the service itself accounts it."""
    estimated = None
    if any(s.service.extproc is None or not s.service.extproc.alive() for s in stacks if s.with_extproc):
        return None  # a service killed by a fault took its counters with it
    for admin_url in dict.fromkeys(stack.admin_url for stack in stacks):
        status, body = http_get(f"{admin_url}/metrics", timeout=5.0)
        if status != 200:
            return None
        for name, _, value in _metric_samples(body.decode()):
            if name == "admission_estimated_prompt_tokens_total":
                estimated = (estimated or 0.0) + value
    if estimated is None:
        return None
    if engine_prompt_tokens is not None:
        return round(estimated / engine_prompt_tokens, 3) if engine_prompt_tokens else None
    status, body = http_get(f"{engine_url}/metrics", timeout=5.0)
    engine = sum(v for name, _, v in _metric_samples(body.decode()) if name == "vllm:prompt_tokens_total")
    return round(estimated / engine, 3) if engine else None


# --- statistics and report -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def work_conservation(records: Sequence[RequestRecord], arrivals: Sequence[dict[str, Any]],
                      occupancy: dict[str, Any]) -> tuple[float, float]:
    """Wall seconds requests were held before the engine, and of those, seconds the engine had room.

    A request is held from when the client sent it until it reached the engine (or was turned
    away), less the gateway's transit: the fastest any request of its class made the trip in this
    run. It was held while the engine had room when, per the engine's own timeline, the engine held
    fewer requests than max-num-seqs AND the request's whole need (prompt + max_tokens, in blocks)
    fit beside the whole needs of the requests it held (so admitting it could never preempt).
    """
    arrived = {a["id"]: a["wall_time"] for a in arrivals if "wall_time" in a}
    transit: dict[str, float] = {}
    for r in records:
        at = arrived.get(f"bench-{r.spec.index}")
        if at is not None and r.sent is not None:
            transit[r.spec.cls.name] = min(transit.get(r.spec.cls.name, math.inf), at - r.sent)
    timeline = occupancy["timeline"]
    times = [t for t, _, _ in timeline]
    block, slots, capacity = occupancy["block_size"], occupancy["max_num_seqs"], occupancy["capacity_tokens"]
    held_s = free_s = 0.0
    for r in records:
        if r.sent is None:
            continue
        at = arrived.get(f"bench-{r.spec.index}", r.finished)
        if at is None:
            continue
        start, end = r.sent, max(r.sent, at - transit.get(r.spec.cls.name, 0.0))
        held_s += end - start
        need = -(-(r.spec.prompt_tokens + r.spec.max_tokens) // block) * block
        i = max(0, bisect.bisect_right(times, start) - 1)
        while i < len(timeline) and timeline[i][0] < end:
            seg_end = timeline[i + 1][0] if i + 1 < len(timeline) else end
            _, held, committed = timeline[i]
            if held < slots and committed + need <= capacity:
                free_s += max(0.0, min(end, seg_end) - max(start, timeline[i][0]))
            i += 1
    return held_s, free_s


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def recompute_report(records: Sequence[RequestRecord], recomputed: int | None, prefill_tokens: int | None,
                     preemptions: int, kv_tokens: int | None = None) -> dict[str, Any]:
    """Tokens the engine computed again because of preemptions, beside the prompt tokens it
    prefilled (issue 22's target: recomputed <= 1 % of prefill tokens).

    `recomputed` is the simulator's exact count (`/control/state`; None for a real engine). A real
    vLLM (0.32) exports no such counter: `vllm:prompt_tokens_total`, `prompt_tokens_by_source` and
    `prefix_cache_queries/hits` count a request's FIRST prefill only (v1/core/sched/scheduler.py
    sets `prefill_stats` only while `num_preemptions <= 0`; a resumed request's prefix-cache lookup
    goes to `PrefixCacheStats.preempted_*`, which the Prometheus logger does not export). So on a
    real engine `recomputed_tokens` is None and `recomputed_tokens_bound` is an upper bound: each
    preemption recomputes at most the context the largest request of the run ever held (prompt +
    what it generated, capped by the KV capacity), prefix-cache hits on resuming ignored."""
    out: dict[str, Any] = {"prefill_tokens": prefill_tokens, "recomputed_tokens": recomputed}
    if recomputed is not None:
        out["recomputed_share"] = round(recomputed / prefill_tokens, 5) if prefill_tokens else None
        return out
    context = max(((r.prompt_tokens or r.spec.prompt_tokens) + r.tokens for r in records), default=0)
    if kv_tokens:
        context = min(context, kv_tokens)
    bound = preemptions * context
    out["recomputed_tokens_bound"] = bound
    out["recomputed_share_bound"] = round(bound / prefill_tokens, 5) if prefill_tokens else None
    return out


def goodput_bound_report(records: Sequence[RequestRecord], deadline: float | None, lanes: int | None,
                         kv_tokens: int | None, k: float, prefill_work: int | None = None) -> dict[str, Any]:
    """`goodput_bound` (bench.goodput): the share of the run's requests an idealised engine with
    the run's own measured prefill and decode rates, `lanes` sequences at once and `kv_tokens` of
    KV would finish within their deadlines (`deadline`, wall seconds after sending), scheduled
    earliest-deadline-first. Each request's output is what it generated where it completed, else
    its max_tokens. `prefill_work`: the prompt (and recompute) tokens the engine computed over the
    run, for its achieved prefill rate. Only for scenarios with client deadlines; None where the
    run gives no rates."""
    if deadline is None or not lanes or not kv_tokens:
        return {}
    done = [((r.prompt_tokens or r.spec.prompt_tokens), r.tokens, r.ttft, r.e2e) for r in records
            if r.outcome == "completed" and r.ttft is not None and r.e2e is not None]
    sends = [r.sent for r in records if r.sent is not None]
    ends = [r.finished for r in records if r.finished is not None]
    # the engine's busy window: a request aborted mid-prefill took work after the last first token
    span = max(ends) - min(sends) if sends and ends else None
    cap = measured_capacity([(p, o, t, e) for p, o, t, e in done if t is not None and e is not None], lanes,
                            kv_tokens, prefill_work, span)
    if cap is None:
        return {"goodput_bound": None}
    jobs = [Job(r.sent, r.sent + deadline, r.prompt_tokens or r.spec.prompt_tokens,
                r.tokens if r.outcome == "completed" else r.spec.max_tokens)
            for r in records if r.sent is not None]
    n = edf_goodput(jobs, cap)
    return {"goodput_bound": round(n / len(records), 4) if records else None,
            # the idealised engine, rates per engine second
            "goodput_bound_engine": {"prefill_tok_s": _r(cap.prefill_tokens_per_s / k),
                                     "decode_tok_s": _r(cap.decode_tokens_per_s / k),
                                     "lanes": cap.lanes, "kv_tokens": cap.kv_tokens,
                                     "requests_in_time": n}}


def summarize(cfg: BenchConfig, seed: int, run: dict[str, Any], gateway: dict[str, Any] | None,
              preemptions: int) -> dict[str, Any]:
    k = cfg.time_scale
    records: list[RequestRecord] = run["records"]
    sampler: EngineSampler = run["sampler"]
    state = sampler.last
    classes = [name for name in CLASSES if any(r.spec.cls.name == name for r in records)]
    by_class = {name: [r for r in records if r.spec.cls.name == name] for name in classes}
    rejected = Counter(r.reason for r in records if r.outcome == "rejected")
    incomplete = Counter(r.reason for r in records if r.outcome == "incomplete")

    def stat(attr: str, q: float) -> dict[str, float | None]:
        out = {}
        for name, group in [*by_class.items(), ("all", records)]:
            values = [getattr(r, attr) * k for r in group if r.outcome == "completed"]
            out[name] = _r(percentile(values, q), 3)
        return out

    by_id = {f"bench-{r.spec.index}": r for r in records}
    # the order requests reached the engine: the simulator's arrivals (a real engine does not say)
    arrived = [by_id[a["id"]] for a in sorted(run["arrivals"], key=lambda a: a["arrival_time"]) if a["id"] in by_id
               ] if run.get("engine_counters") is None else []
    ends = [r.finished for r in records if r.finished is not None]
    starts = [r.sent for r in records if r.sent is not None]
    engine_counters = run.get("engine_counters")  # a real engine's counters over the run, else None
    held: tuple[float | None, float | None] = (None, None)  # no occupancy timeline from a real engine
    if run["occupancy"] is not None:
        held = work_conservation(records, run["arrivals"], run["occupancy"])
    held_s, free_s = held
    computed = {req.get("request_id"): req.get("computed_tokens", 0) for req in state.get("requests", [])}
    wasted = sum(computed.get(f"bench-{r.spec.index}", 0) for r in records if r.outcome in ("gave_up", "incomplete"))
    engine_computed = sum(computed.values())
    if engine_counters is not None:
        # what the engine counted over the run less what the completed requests' usage accounts
        # for: the prompt and generated tokens of requests that did not complete
        engine_computed = engine_counters["prompt_tokens"] + engine_counters["generation_tokens"]
        useful = sum((r.prompt_tokens or 0) + r.tokens for r in records if r.outcome == "completed")
        wasted = max(0, engine_computed - useful)
    output_tokens = sum(r.tokens for r in records if r.outcome == "completed")
    answered_no = [(r.finished - r.sent) * k for r in records
                   if r.outcome == "rejected" and r.finished is not None and r.sent is not None]
    makespan = (max(ends) - min(starts)) * k if ends and starts else None
    completed = sum(1 for r in records if r.outcome == "completed")
    result: dict[str, Any] = {
        "scenario": cfg.scenario,
        "mode": cfg.mode,
        "policy": cfg.effective_policy(),
        # --policy where the service did not run it (a service without ADMISSION_POLICY)
        **({"policy_requested": cfg.policy} if cfg.gated and cfg.policy not in (None, cfg.effective_policy())
           else {}),
        "replicas": cfg.replicas,
        "shape": "shared" if cfg.shared and cfg.gated and cfg.replicas > 1 else "sidecar",
        "ledger": cfg.ledger if cfg.gated else None,
        "engine": cfg.engine,
        "sim_preset": None if cfg.real else cfg.scenario_def.preset,  # enginesim --preset (the geometry and costs)
        "text": cfg.text,
        "tokenizer": cfg.tokenizer if not cfg.real else "engine",  # a real engine's prompts: sized by its /tokenize
        **({"output_len": cfg.output_len} if cfg.output_len else {}),
        "time_scale": k,
        "seed": seed,
        "requests": len(records),
        "completed": completed,
        "rejected": dict(sorted(rejected.items())),
        "incomplete": dict(sorted(incomplete.items())),
        "gave_up": sum(1 for r in records if r.outcome == "gave_up"),
        # completed (within the deadline, where the scenario has one) / sent
        "goodput": round(completed / len(records), 4) if records else None,
        **goodput_bound_report(
            records, cfg.deadline / k if cfg.deadline is not None else None,
            run["occupancy"]["max_num_seqs"] if run["occupancy"] is not None
            else (getattr(sampler, "max_running", 0) or None),
            run["occupancy"]["capacity_tokens"] if run["occupancy"] is not None
            else (engine_counters or {}).get("kv_tokens") or None, k,
            # the engine's prefill work: a real engine's prompt counter (first prefills only);
            # the simulator's computed tokens less the decode steps (prompts and recompute)
            engine_counters["prompt_tokens"] if engine_counters is not None
            else engine_computed - sum(max(0, r.tokens - 1) for r in records)),
        # engine seconds from send to the answer, for requests turned away (503 and the like)
        "rejected_answer_p50": _r(percentile(answered_no, 0.50), 3),
        "rejected_answer_p95": _r(percentile(answered_no, 0.95), 3),
        "requests_by_class": {name: len(group) for name, group in by_class.items()},
        "completed_by_class": {name: sum(1 for r in group if r.outcome == "completed")
                               for name, group in by_class.items()},
        "parked": gateway["parked"] if gateway else 0,
        "wait_bound": wait_bound_report(records, gateway, k),
        # early answers that turned away a request which would have started within its park cap
        **false_early_rejections(records, cfg.park_cap, k),
        **({"wait_predictions": prediction_report(run["predictions"], k)}
           if run.get("predictions") is not None else {}),
        # each request, in send order: its class, how it ended, when (engine s after sending) and,
        # for a rejection, its Retry-After (engine s)
        "per_request": [{"i": r.spec.index, "cls": r.spec.cls.name, "outcome": r.outcome, "reason": r.reason,
                         "after_s": _r((r.finished - r.sent) * k) if r.finished is not None and r.sent is not None
                         else None,
                         **({"retry_after_s": _r(r.retry_after * k)} if r.retry_after is not None else {}),
                         # a real engine's count of the prompt (the stream's usage)
                         **({"prompt_tokens": r.prompt_tokens} if r.prompt_tokens is not None else {})}
                        for r in sorted(records, key=lambda r: r.spec.index)],
        "preemptions": preemptions,
        **recompute_report(records, state.get("recomputed_tokens") if engine_counters is None else None,
                           run.get("prefill_tokens") if engine_counters is None else engine_counters["prompt_tokens"],
                           preemptions, (engine_counters or {}).get("kv_tokens") or None),
        **estimate_ratios(records, run["arrivals"], run.get("estimates")),
        **({"gateway_estimate_ratio": run["gateway_estimate_ratio"]}
           if run.get("gateway_estimate_ratio") is not None else {}),
        **gateway_estimate_ratios(records, run["arrivals"], run.get("gateway_estimates"), run["t0"], k,
                                  cfg.estimate_window_from),
        "finish_reasons": dict(Counter(r.finish_reason for r in records if r.finish_reason)),
        # per-request preemptions are the simulator's; a real engine has only its counter
        "preempted_requests": None if engine_counters is not None
        else sum(1 for r in state.get("requests", []) if r["preemptions"] > 0),
        "ttft_p50": stat("ttft", 0.50),
        "ttft_p90": stat("ttft", 0.90),
        "ttft_p95": stat("ttft", 0.95),
        "e2e_p50": stat("e2e", 0.50),
        "e2e_p95": stat("e2e", 0.95),
        "max_engine_waiting": state.get("max_waiting", getattr(sampler, "max_waiting", 0)),
        "max_engine_running": state.get("max_running", getattr(sampler, "max_running", 0)),
        "peak_engine_running_plus_waiting": max(sampler.peak_running_plus_waiting, state.get("max_waiting", 0),
                                                state.get("max_running", 0)),
        "peak_kv_usage": round(sampler.peak_kv_usage, 4),
        "makespan_s": _r(makespan),
        "throughput_rps": _r(completed / makespan, 2) if makespan else None,
        "output_tokens_per_s": _r(output_tokens / makespan, 1) if makespan else None,
        # tokens the engine computed (prefill, recompute, decode) for requests whose client gave up
        "wasted_tokens": wasted,
        "engine_computed_tokens": engine_computed,
        # work conservation (engine seconds): time held before the engine, and the part of it
        # during which the engine had room for the request (see work_conservation)
        "held_s": _r(held_s * k, 2) if held_s is not None else None,
        "parked_while_free_s": _r(free_s * k, 2) if free_s is not None else None,
        "stale_transitions": gateway["stale_transitions"] if gateway else 0,
        "ledger_degraded_transitions": gateway["ledger_degraded_transitions"] if gateway else 0,
        "ledger_lease_expiries": gateway["ledger_lease_expiries"] if gateway else 0,
        "fault": run.get("fault"),
        "poll_failures": gateway["poll_failures"] if gateway else {},
        "gateway_admitted": gateway["admitted"] if gateway else {},
        "gateway_rejected": gateway["rejected"] if gateway else {},
        # a real engine: the requests whose stream carried the engine's usage (it served them)
        "engine_arrivals": len(arrived) if engine_counters is None else len(run["arrivals"]),
        # whether the prompt classes reached the engine in the order they were sent
        "arrival_order_kept": ([r.spec.cls.name for r in arrived]
                               == [r.spec.cls.name for r in sorted(arrived, key=lambda r: r.spec.index)])
        if engine_counters is None else None,
        **({"engine_arrival_order": " ".join(r.spec.cls.name for r in arrived)}
           if engine_counters is None and len(arrived) <= 40 else {}),
        "engine_samples": sampler.samples,
        **(real_engine_report(engine_counters, sampler, run["t0"], run["wall"], cfg)
           if engine_counters is not None else {}),
        "wall_s": round(run["wall"], 2),
        "settings": {
            "max_inflight": cfg.max_inflight, "kv_threshold": cfg.kv_threshold, "queue_depth": cfg.queue_depth,
            "park_cap_s": cfg.park_cap, "poll_interval_s": cfg.poll_interval,
            **({"rate": cfg.shape.rate, "duration_s": cfg.shape.duration} if cfg.scenario == "steady"
               else {"concurrency": cfg.concurrency} if cfg.concurrency
               else {"spacing_s": cfg.shape.spacing}),
            **({"extra_env": dict(cfg.extra_env)} if cfg.extra_env else {}),
            **({"sim_args": list(cfg.sim_args)} if cfg.sim_args else {}),
        },
    }
    return result


def real_engine_report(counters: dict[str, Any], sampler: EngineSampler, t0: float, wall: float,
                       cfg: BenchConfig) -> dict[str, Any]:
    """The real engine's own figures over the run (its counters' differences), wall seconds."""
    return {
        "engine_url": cfg.engine_url,
        "model": cfg.model,
        "engine_counter_prompt_tokens": counters["prompt_tokens"],
        "engine_counter_generation_tokens": counters["generation_tokens"],
        "engine_generation_tokens_per_s": _r(counters["generation_tokens"] / wall, 1) if wall else None,
        "engine_finished": counters["finished"],
        # requests the engine's own queue limits refused (vllm:admission_rejections_total; vllm-builtin)
        "engine_admission_rejections": counters["admission_rejections"],
        "engine_sample_failures": sampler.failures,
        # samples read wholly while the load ran (the peaks can only come from these)
        "engine_samples_in_load": sampler.samples_within(t0, t0 + wall) if isinstance(sampler, VllmSampler) else None,
    }


def _fmt(value: float | None, width: int = 8) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}.3f}" if abs(value) < 10 else f"{value:>{width}.1f}"


def render_run(result: dict[str, Any]) -> str:
    lines = [
        f"scenario {result['scenario']}  engine {result['engine']}"
        + (f" (preset {result['sim_preset']})" if result.get("sim_preset") else "") + f"  mode {result['mode']}  "
        + (f"policy {result['policy']}  " if result.get("policy") else "") +
        f"replicas {result['replicas']}  "
        f"time scale {result['time_scale']:g}  seed {result['seed']}  text {result.get('text')}  "
        f"tokenizer {result.get('tokenizer')}",
        "times in wall seconds (a real engine)" if result["engine"] == REAL_ENGINE else "times in engine seconds",
        f"{'class':<11}{'sent':>6}{'done':>6}{'ttft p50':>10}{'ttft p95':>10}{'e2e p50':>10}{'e2e p95':>10}",
    ]
    for name in [*result["requests_by_class"], "all"]:
        sent = result["requests"] if name == "all" else result["requests_by_class"][name]
        done = result["completed"] if name == "all" else result["completed_by_class"][name]
        lines.append(f"{name:<11}{sent:>6}{done:>6}  {_fmt(result['ttft_p50'][name])}  {_fmt(result['ttft_p95'][name])}"
                     f"  {_fmt(result['e2e_p50'][name])}  {_fmt(result['e2e_p95'][name])}")
    rejected = ", ".join(f"{k} {v}" for k, v in result["rejected"].items()) or "none"
    lines.append(f"rejected: {rejected}" + (f"; incomplete: {result['incomplete']}" if result["incomplete"] else "")
                 + (f"; gave up: {result['gave_up']}" if result["gave_up"] else "")
                 + f"; goodput {result['goodput']}"
                 + (f" (bound {result['goodput_bound']})" if "goodput_bound" in result else ""))
    preempted = f" ({result['preempted_requests']} requests)" if result["preempted_requests"] is not None else ""
    lines.append(f"engine: preemptions {result['preemptions']}{preempted}, "
                 f"max waiting {result['max_engine_waiting']}, peak running+waiting "
                 f"{result['peak_engine_running_plus_waiting']}, peak KV {result['peak_kv_usage']:.3f}, "
                 f"recomputed tokens {recomputed_cell(result)} of {result.get('prefill_tokens')} prefilled")
    if "engine_counter_generation_tokens" in result:
        lines.append(f"engine counters over the run: prompt tokens {result['engine_counter_prompt_tokens']}, "
                     f"generated {result['engine_counter_generation_tokens']} "
                     f"({result['engine_generation_tokens_per_s']} tok/s wall), finished {result['engine_finished']}, "
                     f"refused by its own queue limits {result['engine_admission_rejections']}; "
                     f"client: output {result['output_tokens_per_s']} tok/s over the makespan, "
                     f"wasted {result['wasted_tokens']} tokens")
    if result["mode"] in GATED_MODES:
        lines.append(f"gateway: parked {result['parked']}, stale transitions {result['stale_transitions']}, "
                     f"poll failures {result['poll_failures'] or 0}, admitted {result['gateway_admitted']}")
        wb = result["wait_bound"]
        lines.append(f"wait bound: throughput bound {wb.get('throughput_bound_tok_s')} tok/s, "
                     f"{wb.get('predictions', 0)} predictions (mean {wb.get('predicted_mean_s')} s); "
                     f"parked then admitted with one {wb.get('parked_admitted_with_bound', 0)}, actual - bound mean "
                     f"{wb.get('error_mean_s')} s, violations {wb.get('violations', 0)}; early answers "
                     f"{wb['early_answers']} at {wb['early_answer_after_s']} s "
                     f"({wb.get('answers_by_bound', 0)} proved by the bound)")
        lines.append(f"false early rejections: {result['false_early_rejections']} of {result['early_rejections']} "
                     f"early answers {result['false_early_rejection_cases'] or ''}".rstrip())
    if result.get("estimate_ratio") is not None:
        by_class = ", ".join(f"{c} {v}" for c, v in result["estimate_ratio_by_class"].items())
        lines.append(f"prompt estimate / engine count: {result['estimate_ratio']} ({by_class})")
    if result.get("gateway_estimate_ratio_by_class"):
        by_class = ", ".join(f"{c} {v}" for c, v in result["gateway_estimate_ratio_by_class"].items())
        window = result.get("gateway_estimate_ratio_window")
        lines.append(f"the service's own estimate / engine count: {result.get('gateway_estimate_ratio')} ({by_class})"
                     + (f"; sent from {window['from_s']:g} s on: {window['ratio']}" if window else ""))
    held = (f", held before the engine {result['held_s']} s, of which with room at the engine "
            f"(parked_while_free_s) {result['parked_while_free_s']} s" if result["held_s"] is not None else "")
    span = (f"{result['makespan_s']} s wall" if result["engine"] == REAL_ENGINE
            else f"{result['makespan_s']} s engine ({result['wall_s']} s wall)")
    lines.append(f"makespan {span}, throughput {result['throughput_rps']} req/s{held}")
    return "\n".join(lines)


def recomputed_cell(result: dict[str, Any]) -> str:
    """The simulator's exact recompute, or a real engine's upper bound as `<=N`."""
    if result.get("recomputed_tokens") is not None:
        return str(result["recomputed_tokens"])
    if result.get("recomputed_tokens_bound") is not None:
        return f"<={result['recomputed_tokens_bound']}"
    return "-"


COMBINED_COLUMNS = (
    ("mode", 10, lambda r: r["mode"]),
    ("policy", 10, lambda r: r.get("policy") or "-"),
    ("repl", 5, lambda r: r["replicas"]),
    ("shape", 8, lambda r: r.get("shape", "sidecar")),
    ("req", 5, lambda r: r["requests"]),
    ("done", 5, lambda r: r["completed"]),
    ("rejected", 22, lambda r: ",".join(f"{k}:{v}" for k, v in r["rejected"].items()) or "0"),
    ("parked", 7, lambda r: r["parked"]),
    ("preempt", 8, lambda r: r["preemptions"]),
    ("recomp", 9, recomputed_cell),
    ("maxwait", 8, lambda r: r["max_engine_waiting"]),
    ("peak r+w", 9, lambda r: r["peak_engine_running_plus_waiting"]),
    ("peakKV", 7, lambda r: f"{r['peak_kv_usage']:.3f}"),
    ("stale", 6, lambda r: r["stale_transitions"]),
    ("makespan", 9, lambda r: r["makespan_s"]),
    ("req/s", 7, lambda r: r["throughput_rps"]),
    ("held", 8, lambda r: r["held_s"]),
    ("pwfree", 8, lambda r: r["parked_while_free_s"]),
    ("falseER", 8, lambda r: f"{r.get('false_early_rejections', 0)}/{r.get('early_rejections', 0)}"),
)


def render_combined(results: list[dict[str, Any]]) -> str:
    """One row per run, then TTFT/e2e by class (engine seconds, p50/p95)."""
    head = "".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w, _) in enumerate(COMBINED_COLUMNS))
    lines = [head]
    for r in results:
        lines.append("".join(f"{str(f(r)):>{w}}" if i else f"{str(f(r)):<{w}}"
                             for i, (_, w, f) in enumerate(COMBINED_COLUMNS)))
    classes = list(dict.fromkeys(c for r in results for c in r["requests_by_class"]))
    lines.append("")
    lines.append(f"{'mode':<10}{'repl':>5}"
                 + "".join(f"{'ttft ' + c + ' p50/p95':>22}{'e2e ' + c + ' p50/p95':>22}" for c in classes))
    for r in results:
        cells = ""
        for c in classes:
            t = f"{_fmt(r['ttft_p50'].get(c), 0).strip()}/{_fmt(r['ttft_p95'].get(c), 0).strip()}"
            e = f"{_fmt(r['e2e_p50'].get(c), 0).strip()}/{_fmt(r['e2e_p95'].get(c), 0).strip()}"
            cells += f"{t:>22}{e:>22}"
        lines.append(f"{r['mode']:<10}{r['replicas']:>5}{cells}")
    return "\n".join(lines)


# --- running -------------------------------------------------------------------------------------


def run_one(cfg: BenchConfig) -> dict[str, Any]:
    """Start the deployment, drive the scenario, collect the counters, stop everything."""
    specs, seed = build_requests(cfg.scenario, cfg.seed, cfg.shape)
    if not specs:
        raise SystemExit(f"scenario {cfg.scenario} produced no requests (raise --rate or --duration)")
    with contextlib.ExitStack() as cleanup:
        workdir = cfg.workdir
        if workdir is None:
            workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="bench-admission-")))
        workdir = workdir / f"{cfg.scenario}-{cfg.mode}-r{cfg.replicas}"
        if cfg.real:
            cfg = cleanup.enter_context(real_engine(cfg, workdir))
        deployment = Deployment(cfg, workdir)
        if cfg.progress:
            print(f"[{cfg.scenario} / {cfg.mode} / {cfg.replicas} replica(s)] starting the stack "
                  f"({len(specs)} requests, time scale {cfg.time_scale:g})", file=sys.stderr, flush=True)
        try:
            deployment.start()
            run = asyncio.run(drive(cfg, deployment, specs, seed))
            gateway = gateway_counters(deployment.stacks) if cfg.gated else None
            counters = run.get("engine_counters")
            if cfg.gated:
                run["gateway_estimate_ratio"] = gateway_estimate_ratio(
                    deployment.stacks, deployment.engine_url, counters["prompt_tokens"] if counters else None)
                run["predictions"] = deployment.wait_predictions()
                run["gateway_estimates"] = deployment.admitted_estimates()
            if counters:
                preemptions = counters["preemptions"]
            else:
                totals = engine_totals(deployment.engine_url)
                preemptions, run["prefill_tokens"] = int(totals["preemptions"]), int(totals["prompt_tokens"])
        except BaseException:
            if cfg.progress:
                print(deployment.logs()[-6000:], file=sys.stderr)
            raise
        finally:
            deployment.stop()
    return summarize(cfg, seed, run, gateway, preemptions)


@contextlib.contextmanager
def real_engine(cfg: BenchConfig, workdir: Path) -> Iterator[BenchConfig]:
    """The real engine for a run: the one at cfg.engine_url, or one started here (`--engine real`,
    realengine.VllmEngine: 40-100 s idle, minutes on a loaded machine) and stopped at the end;
    the model the requests name is its /v1/models'."""
    started = None
    if cfg.engine_url is None:
        import realengine

        if cfg.progress:
            print(f"starting the real vLLM (CPU) in {workdir / 'vllm'}: 40-100 s, minutes on a busy machine",
                  file=sys.stderr, flush=True)
        # vllm-builtin: the engine's own admission, as the simulator's (`engine_args`)
        extra = ("--max-num-queued-reqs", str(cfg.builtin_queued_reqs)) if cfg.mode == "vllm-builtin" else ()
        started = realengine.VllmEngine(workdir / "vllm", extra_args=extra)
        try:
            started.start()
        except BaseException:
            print(started.log_tail(60), file=sys.stderr)
            raise
        cfg = dataclasses.replace(cfg, engine_url=started.url)
    elif cfg.mode == "vllm-builtin" and cfg.progress:
        print(f"vllm-builtin: the engine at {cfg.engine_url} must run with --max-num-queued-reqs "
              f"{cfg.builtin_queued_reqs} (`python -m realengine PORT --max-num-queued-reqs "
              f"{cfg.builtin_queued_reqs}`); engine_admission_rejections says what it refused", file=sys.stderr)
    try:
        assert cfg.engine_url is not None
        models, reason = engine_models(cfg.engine_url)
        if not models:
            raise SystemExit(f"the engine at {cfg.engine_url} lists no model on /v1/models "
                             f"({reason or 'an empty list'})")
        yield dataclasses.replace(cfg, model=models[0])
    finally:
        if started is not None:
            started.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--scenario", required=True, choices=sorted(SCENARIOS), help="the load (see bench/README.md)")
    add("--mode", choices=MODES, help="none, vllm-builtin, reference or full (required unless --all)")
    add("--engine", choices=(*ENGINES, REAL_ENGINE), default=ENGINES[0],
        help="the vLLM version the simulator behaves as: vllm-0.33 checks that a whole prompt fits "
             "before starting it and caches prefixes; vllm-0.11 does neither. `real`: start the real vLLM "
             "(CPU build, realengine) for the run, wall clock, with a real-* scenario")
    add("--engine-url", default=None, metavar="URL",
        help="drive the real vLLM already serving at URL (e.g. `python -m realengine 8000`) instead of "
             "starting one; implies --engine real")
    add("--policy", choices=POLICIES, default=None,
        help="gated modes: the service's admission policy (ADMISSION_POLICY): strict reserves each request's "
             "whole need, projected admits on the projected KV peak; default: not passed, the service's own")
    add("--allow-reordered", action="store_true",
        help="report a run whose requests reached the engine in another order than they were sent "
             "(arrival_order_kept false) instead of failing it (exit status 3)")
    add("--all", action="store_true",
        help="run every mode with 1 and 3 replicas (or --replicas-list) and print one table")
    add("--replicas", type=int, default=1, help="Envoy (+ service) replicas in front of the one engine")
    add("--replicas-list", default="1,3", help="with --all: the replica counts to run")
    add("--shared", action="store_true",
        help="the replicas' Envoys share ONE admission service (the exact-budget shape) instead of one each")
    add("--ledger", choices=("local", "redis"), default="local",
        help="sidecar replicas' ledger: each its own (local), or one shared on a redis-server started for the run")
    add("--fault", default=None, metavar="KIND@S[+D]",
        help="with --ledger redis: kill-replica@S SIGKILLs the last replica's service S engine seconds in; "
             "redis-restart@S+D stops Redis at S and starts it again D seconds later")
    add("--time-scale", type=float, default=None,
        help="engine speed-up K; gateway clocks are scaled by 1/K (default: the scenario's, 20; three-65k 25)")
    add("--seed", type=int, default=None, help="override the scenario's fixed seed")
    add("--text", choices=TEXT_KINDS, default=DEFAULT_TEXT,
        help="what the prompts are made of (bench.text): prose, code, json (tool schemas), cjk, hex (the old "
             "benchmark text) or mixed; each prompt is sized in TRUE tokens on the simulator's tokenizer")
    add("--tokenizer", choices=TOKENIZERS, default=DEFAULT_TOKENIZER,
        help="the simulator's tokenizer (enginesim --tokenizer); bytes4 is the old ceil(bytes / 4) rule")
    add("--output-len", default=None,
        help="enginesim --output-len: where the model ends a generation (max, fixed:N, geometric:MEAN, "
             "lognormal:MEAN[:SIGMA]; default: the scenario's, else max)")
    add("--rate", type=float, default=0.03, help="steady: arrivals per engine second")
    add("--duration", type=float, default=600.0, help="steady: engine seconds of arrivals")
    add("--spacing", type=float, default=None,
        help="bursts: engine seconds between consecutive sends (fixes the arrival order; default: the "
             "scenario's, 0.5; real-burst 0.05)")
    add("--concurrency", type=int, default=None,
        help="closed-loop scenarios (short): clients sending back to back (default: the scenario's, 8)")
    add("--count", type=int, default=None, help="closed-loop scenarios: requests in all (default: the scenario's)")
    add("--deadline", type=float, default=None,
        help="engine seconds after which a client gives up and disconnects (default: the scenario's; overload: 20)")
    add("--max-inflight", type=int, default=None,
        help="ADMISSION_MAX_INFLIGHT (the engine's max-num-seqs; default: the scenario's, else 4)")
    add("--kv-threshold", type=float, default=0.90, help="ADMISSION_KV_THRESHOLD")
    add("--queue-depth", type=int, default=None,
        help="VLLM_MAX_QUEUE_DEPTH per replica (default: the scenario's, else 8)")
    add("--park-cap", type=float, default=None,
        help="ADMISSION_MAX_PARK_SECONDS in engine seconds, divided by K "
             "(default: the scenario's, else the service's, 300)")
    add("--poll-interval", type=float, default=2.0,
        help="ENGINE_POLL_INTERVAL_SECONDS in engine seconds (divided by K)")
    add("--extproc-env", action="append", default=[], metavar="KEY=VALUE",
        help="extra environment for the admission service (repeatable), e.g. to try a feature flag")
    add("--sim-arg", action="append", default=[], metavar="FLAG",
        help="extra enginesim flag (repeatable), e.g. --sim-arg=--max-num-seqs=5 (the reference's PR-2 engine)")
    add("--estimate-window-from", type=float, default=ESTIMATE_WINDOW_FROM_S, metavar="S",
        help="gated modes: gateway_estimate_ratio_window counts the requests sent S engine seconds or more "
             "after the first send (default: after the first minute)")
    add("--workdir", type=Path, default=None,
        help="keep configs and process logs here (default: a temporary directory)")
    add("--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.all and args.mode is None:
        parser.error("--mode is required unless --all is given")
    if args.engine_url is not None:
        args.engine = REAL_ENGINE
    real = args.engine == REAL_ENGINE
    # a real-* scenario also runs on the simulator (its preset, cpu-tiny, is the real engine's
    # geometry and costs: the fidelity check); the simulator's scenarios need its /control endpoints
    if real and not SCENARIOS[args.scenario].real:
        names = ", ".join(sorted(n for n, s in SCENARIOS.items() if s.real))
        parser.error(f"--scenario {args.scenario} is for the simulator; with --engine real / --engine-url "
                     f"use one of: {names}")
    if real:
        if args.all:
            parser.error("--all is for the simulator; on a real engine run --mode none and --mode full one by one")
        if args.mode not in REAL_MODES:
            parser.error(f"--mode {args.mode} is not available on a real engine (one of: {', '.join(REAL_MODES)})")
        if args.replicas != 1 or args.shared or args.ledger != "local" or args.fault:
            parser.error("a real engine is driven through one replica (no --replicas, --shared, --ledger redis "
                         "or --fault)")
        if args.sim_arg or args.output_len or args.tokenizer != DEFAULT_TOKENIZER:
            parser.error("--sim-arg, --output-len and --tokenizer are the simulator's; a real engine has its own")
        if args.time_scale not in (None, 1.0):
            parser.error("a real engine runs on the wall clock: --time-scale must be 1")
    if args.time_scale is None:
        args.time_scale = SCENARIOS[args.scenario].time_scale
    if args.time_scale <= 0 or args.replicas < 1:
        parser.error("--time-scale must be > 0 and --replicas >= 1")
    if args.estimate_window_from < 0:
        parser.error("--estimate-window-from must be >= 0 (engine seconds after the first send)")
    extra = []
    for item in args.extproc_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--extproc-env {item!r}: expected KEY=VALUE")
        extra.append((key, value))
    if args.poll_interval / args.time_scale < 0.05:
        print(f"warning: the scaled poll interval is {args.poll_interval / args.time_scale:.3f} s; on a small machine "
              "polls may time out (watch stale_transitions and poll_failures)", file=sys.stderr)
    limits = {"max_inflight": 4, "queue_depth": 8, "park_cap": DEFAULT_MAX_PARK_SECONDS,
              **dict(SCENARIOS[args.scenario].limits)}
    for name in limits:
        if getattr(args, name) is not None:
            limits[name] = getattr(args, name)
    args.max_inflight, args.queue_depth, args.park_cap = (
        int(limits["max_inflight"]), int(limits["queue_depth"]), float(limits["park_cap"]))
    if args.spacing is None:
        args.spacing = SCENARIOS[args.scenario].spacing or LoadShape.spacing
    shape = LoadShape(rate=args.rate, duration=args.duration, spacing=args.spacing, concurrency=args.concurrency,
                      count=args.count, deadline=args.deadline)
    if args.policy is not None and not args.all and args.mode not in GATED_MODES:
        parser.error(f"--policy {args.policy} sets the admission service's policy; --mode {args.mode} has no "
                     f"admission service (use --mode {' or '.join(GATED_MODES)})")
    if args.policy is not None:
        from extproc.settings_table import BY_ENV

        if "ADMISSION_POLICY" not in BY_ENV:
            print(f"warning: this service has no ADMISSION_POLICY setting: --policy {args.policy} runs as strict "
                  "(the JSON's policy says strict, policy_requested what was asked)", file=sys.stderr)
    if args.engine == "vllm-0.11" and (args.mode == "vllm-builtin"):
        parser.error("--mode vllm-builtin needs --engine vllm-0.33 (vLLM 0.11 has no --max-num-queued-reqs)")
    if args.ledger == "redis" and args.shared:
        parser.error("--ledger redis is for the sidecar shape; --shared already has one ledger")
    if args.fault is not None:
        try:
            parse_fault(args.fault)
        except ValueError as exc:
            parser.error(f"--fault {args.fault!r}: {exc}")
        if args.ledger != "redis" or args.mode not in GATED_MODES or args.replicas < 2:
            parser.error("--fault needs --ledger redis, a gated --mode and --replicas >= 2")
    base = dict(scenario=args.scenario, engine=args.engine, shared=args.shared, ledger=args.ledger, fault=args.fault,
                time_scale=args.time_scale, seed=args.seed, shape=shape, max_inflight=args.max_inflight,
                kv_threshold=args.kv_threshold,
                queue_depth=args.queue_depth, park_cap=args.park_cap, poll_interval=args.poll_interval,
                extra_env=tuple(extra), sim_args=tuple(args.sim_arg), workdir=args.workdir, progress=not args.quiet,
                text=args.text, tokenizer=args.tokenizer, output_len=args.output_len,
                estimate_window_from=args.estimate_window_from, policy=args.policy,
                engine_url=args.engine_url.rstrip("/") if args.engine_url else None)
    if not args.all:
        cfg = BenchConfig(mode=args.mode, replicas=args.replicas, **base)
        result = run_one(cfg)
        print(render_run(result))
        print(json.dumps(result))
        return arrival_order_status([result], cfg, args.allow_reordered)
    replica_counts = [int(x) for x in args.replicas_list.split(",") if x.strip()]
    results = []
    for replicas in replica_counts:
        for mode in MODES:
            if mode == "vllm-builtin" and args.engine == "vllm-0.11":
                continue  # vLLM 0.11 has no queue limits of its own
            cfg = BenchConfig(mode=mode, replicas=replicas, **{**base, "policy": args.policy if mode in GATED_MODES
                                                               else None})
            result = run_one(cfg)
            print(render_run(result), file=sys.stderr, flush=True)
            results.append(result)
    print(f"scenario {args.scenario}, time scale {args.time_scale:g}, seed {results[0]['seed']}; "
          "times in engine seconds")
    print(render_combined(results))
    print(json.dumps({"scenario": args.scenario, "time_scale": args.time_scale, "runs": results}))
    return arrival_order_status(results, BenchConfig(mode=MODES[0], **base), args.allow_reordered)


ARRIVAL_ORDER_EXIT = 3  # a run whose engine-side arrival order was not the scenario's


def arrival_order_failure(result: dict[str, Any], time_scale: float, spacing: float) -> str | None:
    """Why a run's figures are not the scenario's, or None: its requests reached the engine in
    another order than they were sent (`arrival_order_kept` false).

    Time scale K multiplies the gateway's own latency (Envoy, the service, the client) by K in
    engine time; where that exceeds the spacing between sends, a later, smaller request overtakes
    an earlier, larger one, and the engine sees another load (three-65k at K=25 on a slow machine
    delivered `65k 8k 8k 8k 8k 65k ...` and 0 preemptions instead of 20)."""
    if result.get("arrival_order_kept") is not False:
        return None
    order = result.get("engine_arrival_order")
    return (f"{result['scenario']} / {result['mode']}: the requests reached the engine in another order than they "
            f"were sent" + (f" ({order})" if order else "") + f"; at time scale {time_scale:g} the gateway's own "
            f"latency is multiplied by {time_scale:g} in engine time and exceeded the {spacing:g} engine s between "
            f"sends on this machine. The figures are not the scenario's: rerun with a smaller --time-scale "
            f"(e.g. {max(1.0, time_scale / 4):g}) or a larger --spacing, on a less loaded machine, or pass "
            f"--allow-reordered to keep them anyway")


def arrival_order_status(results: Sequence[dict[str, Any]], cfg: BenchConfig, allow: bool) -> int:
    """0, or ARRIVAL_ORDER_EXIT after naming each run whose arrival order was not kept (see
    `arrival_order_failure`); closed-loop scenarios have no fixed order and always pass."""
    if cfg.concurrency:
        return 0
    failures = [m for r in results if (m := arrival_order_failure(r, cfg.time_scale, cfg.shape.spacing))]
    for message in failures:
        print(("warning: " if allow else "error: ") + message, file=sys.stderr)
    return ARRIVAL_ORDER_EXIT if failures and not allow else 0


if __name__ == "__main__":
    sys.exit(main())
