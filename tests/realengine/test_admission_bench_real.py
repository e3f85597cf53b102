"""Smoke test of `python -m bench.admission --engine-url URL` against the session's real vLLM: the
shortest real-engine scenario (`real-short`) with and without the gate. Checks that the report is
complete and consistent with the engine's own counters, never how fast anything was."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import realengine

from .conftest import Engine

pytestmark = [pytest.mark.integration, pytest.mark.realengine]

ROOT = Path(__file__).resolve().parents[2]

FIELDS = (
    "scenario", "mode", "replicas", "engine", "time_scale", "requests", "completed", "rejected", "incomplete",
    "gave_up", "goodput", "parked", "preemptions", "ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95",
    "max_engine_waiting", "max_engine_running", "peak_engine_running_plus_waiting", "peak_kv_usage", "makespan_s",
    "throughput_rps", "output_tokens_per_s", "wasted_tokens", "engine_computed_tokens", "per_request",
    "engine_counter_prompt_tokens", "engine_counter_generation_tokens", "engine_finished", "model",
    "engine_samples_in_load",
)
#: Fields that have no meaning on a real engine: present and null (documented in bench/README.md).
NULL_ON_REAL = ("held_s", "parked_while_free_s", "preempted_requests", "arrival_order_kept")

REQUESTS, PROMPT, MAX_TOKENS = 40, 32, 16  # real-short: 40 chats of 32 prompt tokens, 16 generated


@pytest.mark.parametrize("mode", ["none", "full"])
def test_real_short_report_is_complete_and_consistent(mode: str, vllm: realengine.VllmEngine, engine: Engine,
                                                      tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.admission", "--scenario", "real-short", "--mode", mode,
         "--engine-url", vllm.url, "--workdir", str(tmp_path), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    assert all(field in result for field in FIELDS), sorted(set(FIELDS) - set(result))
    assert all(result[field] is None for field in NULL_ON_REAL), {f: result[f] for f in NULL_ON_REAL}
    assert (result["scenario"], result["mode"], result["engine"]) == ("real-short", mode, "real")
    assert (result["time_scale"], result["model"]) == (1.0, realengine.SERVED_NAME)
    # a short load: everything completes, nothing is turned away, nothing is wasted
    assert result["requests"] == result["completed"] == REQUESTS
    assert result["rejected"] == {} and result["incomplete"] == {} and result["gave_up"] == 0
    assert result["goodput"] == 1.0 and result["wasted_tokens"] == 0
    assert result["preemptions"] >= 0
    # the engine's own counters over the run add up to what the clients were served
    assert result["engine_finished"] == {"length": REQUESTS}  # ignore_eos: each ran to max_tokens
    assert result["engine_counter_generation_tokens"] == REQUESTS * MAX_TOKENS
    assert result["engine_arrivals"] == REQUESTS
    assert result["engine_prompt_tokens"] == result["engine_counter_prompt_tokens"]
    # sized on the engine's tokenizer: the class's count, or the closest cut below it
    assert all(PROMPT - 2 <= r["prompt_tokens"] <= PROMPT for r in result["per_request"]), result["per_request"]
    assert sum(r["prompt_tokens"] for r in result["per_request"]) == result["engine_counter_prompt_tokens"]
    assert result["engine_computed_tokens"] == (result["engine_counter_prompt_tokens"]
                                                + result["engine_counter_generation_tokens"])
    per_request = result["per_request"]
    assert [r["i"] for r in per_request] == list(range(REQUESTS))
    assert Counter(r["outcome"] for r in per_request) == {"completed": REQUESTS}
    # The engine's gauges stay within its geometry. That a sample taken during this short load saw
    # the requests is not asserted: vLLM publishes its gauges a few seconds late (they read 0
    # throughout one run of this test), and the counters above already show what the engine did.
    assert result["engine_samples"] >= result["engine_samples_in_load"] >= 0
    assert result["peak_engine_running_plus_waiting"] <= REQUESTS
    assert result["max_engine_running"] <= realengine.MAX_NUM_SEQS
    assert 0 <= result["peak_kv_usage"] <= 1
    assert result["makespan_s"] > 0 and result["throughput_rps"] > 0 and result["output_tokens_per_s"] > 0
    for key in ("ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95"):
        assert set(result[key]) == {"chat", "all"}
    assert 0 < result["ttft_p50"]["chat"] <= result["ttft_p95"]["chat"] <= result["e2e_p95"]["chat"]
    if mode == "none":
        assert result["parked"] == 0 and result["gateway_admitted"] == {}
    else:
        assert sum(result["gateway_admitted"].values()) == REQUESTS
        assert result["stale_transitions"] == 0
        # the gate holds the engine to max in-flight (4) + its one engine queue slot
        assert result["peak_engine_running_plus_waiting"] <= realengine.MAX_NUM_SEQS + 1

