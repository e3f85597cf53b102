"""Smoke test of `python -m bench.admission`: the tiny `smoke` scenario in every mode, 1 and 2 replicas.

Checks that the report is complete and self-consistent, never how fast anything was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

FIELDS = (
    "scenario", "mode", "replicas", "time_scale", "requests", "completed", "rejected", "parked",
    "preemptions", "ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95", "max_engine_waiting",
    "peak_engine_running_plus_waiting", "peak_kv_usage", "makespan_s", "stale_transitions",
    "ttft_p90", "throughput_rps", "held_s", "parked_while_free_s", "engine", "gave_up", "goodput",
    "output_tokens_per_s", "wasted_tokens", "engine_computed_tokens", "false_early_rejections", "early_rejections",
)


def run_bench(*args: str, scenario: str = "smoke") -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.admission", "--scenario", scenario, "--quiet", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,  # bounds a hang, not speed: loaded, it takes minutes
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("mode", ["none", "vllm-builtin", "reference", "full"])
def test_smoke_report_is_complete_and_consistent(mode: str, replicas: int) -> None:
    result, table = run_bench("--mode", mode, "--replicas", str(replicas))

    assert all(field in result for field in FIELDS), sorted(set(FIELDS) - set(result))
    assert (result["scenario"], result["mode"], result["replicas"]) == ("smoke", mode, replicas)
    assert result["requests"] == 6
    rejected, incomplete = sum(result["rejected"].values()), sum(result["incomplete"].values())
    assert result["completed"] + rejected + incomplete + result["gave_up"] == 6
    assert result["incomplete"] == {}
    assert result["preemptions"] >= 0
    assert result["stale_transitions"] == 0
    assert result["engine_arrivals"] == result["completed"]  # a rejected request never reaches the engine
    assert result["peak_engine_running_plus_waiting"] >= result["max_engine_waiting"]
    assert 0 < result["peak_kv_usage"] <= 1
    assert result["makespan_s"] > 0
    assert result["throughput_rps"] > 0
    assert result["wasted_tokens"] == 0 and result["goodput"] == result["completed"] / 6
    # every completed request cost its prompt and all but its last token: 256 + 16 - 1
    assert result["engine_computed_tokens"] >= result["completed"] * (256 + 16 - 1)
    assert 0 <= result["parked_while_free_s"] <= result["held_s"]
    for key in ("ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95"):
        assert set(result[key]) == {"smoke", "all"}
    assert 0 < result["ttft_p50"]["smoke"] <= result["ttft_p95"]["smoke"] <= result["e2e_p95"]["smoke"]
    assert result["engine"] == "vllm-0.33"
    # One entry per request, in send order, with its class; the outcomes add up to the totals.
    per_request = result["per_request"]
    assert [r["i"] for r in per_request] == list(range(6))
    assert Counter(r["cls"] for r in per_request) == result["requests_by_class"] == {"smoke": 6}
    outcomes = Counter(r["outcome"] for r in per_request)
    assert outcomes["completed"] == result["completed"] and outcomes["gave_up"] == result["gave_up"]
    assert Counter(r["reason"] for r in per_request if r["outcome"] == "rejected") == result["rejected"]
    assert set(outcomes) <= {"completed", "rejected", "incomplete", "gave_up"}, outcomes
    assert all(r["after_s"] > 0 for r in per_request if r["outcome"] == "completed")
    if mode in ("none", "vllm-builtin"):  # no gateway: the engine's own queue (limit 4 + 1 + 8 here)
        assert result["parked"] == 0 and result["rejected"] == {}
        assert "wait_predictions" not in result
    else:
        # The services' prediction log lines, of the configured kind (the default, expected). The
        # smoke run ends before the gate has measured the engine (cold start: nothing predicted),
        # where the report has no kind and no errors.
        predictions = result["wait_predictions"]
        assert predictions["admitted_with_prediction"] == result["wait_bound"]["parked_admitted_with_bound"]
        if result["wait_bound"]["predictions"]:
            assert predictions["kind"] == "expected"
        else:
            assert predictions["kind"] is None
            assert (predictions["early"], predictions["errors_s"]) == ([], [])
        # every request the gateways saw is accounted for by their own counters
        admitted = sum(result["gateway_admitted"].values())
        assert admitted == result["completed"]
        assert result["gateway_rejected"] == result["rejected"]
        assert result["parked"] <= result["requests"]
    assert "smoke" in table and "makespan" in table


def test_all_prints_one_combined_table_and_a_json_list() -> None:
    result, table = run_bench("--all", "--replicas-list", "1")
    assert [(r["mode"], r["replicas"]) for r in result["runs"]] == [
        ("none", 1), ("vllm-builtin", 1), ("reference", 1), ("full", 1)]
    assert table.count("\nnone ") == 2 and "peak r+w" in table


def test_the_services_own_estimates_add_up_to_its_counter_and_window_by_send_time() -> None:
    # Every request reached the engine: request by request, the services' "admitted" lines and
    # the engine's counts give the same ratio as the two counters do.
    whole, table = run_bench("--mode", "full", "--estimate-window-from", "0")
    ratio = whole["gateway_estimate_ratio"]
    assert ratio > 0 and whole["gateway_estimate_ratio_by_class"] == {"smoke": ratio}
    assert whole["gateway_estimate_ratio_window"] == {"from_s": 0.0, "ratio": ratio, "by_class": {"smoke": ratio}}
    assert f"sent from 0 s on: {ratio}" in table
    # A window no request was sent in: no windowed figure.
    late, _ = run_bench("--mode", "full", "--estimate-window-from", "100000")
    assert late["gateway_estimate_ratio_window"] is None and late["gateway_estimate_ratio"] == ratio


def test_short_scenario_runs_closed_loop_with_its_concurrency() -> None:
    result, table = run_bench("--mode", "full", "--count", "24", "--concurrency", "6", scenario="short")
    assert (result["requests"], result["completed"], result["time_scale"]) == (24, 24, 1.0)
    assert result["settings"]["concurrency"] == 6
    # six clients, one request each at a time: never more than six at the gateway or the engine
    assert result["peak_engine_running_plus_waiting"] <= 6
    assert sum(result["gateway_admitted"].values()) == 24
    assert 0 <= result["parked_while_free_s"] <= result["held_s"]
    assert "throughput" in table


def test_the_older_engine_profile_and_the_engines_own_queue_limit() -> None:
    older, _ = run_bench("--mode", "none", "--engine", "vllm-0.11")
    assert (older["engine"], older["completed"]) == ("vllm-0.11", 6)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.admission", "--scenario", "smoke", "--mode", "vllm-builtin",
         "--engine", "vllm-0.11"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "vllm-builtin needs --engine vllm-0.33" in proc.stderr
    # The engine's own limit (max in-flight + 1 + queue depth = 4 + 1 + 0 = 5 here) answers the rest 503.
    limited, _ = run_bench("--mode", "vllm-builtin", "--queue-depth", "0")
    assert limited["completed"] == 5 and sum(limited["rejected"].values()) == 1


def test_clients_past_their_deadline_give_up_and_count_against_goodput() -> None:
    # Hold nothing: a deadline far below one engine step makes every client give up at once.
    result, table = run_bench("--mode", "full", "--deadline", "0.000001")
    assert (result["gave_up"], result["completed"], result["goodput"]) == (6, 0, 0.0)
    assert "gave up: 6" in table


def test_a_shared_ledger_run_survives_a_killed_replica_and_reports_the_capacity_it_held() -> None:
    result, _ = run_bench("--mode", "full", "--replicas", "2", "--ledger", "redis", "--fault", "kill-replica@1")
    assert (result["ledger"], result["replicas"]) == ("redis", 2)
    assert result["ledger_degraded_transitions"] == 0
    assert result["incomplete"] == {}
    fault = result["fault"]
    assert (fault["kind"], fault["replica"]) == ("kill-replica", "replica1")
    assert fault["capacity_returned_s"] >= 0  # the run waited until the dead replica held nothing
    # the survivor counted the tickets the dead one held (if it held any when it died)
    assert result["ledger_lease_expiries"] >= (1 if fault["tickets_held"] else 0)


def test_fault_and_ledger_options_are_refused_where_they_mean_nothing() -> None:
    for args in (("--mode", "full", "--fault", "kill-replica@1", "--replicas", "2"),  # no shared ledger
                 ("--mode", "full", "--ledger", "redis", "--fault", "reboot@1", "--replicas", "2"),
                 ("--mode", "full", "--ledger", "redis", "--fault", "redis-restart@1", "--replicas", "2"),
                 ("--mode", "full", "--ledger", "redis", "--shared", "--replicas", "2")):
        proc = subprocess.run([sys.executable, "-m", "bench.admission", "--scenario", "smoke", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, args
        assert "--fault" in proc.stderr or "--ledger" in proc.stderr


@pytest.mark.parametrize(("args", "says"), [
    (("--scenario", "smoke", "--engine-url", "http://127.0.0.1:9"), "with --engine real / --engine-url use one of"),
    (("--scenario", "real-short"), "with the simulator use one of"),
    (("--scenario", "real-short", "--engine", "real", "--replicas", "2"), "one replica"),
])
def test_the_real_engine_and_the_simulator_keep_to_their_own_scenarios(args: tuple[str, ...], says: str) -> None:
    # refused with a clear message before anything starts (no engine answers at port 9)
    proc = subprocess.run([sys.executable, "-m", "bench.admission", "--mode", "none", "--quiet", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
