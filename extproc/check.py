"""`extproc check URL...`: scrape an engine's metrics once and say what the service would make of them.

For each engine: whether it answers, which metrics dialect it speaks (the configured one, else
detected as the observer detects it) and, for vLLM, what that suggests about its version, which
series admission needs were found or are missing, the numbers the service would
parse (with the very parser the observer uses, `enginemetrics.parse_engine_metrics`), where the KV
capacity comes from, the effective limits (the same settings loader as `extproc serve`), and what
the gate (a real `gate.EngineGate` with those limits, fed this one scrape) would decide now for a
1k, 8k and 65k-token prompt. Nothing is sent to the engine but one GET of its metrics.

Exit status: 0 when every engine answered with every required series parsable; 1 when one was
unreachable, answered an HTTP error, lacked a required series or could not be parsed; 2 for a
configuration error (as every other subcommand).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from .admission import gate_limits
from .config import EngineConfig, Settings
from .dialects import AUTO, DIALECTS, VLLM, Dialect, detect
from .enginemetrics import EngineGauges, MetricsFormatError, parse_engine_metrics
from .gate import EngineGate, EngineSnapshot, EngineState, Ticket
from .outcomes import Outcome

#: Prompt sizes the report shows the gate's decision for.
PROMPT_SIZES = (1024, 8192, 65536)

_SAMPLE_NAME = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", re.MULTILINE)


@dataclass(frozen=True)
class Scrape:
    url: str
    status: int | None  # HTTP status, None when nothing answered
    text: str
    seconds: float
    error: str | None = None


def metrics_url(url: str) -> str:
    """An engine's metrics URL: `url` itself if it names a path, else `url` + /metrics."""
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    path = url.split("://", 1)[1].partition("/")[2]
    return url if path else f"{url}/metrics"


