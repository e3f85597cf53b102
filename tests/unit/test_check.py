"""`extproc check`: one scrape of a real exposition (the engine simulator's, or a served document),
read by the service's own parser and decided by a real gate with the service's limits."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from devstack import free_port
from enginesim.scheduler import SchedulerConfig
from extproc.check import metrics_url
from extproc.cli import main
from tests.enginesim.conftest import FAST, Sim, make_sim  # noqa: F401  (fixture)

REFERENCE = SchedulerConfig(num_gpu_blocks=9527, block_size=16, max_num_seqs=4, max_num_batched_tokens=2048,
                            max_model_len=131072, cost=FAST)  # the reference incident's engine: 152,432 tokens
ENV = {"ADMISSION_OBSERVE_MODELS": "sim-model"}


async def _check(capsys: pytest.CaptureFixture[str], *urls: str, env: dict[str, str] | None = None,
                 json_out: bool = True) -> tuple[int, Any]:
    argv = ["check", *(["--json"] if json_out else []), "--timeout", "2", *urls]
    status = await asyncio.to_thread(main, argv, {**ENV, **(env or {})})
    out = capsys.readouterr().out
    return status, json.loads(out) if json_out else out


def _one(doc: dict[str, Any]) -> dict[str, Any]:
    (report,) = doc["engines"]
    return report


def _decisions(report: dict[str, Any]) -> dict[int, str]:
    return {row["prompt_tokens"]: row["decision"] for row in report["gate"]}


@pytest.fixture
async def reference(make_sim: Callable[..., Awaitable[Sim]]) -> Sim:  # noqa: F811
    return await make_sim(scheduler=REFERENCE)


async def test_an_idle_engine_parses_and_admits_what_fits(reference: Sim, capsys: pytest.CaptureFixture[str]) -> None:
    status, doc = await _check(capsys, reference.base_url)
    r = _one(doc)
    assert status == 0 and r["ok"] and r["problems"] == []
    assert r["url"] == reference.base_url + "/metrics" and r["http_status"] == 200
    assert r["dialect"] == "vllm" and r["apparent_version"].startswith(">= 0.11, recent")
    assert all(s["found"] for s in r["series"])
    assert r["parsed"] == {"running": 0, "waiting": 0, "kv_usage": 0.0, "dp_ranks": 1, "block_size": 16}
    assert r["capacity_tokens"] == 152432 and r["capacity_source"].startswith("vllm:cache_config_info")
    assert r["limits"]["max_inflight"] == 4 and r["limits"]["kv_budget"] is True
    # 65,536 + 1,024 generation allowance fits 152,432 free tokens.
    assert _decisions(r) == {1024: "admitted", 8192: "admitted", 65536: "admitted"}
    assert r["gate"][2]["kv_cost_tokens"] == 66560


async def test_a_busy_engine_parks_and_says_why(reference: Sim, capsys: pytest.CaptureFixture[str]) -> None:
    await reference.control("pin", {"running": 4, "waiting": 1})
    status, doc = await _check(capsys, reference.base_url)
    r = _one(doc)
    assert status == 0  # a full engine is not a problem with its metrics
    assert _decisions(r) == {1024: "parked", 8192: "parked", 65536: "parked"}
    assert r["gate"][0]["why"] == "running + waiting = 5 >= 5 slots"

    await reference.control("pin", {"running": 1, "waiting": 0, "kv_usage": 0.6})
    r = _one((await _check(capsys, reference.base_url))[1])
    # 40 % of 152,432 is free: 60,972 tokens, enough for 8k, not for 65k + its generation allowance.
    assert _decisions(r) == {1024: "admitted", 8192: "admitted", 65536: "parked"}
    assert r["gate"][2]["why"] == "needs 66560 KV tokens, 60972 free"

    await reference.control("pin", {"kv_usage": 0.95})
    r = _one((await _check(capsys, reference.base_url))[1])
    assert _decisions(r)[1024] == "parked" and r["gate"][0]["why"] == "KV usage 0.950 >= threshold 0.9"


async def test_more_running_than_max_inflight_is_a_warning(reference: Sim, capsys: pytest.CaptureFixture[str]) -> None:
    await reference.control("pin", {"running": 6, "waiting": 0})
    status, out = await _check(capsys, reference.base_url, json_out=False)
    assert status == 0
    assert ("WARNING: the engine runs 6 requests, more than max_inflight 4: "
            "max_inflight must equal the engine's --max-num-seqs") in out


async def test_a_request_larger_than_the_cache_is_refused(make_sim: Callable[..., Awaitable[Sim]],  # noqa: F811
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    sim = await make_sim()  # 512 blocks x 16 = 8,192 tokens
    r = _one((await _check(capsys, sim.base_url))[1])
    assert r["capacity_tokens"] == 8192
    assert _decisions(r) == {1024: "admitted", 8192: "exceeds_kv_capacity", 65536: "exceeds_kv_capacity"}
    assert r["gate"][1]["why"] == "needs 9216 KV tokens, more than the whole cache (8192)"


async def test_data_parallel_ranks_are_counted(make_sim: Callable[..., Awaitable[Sim]],  # noqa: F811
                                               capsys: pytest.CaptureFixture[str]) -> None:
    sim = await make_sim(data_parallel_size=2)
    r = _one((await _check(capsys, sim.base_url))[1])
    assert r["ok"] and r["parsed"]["dp_ranks"] == 2


@pytest.mark.parametrize(("mode", "problem"), [
    ("missing", "required series missing: vllm:num_requests_running"),
    ("garbage", "required series missing: vllm:num_requests_running"),
    ("truncated", "the service cannot use this document: truncated exposition"),
    ("out_of_range", "the service cannot use this document: KV usage out of range"),
    ("fail", "HTTP 500"),
])
async def test_broken_metrics_are_a_problem_and_exit_1(reference: Sim, capsys: pytest.CaptureFixture[str],
                                                       mode: str, problem: str) -> None:
    await reference.control("metrics_mode", {"mode": mode})
    status, doc = await _check(capsys, reference.base_url)
    r = _one(doc)
    assert status == 1 and not r["ok"]
    assert any(p.startswith(problem) for p in r["problems"]), r["problems"]
    assert r["parsed"] is None
    # Without a usable document the service fails open: so does the report.
    assert set(_decisions(r).values()) == {"admitted_fail_open"}


async def test_an_unreachable_engine_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = await _check(capsys, f"http://127.0.0.1:{free_port()}", json_out=False)
    assert status == 1
    assert "[PROBLEM]" in out and "PROBLEM: unreachable:" in out and "admitted_fail_open" in out


class _Document:
    """A fixed exposition on a loopback HTTP server, for dialects the simulator does not speak."""

    def __init__(self, text: str, version: str | None = None) -> None:
        exposition = text.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = exposition
                if self.path == "/version" and version is not None:  # as vLLM's API server answers it
                    body = json.dumps({"version": version}).encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def document() -> Iterator[Callable[[str], _Document]]:
    served: list[_Document] = []

    def serve(text: str, version: str | None = None) -> _Document:
        served.append(_Document(text, version))
        return served[-1]

    yield serve
    for doc in served:
        doc.close()


LEGACY = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""


async def test_a_pre_011_engine_without_cache_config_uses_the_configured_capacity(
        document: Callable[[str], _Document], capsys: pytest.CaptureFixture[str]) -> None:
    served = document(LEGACY)
    status, doc = await _check(capsys, served.url, env={"ADMISSION_KV_CAPACITY_TOKENS": "100000"})
    r = _one(doc)
    assert status == 0
    assert r["apparent_version"].startswith("< 0.11")
    assert {s["name"]: s["found"] for s in r["series"]} == {
        "vllm:num_requests_running": True, "vllm:num_requests_waiting": True, "vllm:gpu_cache_usage_perc": True,
        "vllm:cache_config_info": False}
    assert r["parsed"]["kv_usage"] == 0.25 and r["parsed"]["block_size"] is None
    assert r["capacity_tokens"] == 100000 and r["capacity_source"].startswith("configured")
    # 25 % of 100,000 used: 75,000 free, so the 65k prompt (66,560 with its allowance) still fits.
    assert _decisions(r) == {1024: "admitted", 8192: "admitted", 65536: "admitted"}
    r = _one((await _check(capsys, served.url))[1])
    assert r["capacity_tokens"] is None and "inactive" in r["capacity_source"]


async def test_an_sglang_engine_is_detected_and_read_through_its_dialect(
        document: Callable[[str], _Document], capsys: pytest.CaptureFixture[str]) -> None:
    served = document('sglang:num_running_reqs{model_name="m"} 1.0\nsglang:num_queue_reqs{model_name="m"} 2.0\n'
                      'sglang:token_usage{model_name="m"} 0.1\nsglang:max_total_num_tokens{model_name="m"} 50000.0\n')
    status, doc = await _check(capsys, served.url)
    r = _one(doc)
    assert status == 0 and (r["dialect"], r["dialect_from"]) == ("sglang", "detected")
    assert r["parsed"] == {"running": 1, "waiting": 2, "kv_usage": 0.1, "dp_ranks": 1, "block_size": 1}
    assert r["capacity_tokens"] == 50000 and r["capacity_source"].startswith("sglang:max_total_num_tokens")


async def test_an_engine_missing_its_dialects_queue_gauge_is_a_problem(
        document: Callable[[str], _Document], capsys: pytest.CaptureFixture[str]) -> None:
    served = document('sglang:num_running_reqs{model_name="m"} 1.0\nsglang:token_usage{model_name="m"} 0.1\n')
    status, doc = await _check(capsys, served.url)
    r = _one(doc)
    assert status == 1 and r["dialect"] == "sglang"
    assert "required series missing: sglang:num_queue_reqs" in r["problems"]


async def test_without_urls_every_configured_engine_is_checked_with_its_limits(
        reference: Sim, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "engines.yaml"
    config.write_text("engines:\n"
                      f"  - {{name: qwen, url: '{reference.base_url}', models: [sim-model], max_inflight: 7}}\n"
                      f"  - {{name: gone, url: 'http://127.0.0.1:{free_port()}', models: [other]}}\n")
    status, doc = await _check(capsys, env={"ADMISSION_OBSERVE_MODELS": "", "EXTPROC_CONFIG": str(config)})
    qwen, gone = doc["engines"]
    assert status == 1  # one of the two is unreachable
    assert (qwen["engine"], qwen["ok"], qwen["limits"]["max_inflight"]) == ("qwen", True, 7)
    assert qwen["limits_from"] == "configured engine 'qwen'"
    assert (gone["engine"], gone["ok"], gone["reachable"]) == ("gone", False, False)


def test_the_text_report_names_every_part(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--timeout", "1", f"http://127.0.0.1:{free_port()}"], ENV) == 1
    out = capsys.readouterr().out
    for part in ("engine default:", "KV capacity:", "limits (", "the gate would decide now:", "1024-token prompt"):
        assert part in out


def test_a_bad_configuration_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "http://127.0.0.1:1"], {"ADMISSION_MAX_INFLIGHT": "many"}) == 2
    assert "ADMISSION_MAX_INFLIGHT" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "scraped"), [
    ("http://vllm:8000", "http://vllm:8000/metrics"),
    ("http://vllm:8000/", "http://vllm:8000/metrics"),
    ("vllm:8000", "http://vllm:8000/metrics"),
    ("http://vllm:8000/metrics", "http://vllm:8000/metrics"),
    ("http://10.0.0.7:9090/custom/metrics", "http://10.0.0.7:9090/custom/metrics"),
])
def test_urls_name_the_engine_or_its_metrics(given: str, scraped: str) -> None:
    assert metrics_url(given) == scraped


async def test_the_exact_version_is_read_from_the_engines_version_endpoint(
        document: Callable[..., _Document], capsys: pytest.CaptureFixture[str]) -> None:
    from .test_enginemetrics import EXPOSITION

    served = document(EXPOSITION, version="0.32.0")
    status, doc = await _check(capsys, served.url)
    report = _one(doc)
    assert status == 0 and report["version"] == "0.32.0"
    status, out = await _check(capsys, served.url, json_out=False)
    assert ", version 0.32.0 (from /version)" in out and "apparent version" not in out
    # An engine that states no version: the families' reading, as before.
    unversioned = document(EXPOSITION)
    status, doc = await _check(capsys, unversioned.url)
    assert _one(doc)["version"] is None and _one(doc)["apparent_version"]
