"""Engine metrics dialects as data: the tables, detection, the parser reading through them,
the `dialect` setting, and no engine metric name outside extproc/dialects.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from extproc.config import ConfigError, load_settings
from extproc.dialects import AUTO, CHOICES, DIALECTS, SGLANG, TRTLLM, VLLM, detect
from extproc.enginemetrics import MetricsFormatError, parse_engine_metrics

ROOT = Path(__file__).resolve().parents[2]

SGLANG_DOC = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 2.0
sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="0"} 1.0
sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 4.0
sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="0"} 0.0
sglang:token_usage{dp_rank="0",model_name="m",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",model_name="m",tp_rank="0"} 0.2
sglang:max_total_num_tokens{dp_rank="0",model_name="m",tp_rank="0"} 100000.0
sglang:max_total_num_tokens{dp_rank="1",model_name="m",tp_rank="0"} 100000.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{dp_rank="0",model_name="m",tp_rank="0"} 70.0
sglang:prompt_tokens_total{dp_rank="1",model_name="m",tp_rank="0"} 30.0
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
"""

TRTLLM_DOC = """\
trtllm_num_requests_running{engine_type="trtllm",model_name="m"} 3.0
trtllm_num_requests_waiting{engine_type="trtllm",model_name="m"} 1.0
trtllm_kv_cache_utilization{engine_type="trtllm",model_name="m"} 0.75
trtllm_kv_cache_max_blocks{engine_type="trtllm",model_name="m"} 1000.0
trtllm_kv_cache_tokens_per_block{engine_type="trtllm",model_name="m"} 32.0
trtllm_generation_tokens_total{engine_type="trtllm",model_name="m"} 9.0
"""


def test_every_dialect_names_its_three_gauges_and_says_where_capacity_comes_from() -> None:
    assert set(DIALECTS) == {"vllm", "sglang", "trtllm"} and CHOICES[-1] == AUTO
    for d in DIALECTS.values():
        assert all(d.required) and d.capacity in ("info", "tokens", "blocks")
        assert d.capacity_source().split(" ")[0] in d.samples


def test_sglang_sums_ranks_takes_max_kv_and_sums_each_ranks_pool() -> None:
    g = parse_engine_metrics(SGLANG_DOC, dialect=SGLANG)
    assert (g.running, g.waiting, g.kv_usage, g.ranks, g.dialect) == (3, 4, 0.5, 2, "sglang")
    assert (g.capacity_tokens, g.block_size) == (200000, 1)
    assert g.prompt_tokens_total == 100 and g.generation_tokens_total is None and g.generated_sum is None


def test_trtllm_capacity_is_blocks_times_tokens_per_block() -> None:
    g = parse_engine_metrics(TRTLLM_DOC, dialect=TRTLLM)
    assert (g.running, g.waiting, g.kv_usage, g.ranks) == (3, 1, 0.75, 1)
    assert (g.capacity_tokens, g.block_size) == (32000, 32)
    assert g.generation_tokens_total == 9 and g.prompt_tokens_total is None


def test_an_engine_without_its_capacity_families_has_no_capacity_as_vllm_without_cache_config() -> None:
    text = "".join(line + "\n" for line in TRTLLM_DOC.splitlines() if "kv_cache_max_blocks" not in line)
    assert parse_engine_metrics(text, dialect=TRTLLM).capacity_tokens is None
    with pytest.raises(MetricsFormatError, match="trtllm_kv_cache_max_blocks.* is missing"):
        parse_engine_metrics(text, dialect=TRTLLM, expect_capacity=True)


def test_a_rank_missing_from_the_capacity_gauge_is_rejected() -> None:
    text = SGLANG_DOC.replace('sglang:max_total_num_tokens{dp_rank="1",model_name="m",tp_rank="0"} 100000.0\n', "")
    with pytest.raises(MetricsFormatError, match="incomplete exposition: sglang:max_total_num_tokens ranks"):
        parse_engine_metrics(text, dialect=SGLANG)


def test_another_dialects_document_is_missing_series_not_misread() -> None:
    with pytest.raises(MetricsFormatError, match="missing series: vllm:num_requests_running"):
        parse_engine_metrics(SGLANG_DOC)
    with pytest.raises(MetricsFormatError, match="missing series: sglang:num_running_reqs"):
        parse_engine_metrics(TRTLLM_DOC, dialect=SGLANG)


def test_detection_goes_by_the_running_requests_samples() -> None:
    assert detect(SGLANG_DOC) is SGLANG and detect(TRTLLM_DOC) is TRTLLM
    assert detect('vllm:num_requests_running{engine="0"} 1.0\n') is VLLM
    assert detect("# HELP x mentions vllm:num_requests_running in prose\nx 1\n") is None
    assert detect("") is None


def test_the_prefilter_keeps_exactly_the_dialects_lines() -> None:
    kept = SGLANG.wanted.findall(SGLANG_DOC)
    assert len(kept) == len(SGLANG_DOC.splitlines()) - 1  # all but the histogram bucket
    assert VLLM.wanted.findall('vllm:num_requests_waiting_by_reason{reason="capacity"} 2.0\n') == []


def test_the_setting_defaults_to_auto_and_names_itself_when_wrong(tmp_path: Path) -> None:
    assert load_settings({}).engines[0].dialect == "auto"
    assert load_settings({"ADMISSION_ENGINE_DIALECT": "SGLang"}).engines[0].dialect == "sglang"
    with pytest.raises(ConfigError, match=r"ADMISSION_ENGINE_DIALECT='tgi': must be one of vllm, sglang, trtllm, auto"):
        load_settings({"ADMISSION_ENGINE_DIALECT": "tgi"})
    config = tmp_path / "engines.yaml"
    config.write_text("engines:\n"
                      "  - {name: a, url: 'http://127.0.0.1:1', models: [x], dialect: trtllm}\n"
                      "  - {name: b, url: 'http://127.0.0.1:2', models: [y]}\n")
    a, b = load_settings({"EXTPROC_CONFIG": str(config), "ADMISSION_ENGINE_DIALECT": "sglang"}).engines
    assert (a.dialect, b.dialect) == ("trtllm", "sglang")  # the entry's, else the environment's
    config.write_text("engines:\n  - {name: a, url: 'http://127.0.0.1:1', models: [x], dialect: vllm2}\n")
    with pytest.raises(ConfigError, match=r"engines\[a\]\.dialect='vllm2': must be one of"):
        load_settings({"EXTPROC_CONFIG": str(config)})


_ENGINE_NAME = re.compile(r"\b(?:vllm|sglang):[a-z]|\btrtllm_[a-z]")


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants that are not docstrings (comments are not in the tree at all)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_no_engine_metric_name_is_written_in_the_service_outside_dialects_py() -> None:
    found = []
    for path in sorted((ROOT / "extproc").glob("*.py")):
        if path.name == "dialects.py":
            continue
        for line, text in _literals(ast.parse(path.read_text())):
            if _ENGINE_NAME.search(text):
                found.append(f"{path.name}:{line}: {text[:80]!r}")
    assert found == [], "engine metric names belong in extproc/dialects.py"