def scrape(url: str, timeout: float) -> Scrape:
    """One GET of the metrics, as the observer sends it (plain text, no OpenMetrics)."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
            return Scrape(url, response.status, text, time.perf_counter() - started)
    except urllib.error.HTTPError as exc:
        return Scrape(url, exc.code, "", time.perf_counter() - started, f"HTTP {exc.code} {exc.reason}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return Scrape(url, None, "", time.perf_counter() - started, f"unreachable: {reason}")


def _dialect(engine: EngineConfig, text: str, names: set[str]) -> Dialect | None:
    """The configured dialect, else the one detected; else the one any of whose families appear."""
    if engine.dialect != AUTO:
        return DIALECTS[engine.dialect]
    return detect(text) or next((d for d in DIALECTS.values() if names & set(d.samples)), None)


def engine_version(url: str, timeout: float) -> str | None:
    """The exact version a vLLM API server states at `/version` beside its metrics (None: it says none)."""
    base = url[: -len("/metrics")] if url.endswith("/metrics") else url
    try:
        with urllib.request.urlopen(f"{base}/version", timeout=timeout) as response:
            version = json.loads(response.read()).get("version")
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) and version else None


def _apparent_version(names: set[str]) -> str:
    """What the families present say about the vLLM version (vLLM exposes no version series)."""
    kv, legacy = VLLM.kv_usage, VLLM.kv_usage_fallback
    if kv not in names and legacy in names:
        return f"< 0.11 (only the legacy {legacy})"
    if kv not in names:
        return "unknown"
    recent = [n for n in VLLM.recent_families if n in names]
    if recent:
        return f">= 0.11, recent ({' / '.join(recent)}, as in 0.33)"
    return f">= 0.11 ({kv}; none of the families newer releases add)"


def _series(names: set[str], d: Dialect) -> list[dict[str, Any]]:
    kv = d.kv_usage if d.kv_usage in names or d.kv_usage_fallback not in names else d.kv_usage_fallback
    rows = [(d.running, True, "running requests"), (d.waiting, True, "waiting requests"),
            (kv, True, "KV cache usage (fraction)")]
    rows += [(name, False, "KV capacity for the token budget (else kv_capacity_tokens)")
             for name in d.capacity_families]
    return [{"name": name, "required": required, "found": name in names, "for": what}
            for name, required, what in rows]


def _engine_for(settings: Settings, url: str) -> tuple[EngineConfig, str]:
    """The configured engine whose limits apply to `url`, and how it was chosen."""
    for engine in settings.engines:
        if url in (engine.metrics_url, metrics_url(engine.url)):
            return engine, f"configured engine {engine.name!r}"
    engine = settings.engines[0]
    return engine, f"no configured engine has this URL: the limits of {engine.name!r}"


def _limits(settings: Settings, engine: EngineConfig) -> dict[str, Any]:
    limits = gate_limits(settings, engine)
    return {
        "max_inflight": limits.max_inflight,
        "engine_queue_slots": settings.effective_engine_queue_slots,
        "kv_threshold": limits.kv_threshold,
        "max_queue_depth": limits.max_queue_depth,
        "max_park_seconds": limits.max_park_seconds,
        "kv_budget": settings.kv_budget and settings.local_accounting,
        "kv_capacity_tokens": limits.kv_capacity_override,
        "default_max_tokens": settings.default_max_tokens,
        "bytes_per_token": settings.bytes_per_token,
        "stale_after_polls": limits.stale_after_polls,
        "poll_interval_s": settings.poll_interval,
    }


def _capacity(gauges: EngineGauges | None, engine: EngineConfig) -> tuple[int | None, str]:
    if gauges is not None and gauges.capacity_tokens:
        return gauges.capacity_tokens, DIALECTS[gauges.dialect].capacity_source()
    if engine.limits.kv_capacity_tokens:
        return engine.limits.kv_capacity_tokens, "configured (ADMISSION_KV_CAPACITY_TOKENS / kv_capacity_tokens)"
    return None, "the KV-token budget is inactive, only the reference gates apply"


def _gate(settings: Settings, engine: EngineConfig, gauges: EngineGauges | None) -> EngineGate:
    gate = EngineGate(gate_limits(settings, engine))
    if gauges is not None:
        gate.observe(EngineSnapshot(running=gauges.running, waiting=gauges.waiting, kv_usage=gauges.kv_usage,
                                    scrape_started=0.0, capacity_tokens=gauges.capacity_tokens,
                                    block_size=gauges.block_size), 0.0)
    return gate


def _why(gate: EngineGate, ticket: Ticket, outcome: Outcome) -> str:
    limits = gate.limits
    if outcome is Outcome.ADMITTED_FAIL_OPEN:
        return "no usable engine state: the service fails open and admits everything"
    if outcome is Outcome.EXCEEDS_KV_CAPACITY:
        return f"needs {gate.cost(ticket)} KV tokens, more than the whole cache ({gate.capacity_tokens})"
    snap = gate.snapshot
    assert snap is not None and gate.state is EngineState.FRESH
    load, available = gate.effective_load(), gate.available_tokens()
    budgeting = limits.kv_budget and limits.local_accounting
    slots = limits.max_inflight + (limits.engine_queue_slots if budgeting else 0)
    if not gate.is_open():
        if snap.kv_usage >= limits.kv_threshold:
            return f"KV usage {snap.kv_usage:.3f} >= threshold {limits.kv_threshold}"
        return f"running + waiting = {load} >= {slots} slots"
    if available is not None and gate.cost(ticket) > available:
        return f"needs {gate.cost(ticket)} KV tokens, {available} free"
    budget = f", needs {gate.cost(ticket)} of {available} free KV tokens" if available is not None else ""
    return f"running + waiting = {load} < {slots} slots, KV usage {snap.kv_usage:.3f} < {limits.kv_threshold}{budget}"


def _decisions(settings: Settings, engine: EngineConfig, gauges: EngineGauges | None) -> list[dict[str, Any]]:
    rows = []
    for prompt in PROMPT_SIZES:
        ticket = Ticket(model="check", arrived=0.0, tokens=prompt + settings.default_max_tokens)
        view = _gate(settings, engine, gauges)  # the state before the arrival, for the explanation
        outcome = _gate(settings, engine, gauges).arrive(ticket, 0.0).outcome  # arriving changes a gate
        rows.append({"prompt_tokens": prompt, "generation_tokens": settings.default_max_tokens,
                     "kv_cost_tokens": view.cost(ticket), "decision": outcome.value,
                     "why": _why(view, ticket, outcome)})
    return rows


def check_engine(settings: Settings, url: str, timeout: float) -> dict[str, Any]:
    """Everything `extproc check` reports about one engine, as a JSON-able dict; `ok` is the verdict."""
    url = metrics_url(url)
    engine, matched = _engine_for(settings, url)
    got = scrape(url, timeout)
    report: dict[str, Any] = {
        "url": url, "engine": engine.name, "limits_from": matched,
        "reachable": got.status is not None, "http_status": got.status,
        "scrape_ms": round(got.seconds * 1000, 1), "bytes": len(got.text.encode()),
        "problems": [],
    }
    gauges: EngineGauges | None = None
    if got.error is not None:
        report["problems"].append(got.error)
    else:
        names = set(_SAMPLE_NAME.findall(got.text))
        dialect = _dialect(engine, got.text, names)
        report["dialect"] = dialect.name if dialect else "unknown"
        report["dialect_from"] = "configured" if engine.dialect != AUTO else "detected"
        report["apparent_version"] = _apparent_version(names) if dialect is VLLM else None
        report["version"] = engine_version(url, timeout) if dialect is VLLM else None
        report["series"] = _series(names, dialect or VLLM)
        if dialect is None:
            known = ", ".join(d.running for d in DIALECTS.values())
            report["problems"].append(f"no known metrics dialect: none of {known}")
        for row in report["series"]:
            if row["required"] and not row["found"]:
                report["problems"].append(f"required series missing: {row['name']}")
        missing = bool(report["problems"])
        try:
            gauges = parse_engine_metrics(got.text, dialect=dialect or VLLM)
        except MetricsFormatError as exc:
            if not missing:  # else the missing series are the reason, already said
                report["problems"].append(f"the service cannot use this document: {exc}")
    capacity, source = _capacity(gauges, engine)
    report["parsed"] = None if gauges is None else {
        "running": gauges.running, "waiting": gauges.waiting, "kv_usage": gauges.kv_usage,
        "dp_ranks": gauges.ranks, "block_size": gauges.block_size,
    }
    report["capacity_tokens"] = capacity
    report["capacity_source"] = source
    report["limits"] = _limits(settings, engine)
    if gauges is not None and gauges.running > engine.limits.max_inflight:
        report["warnings"] = [
            f"the engine runs {gauges.running} requests, more than max_inflight {engine.limits.max_inflight}: "
            "max_inflight must equal the engine's --max-num-seqs"]
    report["gate"] = _decisions(settings, engine, gauges)
    report["ok"] = not report["problems"]
    return report


def render_text(reports: list[dict[str, Any]]) -> str:
    out: list[str] = []
    for r in reports:
        out.append(f"engine {r['engine']}: {r['url']}  [{'OK' if r['ok'] else 'PROBLEM'}]")
        if r["reachable"]:
            out.append(f"  scrape: HTTP {r['http_status']}, {r['bytes']} bytes in {r['scrape_ms']} ms")
        if "dialect" in r:
            version = (f", version {r['version']} (from /version)" if r.get("version") else
                       f", apparent version {r['apparent_version']}" if r.get("apparent_version") else "")
            out.append(f"  dialect: {r['dialect']} ({r['dialect_from']}){version}")
            for s in r["series"]:
                kind = "required" if s["required"] else "optional"
                out.append(f"    {'found  ' if s['found'] else 'MISSING'} {s['name']}  ({kind}: {s['for']})")
        p = r["parsed"]
        if p is not None:
            out.append(f"  parsed: running {p['running']}, waiting {p['waiting']}, KV usage {p['kv_usage']:.3f}, "
                       f"DP ranks {p['dp_ranks']}, block size {p['block_size']}")
        capacity = "unknown" if r["capacity_tokens"] is None else f"{r['capacity_tokens']} tokens"
        out.append(f"  KV capacity: {capacity} ({r['capacity_source']})")
        lim = r["limits"]
        out.append(f"  limits ({r['limits_from']}): max_inflight {lim['max_inflight']} + engine queue slots "
                   f"{lim['engine_queue_slots']}, kv_threshold {lim['kv_threshold']}, max_queue_depth "
                   f"{lim['max_queue_depth']}, max_park_seconds {lim['max_park_seconds']:g}, kv_budget "
                   f"{'on' if lim['kv_budget'] else 'off'}, default_max_tokens {lim['default_max_tokens']}")
        out.append("  the gate would decide now:")
        for d in r["gate"]:
            out.append(f"    {d['prompt_tokens']:>6}-token prompt (+{d['generation_tokens']} generation, "
                       f"{d['kv_cost_tokens']} KV): {d['decision']}: {d['why']}")
        for w in r.get("warnings", []):
            out.append(f"  WARNING: {w}")
        for problem in r["problems"]:
            out.append(f"  PROBLEM: {problem}")
    return "\n".join(out) + "\n"


def run(settings: Settings, urls: list[str], *, as_json: bool, timeout: float | None = None) -> tuple[int, str]:
    """Check `urls` (default: every configured engine); the exit status and the text to print."""
    targets = urls or [e.metrics_url for e in settings.engines]
    reports = [check_engine(settings, url, timeout or settings.poll_timeout) for url in targets]
    text = json.dumps({"engines": reports}, indent=2) + "\n" if as_json else render_text(reports)
    return (0 if all(r["ok"] for r in reports) else 1), text
