"""The goodput bound (bench.goodput): an EDF schedule of the run's own requests on an idealised engine."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from bench.goodput import Capacity, Job, edf_goodput, measured_capacity

# 1,000 prompt tokens/s, 10 tokens/s per lane
CAP = Capacity(prefill_tokens_per_s=1000.0, decode_tokens_per_s=40.0, lanes=4, kv_tokens=10_000)


def test_one_request_that_fits_its_deadline_is_counted():
    # 1 s of prefill (which samples the first token) + 10 more tokens at 10 tok/s = 2 s
    assert edf_goodput([Job(0.0, 2.0, 1000, 11)], CAP) == 1
    assert edf_goodput([Job(0.0, 1.99, 1000, 11)], CAP) == 0


def test_prefill_is_serial_so_a_burst_is_bounded_by_the_prefill_rate():
    # ten 1,000-token prompts at once, 0 output, deadline 5 s: only five prefills end in time
    jobs = [Job(0.0, 5.0, 1000, 0) for _ in range(10)]
    assert edf_goodput(jobs, dataclass_replace(CAP, lanes=100)) == 5


def test_lanes_bound_the_running_set():
    # 1-token prompts, 100 tokens each (10 s per lane), deadline 10.1 s: one per lane
    jobs = [Job(0.0, 10.1, 1, 100) for _ in range(10)]
    assert edf_goodput(jobs, CAP) == 4


def test_kv_capacity_bounds_the_running_set():
    jobs = [Job(0.0, 10.1, 1, 100) for _ in range(10)]
    assert edf_goodput(jobs, dataclass_replace(CAP, kv_tokens=250)) == 2  # 101 tokens each


def test_a_request_that_cannot_make_it_costs_nothing():
    # the hopeless one (deadline before any schedule could end it) is skipped, not started
    jobs = [Job(0.0, 0.5, 1000, 0), Job(0.0, 1.0, 1000, 0)]
    assert edf_goodput(jobs, CAP) == 1


def test_earliest_deadline_first_beats_arrival_order():
    # the later arrival has the tighter deadline; FIFO would miss it, EDF makes both
    jobs = [Job(0.0, 10.0, 1000, 0), Job(0.0, 1.0, 1000, 0)]
    assert edf_goodput(jobs, CAP) == 2


def test_no_deadline_finishes_everything():
    jobs = [Job(float(i), math.inf, 500, 50) for i in range(20)]
    assert edf_goodput(jobs, CAP) == 20


def test_nonsense_capacity_is_refused():
    with pytest.raises(ValueError):
        edf_goodput([Job(0.0, 1.0, 1, 1)], dataclass_replace(CAP, prefill_tokens_per_s=0.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0.1, 30), st.integers(1, 3000), st.integers(0, 200)),
                max_size=40),
       st.integers(1, 8))
def test_the_bound_never_exceeds_the_requests_nor_what_each_alone_could_do(raw, lanes):
    cap = dataclass_replace(CAP, lanes=lanes)
    jobs = [Job(a, a + d, p, o) for a, d, p, o in raw]
    n = edf_goodput(jobs, cap)
    alone = sum(1 for j in jobs if j.prompt_tokens / cap.prefill_tokens_per_s
                + max(0, j.output_tokens - 1) / (cap.decode_tokens_per_s / lanes) <= j.deadline - j.arrival)
    assert 0 <= n <= alone <= len(jobs)


def test_measured_capacity_takes_the_fastest_prefill_and_the_least_disturbed_decode():
    completed = [(4000, 64, 0.5, 1.5), (4000, 64, 2.0, 5.0), (4000, 1, 8.0, 8.0)]
    cap = measured_capacity(completed, lanes=4, kv_tokens=20_480)
    assert cap is not None
    assert cap.prefill_tokens_per_s == 8000.0  # 4,000 tokens in the quickest TTFT, 0.5 s
    assert cap.decode_tokens_per_s == pytest.approx(63 / 1.0 * 4)  # 63 tokens in 1 s, per lane
    assert (cap.lanes, cap.kv_tokens) == (4, 20_480)
    assert measured_capacity([], 4, 100) is None


def test_an_engine_kept_busy_prefilling_measures_its_rate_by_the_work_it_did():
    # under overload every TTFT holds a long queue; the engine's own work over the run does not
    completed = [(4000, 64, 10.0, 12.0)]
    cap = measured_capacity(completed, lanes=4, kv_tokens=20_480, prefill_work=1_000_000, prefill_span_s=50.0)
    assert cap is not None and cap.prefill_tokens_per_s == 20_000.0
    # where one request's prompt / TTFT is faster, that stands
    assert measured_capacity(completed, 4, 20_480, prefill_work=100, prefill_span_s=50.0).prefill_tokens_per_s == 400.0


def dataclass_replace(cap: Capacity, **changes: float | int) -> Capacity:
    import dataclasses

    return dataclasses.replace(cap, **changes)
