"""Smoke test of `python -m bench.gate_cost`: it prints its table and JSON line (never how fast)."""

from __future__ import annotations

import json

import pytest

from bench.gate_cost import gate_with_open, main


def test_prints_one_row_per_open_count_and_a_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--open", "0,50", "--reps", "40", "--rounds", "1", "--per-scrape", "7"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result["us_per_arrive_finish"]) == {"0", "50"} and all(
        v > 0 for v in result["us_per_arrive_finish"].values())
    assert (result["reps"], result["rounds"], result["per_scrape"]) == (40, 1, 7)
    assert [line.split()[0] for line in lines[1:-1]] == ["0", "50"]


def test_the_gate_it_times_holds_the_open_requests_its_last_scrape_partly_saw() -> None:
    gate = gate_with_open(100)
    assert gate.inflight == 100 and gate.reserved_tokens == 100 * 1008  # 1,000 tokens in whole 16-token blocks
    # Admitted over 1-11 s; the scrape began at 8 s with a 0.5 s grace: 65 surely seen, 5 maybe,
    # and it counted 50: fewer than ours, so nothing else is at the engine.
    snap = gate.snapshot
    assert snap is not None and snap.running == 50
    assert gate.effective_load() == 100  # nobody unexplained: ours are all there is


def test_refuses_counts_it_cannot_time() -> None:
    with pytest.raises(SystemExit):
        main(["--open", "-1"])
