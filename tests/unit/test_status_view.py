"""What the status page says about an engine, computed in pure code with an injected clock: the
rates it shows (over a window that ends now, so they fall to 0 when traffic stops) and the
engine's health (never a plain "open" gate in front of an engine whose metrics cannot be read)."""

from __future__ import annotations

import pytest

from extproc.adminhttp import engine_health
from extproc.admission import PollHealth
from extproc.gate import EngineGate, EngineSnapshot, EngineState, Ticket
from extproc.rates import rate_until_now

from .limits import COUNT_ONLY, limits

LIMITS = limits(max_inflight=64, kv_threshold=0.9, max_queue_depth=3, max_park_seconds=10.0,
                stale_after_polls=3, local_accounting=True, scrape_grace_seconds=0.5, **COUNT_ONLY)


def test_the_rate_counts_the_events_in_the_window_that_ends_now() -> None:
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert rate_until_now(times, now=5.0, window=10.0) == pytest.approx(0.5)
    assert rate_until_now(times, now=12.0, window=10.0) == pytest.approx(0.3)  # 1.0 and 2.0 have left it


def test_the_rate_decays_to_zero_once_events_stop() -> None:
    times = [float(t) for t in range(20)]  # one a second until t=19
    readings = [rate_until_now(times, now=19.0 + quiet, window=10.0) for quiet in (0, 2, 5, 9, 10, 24)]
    assert readings == sorted(readings, reverse=True)
    assert readings[0] == pytest.approx(1.0)
    assert readings[-2] == readings[-1] == 0.0


def test_a_full_bounded_history_measures_from_its_oldest_event() -> None:
    # Four kept of a faster stream: only what follows the oldest kept event is known.
    assert rate_until_now([8.0, 8.5, 9.0, 9.5], now=10.0, window=10.0, kept=4) == pytest.approx(3 / 2.0)


def test_no_events_is_a_rate_of_zero() -> None:
    assert rate_until_now([], now=100.0, window=10.0) == 0.0


def test_the_gates_shown_completion_rate_decays_to_zero_after_the_last_completion() -> None:
    gate = EngineGate(LIMITS)
    gate.observe(EngineSnapshot(running=0, waiting=0, kv_usage=0.0, scrape_started=0.0), now=0.0)
    tickets = [gate.arrive(Ticket(model="m", arrived=0.0), 0.0).ticket for _ in range(10)]
    for i, ticket in enumerate(tickets):
        gate.finish(ticket, now=1.0 + i)  # one a second, the last at t=10
    assert gate.completion_rate_until(10.0, window=10.0) == pytest.approx(1.0)
    assert 0 < gate.completion_rate_until(15.0, window=10.0) < 1.0
    assert gate.completion_rate_until(34.0, window=10.0) == 0.0  # 24 s after the load ended
    assert gate.completion_rate() == pytest.approx(1.0)  # Retry-After's rate is another, unchanged


def health(state: EngineState, failed: int = 0, reason: str | None = None, detail: str = "",
           age: float | None = 1.0, gated: bool = True) -> dict[str, object]:
    return engine_health(gated, state, PollHealth(failed, reason, detail), 3, age)


def test_a_read_engine_is_ok() -> None:
    h = health(EngineState.FRESH)
    assert (h["status"], h["level"], h["fail_open"]) == ("ok", "ok", False)


def test_an_engine_never_read_because_unreachable_fails_open_and_says_so() -> None:
    h = health(EngineState.STALE, failed=4, reason="unreachable", detail="Cannot connect to host", age=None)
    assert (h["status"], h["level"], h["fail_open"]) == ("unreachable", "bad", True)
    assert "UNREACHABLE: never read, 4 failed polls (engine unreachable: Cannot connect to host)" in str(h["headline"])
    assert str(h["headline"]).endswith("admission OFF: failing open")


def test_an_engine_not_yet_polled_is_not_read_yet() -> None:
    h = health(EngineState.UNKNOWN, age=None)
    assert (h["status"], h["fail_open"]) == ("never_read", True)


def test_a_stale_engine_names_the_age_of_its_last_good_poll() -> None:
    h = health(EngineState.STALE, failed=5, reason="timeout", age=12.34)
    assert (h["status"], h["level"], h["fail_open"], h["last_good_age_s"]) == ("stale", "bad", True, 12.34)
    assert "last good poll 12.3 s ago; admission OFF: failing open" in str(h["headline"])


def test_unparsable_metrics_are_degraded_before_and_after_the_threshold() -> None:
    before = health(EngineState.FRESH, failed=1, reason="unparsable", detail="no running gauge")
    assert (before["status"], before["level"], before["fail_open"]) == ("degraded", "warn", False)
    assert "the gate still decides on the last good poll" in str(before["headline"])
    after = health(EngineState.STALE, failed=3, reason="unparsable", age=3.0)
    assert (after["status"], after["level"], after["fail_open"]) == ("degraded", "bad", True)


def test_failed_polls_below_the_threshold_are_a_warning_not_ok() -> None:
    h = health(EngineState.FRESH, failed=2, reason="unreachable")
    assert (h["status"], h["level"], h["fail_open"]) == ("failing", "warn", False)


def test_an_ungated_engine_is_not_polled() -> None:
    h = health(EngineState.UNKNOWN, age=None, gated=False)
    assert (h["status"], h["fail_open"]) == ("not_polled", False)
