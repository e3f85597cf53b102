"""The chart's PrometheusRule is scoped to its release: two releases (here in two namespaces, each
with its own rules) never fire for each other's series, and absent() means absent from THIS
release. Checked by promtool on the rendered rules, against series from both releases."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import NAMESPACE, Chart, helm

OURS = {"namespace": NAMESPACE, "service": "demo-llm-admission-metrics"}
THEIRS = {"namespace": "other", "service": "demo-llm-admission-metrics"}  # the same release name elsewhere
SAME_NS = {"namespace": NAMESPACE, "service": "team-b-llm-admission-metrics"}  # another release beside ours


def _rules(chart: Chart, **values: Any) -> dict[str, Any]:
    return chart.render({"prometheusRule": {"enabled": True, **values}}).one("PrometheusRule")["spec"]


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def _promtool_test(promtool: str, tmp_path: Path, rules: dict[str, Any], tests: list[dict[str, Any]]) -> None:
    # Which alerts fire with which labels is the point here; annotations are promtool-tested on
    # the source file (tests/observability), so they are left out.
    rules = {"groups": [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
                        for g in rules["groups"]]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m",
                                                       "tests": tests}))
    result = subprocess.run([promtool, "test", "rules", "test.yml"], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _alert(alertname: str, eval_time: str, labels: list[dict[str, str]]) -> dict[str, Any]:
    return {"eval_time": eval_time, "alertname": alertname, "exp_alerts": [{"exp_labels": lab} for lab in labels]}


def test_each_release_alerts_only_on_its_own_series(chart: Chart, tmp_path: Path, promtool: str) -> None:
    down = "0x10"
    tests = [{
        "interval": "1m",
        "input_series": [
            *[_series("up", {"job": "llm-admission", "instance": f"{n}:9003", **scope}, down)
              for n, scope in (("a", OURS), ("b", THEIRS), ("c", SAME_NS))],
            *[_series("up", {"job": "llm-admission-envoy", "instance": f"{n}:9902", **scope}, down)
              for n, scope in (("a", OURS), ("b", THEIRS), ("c", SAME_NS))],
            *[_series("observer_degraded",
                      {"job": "llm-admission", "instance": f"{n}:9003", "engine": "qwen", **scope}, "1x10")
              for n, scope in (("a", OURS), ("b", THEIRS), ("c", SAME_NS))],
            *[_series("admission_engine_running_over_limit",
                      {"job": "llm-admission", "instance": f"{n}:9003", "engine": "qwen", **scope}, "2x10")
              for n, scope in (("a", OURS), ("b", THEIRS), ("c", SAME_NS))],
        ],
        "alert_rule_test": [
            _alert("LLMAdmissionServiceDown", "5m", [{"severity": "critical", "job": "llm-admission",
                                                      "instance": "a:9003", **OURS}]),
            _alert("LLMAdmissionEnvoyDown", "5m", [{"severity": "critical", "job": "llm-admission-envoy",
                                                    "instance": "a:9902", **OURS}]),
            _alert("LLMAdmissionObserverDegraded", "5m", [{"severity": "warning", "job": "llm-admission",
                                                           "instance": "a:9003", "engine": "qwen",
                                                           "namespace": NAMESPACE}]),
            _alert("LLMAdmissionEngineLimitDrift", "5m", [{"severity": "warning", "job": "llm-admission",
                                                           "instance": "a:9003", "engine": "qwen",
                                                           "namespace": NAMESPACE}]),
            _alert("LLMAdmissionMetricsAbsent", "15m", []),
        ],
    }]
    _promtool_test(promtool, tmp_path, _rules(chart), tests)


def test_absent_fires_when_only_other_releases_are_scraped(chart: Chart, tmp_path: Path, promtool: str) -> None:
    tests = [{
        "interval": "1m",
        "input_series": [_series("up", {"job": "llm-admission", "instance": "b:9003", **THEIRS}, "1x20"),
                         _series("up", {"job": "llm-admission-envoy", "instance": "b:9902", **THEIRS}, "1x20")],
        "alert_rule_test": [
            _alert("LLMAdmissionMetricsAbsent", "12m", [{"severity": "warning", "job": "llm-admission", **OURS}]),
            _alert("LLMAdmissionEnvoyMetricsAbsent", "12m",
                   [{"severity": "warning", "job": "llm-admission-envoy", **OURS}]),
        ],
    }]
    _promtool_test(promtool, tmp_path, _rules(chart), tests)


def test_cpu_throttling_counts_this_releases_containers_only(chart: Chart, tmp_path: Path, promtool: str) -> None:
    def container(ns: str, pod: str, name: str, throttled: int) -> list[dict[str, str]]:
        labels = {"namespace": ns, "pod": pod, "container": name}
        return [_series("container_cpu_cfs_periods_total", labels, "0+600x30"),
                _series("container_cpu_cfs_throttled_periods_total", labels, f"0+{throttled}x30")]

    tests = [{
        "interval": "1m",
        "input_series": [
            *container(NAMESPACE, "demo-llm-admission-6d9f-abcde", "envoy", 300),
            *container("other", "demo-llm-admission-6d9f-abcde", "envoy", 300),      # same name, other namespace
            *container(NAMESPACE, "envoy-gateway-5c7d-xyz", "envoy", 300),          # someone else's Envoy
        ],
        "alert_rule_test": [_alert("LLMAdmissionCPUThrottled", "25m", [
            {"severity": "warning", "namespace": NAMESPACE, "pod": "demo-llm-admission-6d9f-abcde",
             "container": "envoy"}])],
    }]
    _promtool_test(promtool, tmp_path, _rules(chart), tests)


def test_runbook_urls_are_absolute_and_follow_the_configured_base(chart: Chart) -> None:
    default = _rules(chart)
    for rule in default["groups"][0]["rules"]:
        assert rule["annotations"]["runbook_url"] == (
            f"https://github.com/llm-admission/llm-admission/blob/main/docs/runbook.md#{rule['alert'].lower()}")
    own = _rules(chart, runbookBaseUrl="https://wiki.example.com/llm/runbook/")
    for rule in own["groups"][0]["rules"]:
        assert rule["annotations"]["runbook_url"] == f"https://wiki.example.com/llm/runbook#{rule['alert'].lower()}"
    with pytest.raises(helm.HelmValuesError, match="runbookBaseUrl"):
        chart.render({"prometheusRule": {"enabled": True, "runbookBaseUrl": "docs/runbook.md"}})


def test_vllm_alerts_can_be_scoped_or_left_to_another_release(chart: Chart, tmp_path: Path, promtool: str) -> None:
    def alerts(spec: dict[str, Any]) -> dict[str, str]:
        return {r["alert"]: r["expr"] for r in spec["groups"][0]["rules"]}

    assert "VLLMPreemptions" not in alerts(_rules(chart, vllmAlerts=False))
    assert "LLMAdmissionServiceDown" in alerts(_rules(chart, vllmAlerts=False))
    scoped = _rules(chart, vllmSelector='namespace="models"')
    assert '{namespace="models",__name__=~"vllm[:_]num_preemptions_total"}' in alerts(scoped)["VLLMPreemptions"]
    preempted = "0 0 1 1 1 1"
    tests = [{
        "interval": "1m",
        "input_series": [
            _series("vllm:num_preemptions_total",
                    {"job": "vllm", "instance": "v1:8000", "model_name": "m", "namespace": "models"}, preempted),
            _series("vllm:num_preemptions_total",
                    {"job": "vllm", "instance": "v2:8000", "model_name": "m", "namespace": "elsewhere"}, preempted),
        ],
        "alert_rule_test": [_alert("VLLMPreemptions", "3m", [{"severity": "warning", "job": "vllm",
                                                              "instance": "v1:8000", "model_name": "m"}])],
    }]
    _promtool_test(promtool, tmp_path, scoped, tests)
