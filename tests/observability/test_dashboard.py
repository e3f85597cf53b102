"""The dashboard: generated from code, committed current, with the panels operators need, valid PromQL."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from dashboards import generate

from .dashboard_queries import concrete, panels, targets

ROOT = Path(__file__).resolve().parents[2]


def test_generator_check_mode_reports_a_stale_file(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    stale = tmp_path / "llm-admission.json"
    stale.write_text("{}\n")
    monkeypatch.setattr(generate, "DASHBOARD", stale)
    monkeypatch.setattr(generate, "CHART_FILES", tmp_path / "chart-files")  # never write into the repo here
    assert generate.main(["--check"]) == 1
    generate.main([])
    assert generate.main(["--check"]) == 0
    assert json.loads(stale.read_text())["uid"] == "llm-admission"


def test_dashboard_has_the_required_panels_on_the_right_series() -> None:
    by_title = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels()}
    required = {
        "Admission decisions per second, by outcome": ["admission_admitted_total", "admission_rejected_total"],
        "Parked and in flight": ["admission_queue_depth", "admission_inflight"],
        "Park time p50 / p95": ["histogram_quantile(0.5", "histogram_quantile(0.95",
                                "admission_park_duration_seconds_bucket"],
        "Predicted wait p50 / p90": ["histogram_quantile(0.5", "histogram_quantile(0.9",
                                     "by (le, engine, kind)", "admission_predicted_wait_seconds_bucket"],
        "Wait prediction error: actual - predicted": ["admission_wait_prediction_error_seconds_sum",
                                                      "admission_wait_prediction_error_seconds_count",
                                                      "histogram_quantile(0.9",
                                                      "admission_wait_prediction_error_seconds_bucket"],
        "Started no later than predicted": ['admission_wait_prediction_error_seconds_bucket{le=~"0|0.0"',
                                            "admission_wait_prediction_error_seconds_count"],
        "Running requests: gateway view vs vLLM": ["vllm_requests_running", "vllm[:_]num_requests_running"],
        "Waiting requests: gateway view vs vLLM": ["vllm_requests_waiting", "vllm[:_]num_requests_waiting"],
        "KV cache usage: gateway view vs vLLM": ["vllm_kv_usage_perc", "vllm[:_]kv_cache_usage_perc"],
        "Engine state stale / observer degraded": ["engine_state_is_stale", "observer_degraded"],
        "vLLM preemptions": ["vllm[:_]num_preemptions_total"],
        "vLLM time to first token p50 / p95": ["histogram_quantile(0.5", "histogram_quantile(0.95",
                                               "vllm[:_]time_to_first_token_seconds_bucket"],
        "Ledger degraded: replicas deciding alone": ["admission_ledger_degraded{",
                                                     "admission_ledger_degraded_transitions_total"],
        "Ledger round trip p50 / p99, by operation": ["histogram_quantile(0.5", "histogram_quantile(0.99",
                                                      "by (le, op)", "admission_ledger_round_trip_seconds_bucket"],
        "Ledger conflicts per second": ["admission_ledger_conflicts_total"],
        "Ledger lease expiries": ["admission_ledger_lease_expiries_total"],
        "Running over max in-flight (limit drift)": ["admission_engine_running_over_limit",
                                                     "admission_engine_limit_drift_total"],
        "CPU throttling: the service and Envoy": ["container_cpu_cfs_throttled_periods_total",
                                                  "container_cpu_cfs_periods_total", 'container=~"envoy|admission"'],
    }
    for title, needles in required.items():
        assert title in by_title, title
        joined = "\n".join(by_title[title])
        for needle in needles:
            assert needle in joined, f"{title}: no {needle}"


def test_every_panel_uses_the_datasource_variable_and_fits_the_grid() -> None:
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        assert panel["targets"] and panel["description"], panel["title"]


def test_every_query_is_valid_promql(tmp_path: Path, promtool: str) -> None:
    """promtool parses each query (variables substituted) as a recording rule."""
    rules = [{"record": f"dashboard:query_{i}", "expr": concrete(expr)} for i, (_, _, expr) in enumerate(targets())]
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
