"""Smoke test of `python -m bench.hotpath --quick`: the report is complete and self-consistent.

It checks what was measured and that every request got the answer it should, never how fast.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.hotpath import CONFIGS, chat_body

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

PER_CONFIG = ("rps_c16", "rps_c16_runs", "ext_cpu_ms_per_request", "envoy_cpu_ms_per_request", "p50_ms_c1",
              "p99_ms_200rps", "p50_ms_200rps", "ext_cpu_ms_per_request_200rps", "bad_answers")
HELD = ("parked_1kb", "parked_64kb", "admitted_open_1kb", "admitted_open_64kb")


@pytest.fixture(scope="module")
def report() -> tuple[dict, str]:
    if shutil.which("wrk") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("wrk is missing (scripts/install-system-deps.sh installs it)")
        pytest.skip("wrk not installed (Debian: apt-get install wrk; scripts/install-system-deps.sh)")
    proc = subprocess.run([sys.executable, "-m", "bench.hotpath", "--quick", "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_the_table_and_the_json_line_cover_every_configuration_and_figure(report: tuple[dict, str]) -> None:
    result, table = report
    for name in CONFIGS:
        assert set(PER_CONFIG) <= set(result[name]), sorted(set(PER_CONFIG) - set(result[name]))
        assert result[name]["rps_c16"] > 0 and result[name]["p50_ms_c1"] > 0 and result[name]["p99_ms_200rps"] > 0
        assert result[name]["bad_answers"] == 0, name  # every request was answered 200, on every path
    assert result["alone"]["ext_cpu_ms_per_request"] is None  # no ext_proc to measure
    for name in ("noop", "service"):
        assert result[name]["ext_cpu_ms_per_request"] > 0
    assert result["throughput_vs_noop"] == pytest.approx(result["service"]["rps_c16"] / result["noop"]["rps_c16"],
                                                         rel=1e-2)
    assert result["cpu_per_request_vs_noop"] > 0
    assert set(result["added_p50_ms_c1"]) == set(result["added_p99_ms_200rps"]) == {"noop", "service"}
    assert set(result["body_facts_ms"]) == {"1kb", "64kb", "1mib"}
    assert set(result["targets"]) >= {"throughput_vs_noop", "cpu_per_request_vs_noop", "rss_per_parked_kib"}
    for row in ("throughput at 16 connections", "CPU per request", "p50 at 1 connection", "p99 at 200 req/s",
                "body_facts", "exposition"):
        assert row in table


def test_every_held_request_is_held_and_none_is_answered(report: tuple[dict, str]) -> None:
    result, _ = report
    assert set(result["held_requests"]) == set(HELD)
    for key in HELD:
        row = result["held_requests"][key]
        assert row["held"] == result["held"] == 100, (key, row)  # parked, or admitted and open, all of them
        assert row["answered_early"] == 0, key
        assert row["service_rss_mib"] > 0
    assert result["rss_per_parked_kib"] == result["held_requests"]["parked_1kb"]["service_kib_per_request"]
    assert result["noop_open_1kb"]["held"] == 100 and result["noop_open_1kb"]["answered_early"] == 0


def test_the_exposition_is_a_multi_rank_one(report: tuple[dict, str]) -> None:
    result, _ = report
    assert result["exposition"]["ranks"] == 4
    assert result["exposition"]["lines"] > 1000  # real-sized: histograms for every rank
    assert result["exposition"]["parse_ms"] > 0


@pytest.mark.parametrize("size", [1024, 64 * 1024, 1 << 20])
def test_bodies_are_exactly_their_size_with_model_last(size: int) -> None:
    body = chat_body(size)
    assert len(body) == size
    doc = json.loads(body)
    assert list(doc)[-1] == "model" and doc["stream"] is False


def test_with_two_engines_every_request_is_routed_by_the_engine_the_ext_proc_names() -> None:
    if shutil.which("wrk") is None:
        pytest.skip("wrk not installed")
    argv = [sys.executable, "-m", "bench.hotpath", "--quick", "--quiet", "--skip-held", "--engines", "2"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["engines"] == 2
    for name in CONFIGS:  # a request no engine was named for would be answered 503 engine_not_selected
        assert result[name]["rps_c16"] > 0 and result[name]["bad_answers"] == 0, name
    refused = subprocess.run([sys.executable, "-m", "bench.hotpath", "--engines", "2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--skip-held" in refused.stderr
