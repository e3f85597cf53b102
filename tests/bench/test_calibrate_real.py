"""bench.calibrate_real's fit: it recovers the linear cost model (with its attention term) from
measurements made with known costs, and a stretched outlier does not drag it (medians)."""

from __future__ import annotations

import math

import pytest

from bench.calibrate_real import MAX_BATCHED_TOKENS, fit

OVERHEAD, PER_SEQ, PER_TOKEN, PER_PAIR = 0.003, 0.0008, 2e-05, 1.5e-08


def prefill_row(tokens: int, stretch: float = 1.0) -> dict[str, float]:
    seconds = (math.ceil(tokens / MAX_BATCHED_TOKENS) * OVERHEAD + tokens * PER_TOKEN
               + tokens * (tokens + 1) / 2 * PER_PAIR)
    return {"prompt_tokens": tokens, "engine_prefill_s": seconds * stretch}


def decode_row(batch: int, context: int, stretch: float = 1.0) -> dict[str, float]:
    return {"batch": batch, "prompt_tokens": context, "engine_itl_s": (OVERHEAD + batch * PER_SEQ) * stretch}


def test_the_fit_recovers_known_costs_and_ignores_one_stretched_run_per_point() -> None:
    sizes = (256, 512, 1024, 2048, 4096, 8192)
    # three repeats; the third of each is a run the machine's load stretched 6x
    prefill = [prefill_row(n, s) for s in (1.0, 1.0, 6.0) for n in sizes]
    decode = [decode_row(b, c, s) for s in (1.0, 1.0, 6.0) for c in (32, 1500) for b in (1, 2, 3, 4)]
    fitted = fit(prefill, decode)
    assert fitted["step_overhead_s"] == pytest.approx(OVERHEAD, rel=1e-3)
    assert fitted["per_decode_seq_s"] == pytest.approx(PER_SEQ, rel=1e-3)
    assert fitted["per_prefill_token_s"] == pytest.approx(PER_TOKEN, rel=1e-2)
    assert fitted["per_attention_pair_s"] == pytest.approx(PER_PAIR, rel=1e-2)
