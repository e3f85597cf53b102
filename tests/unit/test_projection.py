"""The projected-KV policy's pure pieces: length models, progress, the peak projection."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from extproc.projection import (
    HistogramLength,
    Holding,
    LimitLength,
    OracleLength,
    estimate_progress,
    histogram_delta,
    projected_peak,
    smooth_histogram,
)

INF = math.inf
# 100 requests: 50 ended by 64 tokens, 30 more by 256, 20 at up to 1024.
BUCKETS = ((16.0, 10.0), (64.0, 50.0), (256.0, 80.0), (1024.0, 100.0), (INF, 100.0))


def simulate_peak(holdings: list[Holding], block: int) -> int:
    """Step the batch one decode token at a time and keep the largest block-rounded total."""
    peak, s = 0, 0
    horizon = max((h.remaining for h in holdings), default=0)
    while s <= horizon:
        total = sum(h.requests * math.ceil((h.held + min(h.remaining, s)) / block) * block
                    for h in holdings if h.remaining >= s)
        peak = max(peak, total)
        s += 1
    return peak


holding = st.builds(Holding, held=st.integers(0, 300), remaining=st.integers(0, 120), requests=st.integers(1, 3))


@settings(max_examples=200, deadline=None)
@given(st.lists(holding, max_size=8), st.sampled_from([1, 4, 16]))
def test_projected_peak_bounds_the_stepwise_peak_by_at_most_a_block_per_request(holdings, block):
    peak = projected_peak(holdings, block)
    truth = simulate_peak(holdings, block)
    assert truth <= peak <= truth + sum(h.requests for h in holdings) * (block - 1)


def test_projected_peak_is_at_a_finish_instant_not_the_sum_of_finals():
    # A: 100 held, 10 to go; B: 100 held, 1,000 to go. Strict would sum 110 + 1,100.
    peak = projected_peak([Holding(100, 10), Holding(100, 1000)], 1)
    assert peak == max(110 + 110, 1100)


def test_limit_length_is_the_limit():
    assert LimitLength().final_length(5, 300, 0.9) == 300


def test_oracle_knows_each_length_and_can_understate_it():
    oracle = OracleLength({1: 40})
    assert oracle.final_length(0, 100, 0.5, key=1) == 40
    assert oracle.final_length(0, 100, 0.5, key=2) == 100  # unknown: the limit
    assert OracleLength({1: 40}, scale=0.5).final_length(0, 100, 0.5, key=1) == 20


def test_histogram_quantile_interpolates_within_its_bucket():
    model = HistogramLength.from_buckets(BUCKETS)
    assert model is not None
    assert model.final_length(0, 4096, 0.5) == 64  # half the mass is at or below 64
    assert model.final_length(0, 4096, 0.65) == 160  # halfway through the 64..256 bucket
    assert model.final_length(0, 100, 0.9) == 100  # capped by the limit


def test_histogram_quantile_conditions_on_what_was_generated():
    model = HistogramLength.from_buckets(BUCKETS)
    assert model is not None
    # Having made 257 tokens, only the 20 long ones remain: their median is the middle of 256..1024.
    assert model.final_length(257, 4096, 0.5) == 640
    assert model.final_length(2000, 4096, 0.5) == 4096  # it outlived every length seen: its limit


def test_histogram_quantile_in_the_inf_bucket_is_the_limit():
    model = HistogramLength.from_buckets(((16.0, 1.0), (INF, 10.0)))
    assert model is not None
    assert model.final_length(0, 777, 0.5) == 777


@given(st.integers(0, 1500), st.integers(1, 2000), st.floats(0.01, 0.99), st.floats(0.01, 0.99))
def test_histogram_quantile_is_monotone_in_q_and_within_bounds(generated, limit, q1, q2):
    model = HistogramLength.from_buckets(BUCKETS)
    assert model is not None
    lo, hi = sorted((q1, q2))
    a, b = model.final_length(generated, limit, lo), model.final_length(generated, limit, hi)
    assert a <= b
    assert min(generated, limit) <= a and b <= max(limit, generated)


def test_histogram_delta_is_what_finished_between_scrapes_and_none_after_a_restart():
    after = tuple((le, c * 2) for le, c in BUCKETS)
    delta, finished = histogram_delta(BUCKETS, after)
    assert finished == 100 and delta is not None and delta.counts == (10.0, 40.0, 30.0, 20.0, 0.0)
    assert histogram_delta(after, BUCKETS) == (None, 0.0)


def test_smoothing_moves_toward_the_new_distribution_by_its_weight():
    old = HistogramLength((10.0, INF), (1.0, 0.0))
    new = HistogramLength((10.0, INF), (0.0, 1.0))
    mixed = smooth_histogram(old, new, 8, 32)
    assert mixed.counts == (0.75, 0.25)


def test_progress_prefills_then_decodes_and_stops_at_the_limit():
    assert estimate_progress(1.0, 1000, 50, 500.0, 10.0) == estimate_progress(1.0, 1000, 50, 500.0, 10.0)
    assert estimate_progress(1.0, 1000, 50, 500.0, 10.0).generated == 0  # still prefilling
    assert estimate_progress(1.0, 1000, 50, 500.0, 10.0).lag == 10  # one more second of prefill
    assert estimate_progress(3.0, 1000, 50, 500.0, 10.0).generated == 10
    assert estimate_progress(60.0, 1000, 50, 500.0, 10.0).generated == 50


def test_progress_without_rates_is_nothing_generated_and_unknown():
    progress = estimate_progress(60.0, 1000, 50, None, 10.0)
    assert (progress.generated, progress.known) == (0, False)
