"""The alert rules: promtool checks them, its unit tests cover every alert both ways, each has a runbook."""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from pathlib import Path

import yaml

from extproc.outcomes import CAPACITY_REASONS_REGEX, REJECTED_REASONS

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "llm-admission.rules.yml"
RULE_TESTS = Path(__file__).with_name("llm-admission.rules.test.yml")
RUNBOOK = ROOT / "docs" / "runbook.md"
OPERATIONS = ROOT / "docs" / "operations.md"
#: Where the rules' runbook_url points (the chart's prometheusRule.runbookBaseUrl replaces it).
RUNBOOK_BASE_URL = "https://github.com/llm-admission/llm-admission/blob/main/docs/runbook.md"

REQUIRED = {
    "LLMAdmissionObserverDegraded": "observer_degraded",
    "LLMAdmissionEngineStateStale": "engine_state_is_stale",
    "LLMAdmissionHighRejectionRatio": "admission_rejected_total",
    "VLLMPreemptions": "vllm[:_]num_preemptions_total",
    "LLMAdmissionServiceDown": 'up{job="llm-admission"}',
    "LLMAdmissionLedgerDegraded": "admission_ledger_degraded",
    "LLMAdmissionLedgerLeasesExpiring": "admission_ledger_lease_expiries_total",
    "LLMAdmissionEstimateUnderCounts": "admission_engine_prompt_tokens_total",
    "LLMAdmissionMetricsAbsent": 'absent(up{job="llm-admission"})',
    "LLMAdmissionEnvoyDown": 'up{job="llm-admission-envoy"} == 0',
    "LLMAdmissionEnvoyMetricsAbsent": 'absent(up{job="llm-admission-envoy"})',
    "LLMAdmissionEngineLimitDrift": "admission_engine_running_over_limit",
    "LLMAdmissionCPUThrottled": "container_cpu_cfs_throttled_periods_total",
}


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def test_the_required_alerts_exist_on_the_right_series() -> None:
    by_name = {rule["alert"]: rule for rule in alerts()}
    assert set(REQUIRED) <= set(by_name)
    for name, series in REQUIRED.items():
        assert series in by_name[name]["expr"], name


def test_promtool_check_rules_passes(promtool: str) -> None:
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    result = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=60,
                            cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_unit_tests_cover_every_alert_firing_and_not_firing() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == ["../../alerts/llm-admission.rules.yml"]
    seen: dict[str, set[str]] = defaultdict(set)
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            seen[case["alertname"]].add("firing" if case.get("exp_alerts") else "not firing")
    for rule in alerts():
        assert seen[rule["alert"]] == {"firing", "not firing"}, rule["alert"]


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """'## Heading' -> its text, up to the next '## '."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_alert_links_to_its_runbook_section() -> None:
    text = RUNBOOK.read_text()
    anchors = {anchor(h) for h in re.findall(r"^## (.+)$", text, re.M)}
    for rule in alerts():
        url = rule["annotations"]["runbook_url"]
        assert url == f"{RUNBOOK_BASE_URL}#{rule['alert'].lower()}", url
        assert rule["alert"].lower() in anchors, f"docs/runbook.md has no '## {rule['alert']}' section"
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_the_chart_ships_an_identical_copy_of_the_rules() -> None:
    assert (ROOT / "helm" / "llm-admission" / "files" / "llm-admission.rules.yml").read_text() == RULES.read_text()



def test_every_alerts_runbook_entry_links_to_a_troubleshooting_section_that_exists() -> None:
    """Each entry points at docs/operations.md's troubleshooting (the real log lines and
    `extproc check` output), at an anchor that the page has."""
    ops = OPERATIONS.read_text()
    ops_anchors = {anchor(h) for h in re.findall(r"^#{2,3} (.+)$", ops, re.M)}
    assert "troubleshooting" in ops_anchors
    entries = sections(RUNBOOK.read_text())
    for rule in alerts():
        links = re.findall(r"\]\(operations\.md#([^)]+)\)", entries[rule["alert"]])
        assert links, f"runbook section {rule['alert']} has no link to operations.md"
        for link in links:
            assert link in ops_anchors, f"{rule['alert']}: operations.md has no #{link}"


def test_every_selector_of_the_gateways_own_series_names_its_job() -> None:
    """The chart scopes the rules to a release by rewriting these matchers (and cAdvisor's
    container matcher): a selector without one would match every release's series."""
    own = re.compile(r"\b(admission_[a-z_]+|observer_degraded|engine_state_is_stale|engine_[a-z_]+_total)(\{[^}]*\})?")
    for rule in alerts():
        for name, matchers in own.findall(rule["expr"]):
            assert 'job="llm-admission"' in matchers, f"{rule['alert']}: {name}{matchers}"
        for matchers in re.findall(r"container_cpu_cfs_[a-z_]+(\{[^}]*\})", rule["expr"]):
            assert 'container=~"envoy|admission"' in matchers, rule["alert"]


def test_capacity_rejections_are_the_outcome_tables_own() -> None:
    """The rejection-ratio alert counts exactly the outcomes the service calls capacity rejections
    (the dashboard's panel is generated from the same constant), and each is a real reason label."""
    (rule,) = [a for a in alerts() if a["alert"] == "LLMAdmissionHighRejectionRatio"]
    assert re.findall(r'reason=~"([^"]*)"', rule["expr"]) == [CAPACITY_REASONS_REGEX]
    assert set(CAPACITY_REASONS_REGEX.split("|")) <= {o.value for o in REJECTED_REASONS}
