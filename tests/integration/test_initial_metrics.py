"""Every series whose labels the configuration fixes is on /metrics at 0 before the first event,
so `rate()`, `increase()` and the alerts work on a fresh gateway instead of showing "No data"."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from devstack import free_port, http_get
from extproc.metrics import ADMITTED_VIA, PARK_ENDINGS, PASSTHROUGH_REASONS, POLL_FAILURE_REASONS
from extproc.outcomes import REJECTED_REASONS

from .conftest import Stack, two_engine_env
from .http import chat_body, post


def _samples(stack: Stack) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, body = http_get(f"{stack.local.admin_url}/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} is not on /metrics"
    return samples[key]


def test_every_configured_label_set_starts_at_zero(make_stack: Callable[..., Stack], tmp_path: Path) -> None:
    # Engine b has no engine behind it: its poll failures count up, everything else stays at 0.
    sim_port = free_port()
    stack = make_stack(two_engine_env(tmp_path, sim_port, free_port(), "other-model"), sim_port=sim_port)
    stack.wait_state(lambda s: s["state"] == "fresh", "engine a's first poll", engine="a")
    samples = _samples(stack)
    for engine, model in (("a", "sim-model"), ("b", "other-model")):
        for via in ADMITTED_VIA:
            assert _value(samples, "admission_admitted_total", engine=engine, model=model, via=via.value) == 0
        assert _value(samples, "admission_parked_total", engine=engine, model=model) == 0
        for reason in REJECTED_REASONS:
            assert _value(samples, "admission_rejected_total", engine=engine, model=model, reason=reason.value) == 0
        assert _value(samples, "admission_backfilled_total", engine=engine, model=model) == 0
        assert _value(samples, "admission_estimated_prompt_tokens_total", engine=engine, model=model) == 0
        stale = _value(samples, "engine_state_stale_total", engine=engine)
        # Engine b's failed polls make it stale after a few of them, however soon a's first poll lands.
        assert (stale == 0) if engine == "a" else (stale in (0, 1))
        for outcome in PARK_ENDINGS:
            assert _value(samples, "admission_park_duration_seconds_count", engine=engine, outcome=outcome.value) == 0
    for reason in POLL_FAILURE_REASONS:
        assert _value(samples, "engine_poll_failures_total", engine="a", reason=reason) == 0
    assert _value(samples, "engine_poll_failures_total", engine="b", reason="unreachable") >= 1
    for reason in ("timeout", "http_status", "unparsable"):
        assert _value(samples, "engine_poll_failures_total", engine="b", reason=reason) == 0
    for reason in PASSTHROUGH_REASONS:
        assert _value(samples, "admission_passthrough_total", reason=reason) == 0

    # The first event moves its own series and no other.
    assert post(stack.url + "/v1/chat/completions", chat_body(max_tokens=2)).status == 200
    after = _samples(stack)
    assert _value(after, "admission_admitted_total", engine="a", model="sim-model", via="admitted") == 1
    assert _value(after, "admission_admitted_total", engine="b", model="other-model", via="admitted") == 0
