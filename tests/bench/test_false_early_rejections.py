"""`bench.admission.false_early_rejections`: early answers that turned away a request which would
have started within its park cap, by a witness from the run's own data."""

from __future__ import annotations

from bench.admission import RequestRecord, false_early_rejections
from bench.scenarios import CLASSES, RequestSpec

CAP = 20.0  # engine seconds; time scale 1 below


def record(index: int, sent: float, cls: str = "rag", first_token: float | None = None,
           finished: float | None = None, early: bool = False) -> RequestRecord:
    r = RequestRecord(RequestSpec(index, CLASSES[cls], 0.0), replica=0, sent=sent, first_token=first_token,
                      finished=finished)
    if early:
        r.outcome, r.reason = "rejected", "expected_wait_too_long"
    return r


def test_a_later_request_no_smaller_that_started_within_the_cap_is_a_witness() -> None:
    ahead = record(0, 0.0, first_token=1.0, finished=60.0)  # still running past the cap: no drain
    r = record(1, 1.0, early=True, finished=2.0)
    later = record(2, 2.0, first_token=15.0, finished=30.0)  # started 14 s after R was sent
    report = false_early_rejections([ahead, r, later], CAP, 1.0)
    assert (report["false_early_rejections"], report["early_rejections"]) == (1, 1)
    assert report["false_early_rejection_cases"] == [
        {"i": 1, "cls": "rag", "witness": "later", "q": 2, "started_after_s": 14.0}]


def test_a_smaller_later_request_or_one_started_after_the_cap_is_no_witness() -> None:
    ahead = record(0, 0.0, first_token=1.0, finished=60.0)
    r = record(1, 1.0, early=True, finished=2.0)
    smaller = record(2, 2.0, cls="short", first_token=5.0, finished=6.0)  # backfill may pass R
    too_late = record(3, 3.0, first_token=25.0, finished=40.0)  # after R's cap (1 + 20)
    report = false_early_rejections([ahead, r, smaller, too_late], CAP, 1.0)
    assert (report["false_early_rejections"], report["early_rejections"]) == (0, 1)


def test_everything_ahead_ended_within_the_cap_is_a_witness() -> None:
    ahead = record(0, 0.0, first_token=1.0, finished=12.0)
    never_served = record(1, 0.5, early=True, finished=1.0)  # answered too: held nothing
    r = record(2, 1.0, early=True, finished=2.0)
    report = false_early_rejections([ahead, never_served, r], CAP, 1.0)
    assert report["false_early_rejections"] == 2
    assert report["false_early_rejection_cases"][1] == {"i": 2, "cls": "rag", "witness": "drained",
                                                        "drained_after_s": 11.0}


def test_the_cap_is_in_engine_seconds_and_the_clients_clock_in_wall_seconds() -> None:
    ahead = record(0, 0.0, first_token=0.1, finished=0.9)  # 18 engine seconds at K = 20
    r = record(1, 0.05, early=True, finished=0.1)
    assert false_early_rejections([ahead, r], CAP, 20.0)["false_early_rejections"] == 1
    assert false_early_rejections([ahead, r], CAP, 40.0)["false_early_rejections"] == 0
