"""Benchmark text: each kind sized in TRUE tokens on the simulator's tokenizer, fixed by its seed."""

from __future__ import annotations

import math

import pytest

from bench.admission import BenchConfig, RequestRecord, estimate_ratios, gateway_estimate_ratios, service_estimates
from bench.scenarios import CLASSES, RequestSpec, prompt_content
from bench.text import TEXT_KINDS, bytes4_ratio, sized_content
from extproc.tokenizer import get_tokenizer

QWEN3 = get_tokenizer("qwen3")


def chat_tokens(content: str, name: str = "qwen3") -> int:
    return get_tokenizer(name).count_chat([{"role": "user", "content": content}])


@pytest.mark.parametrize("kind", TEXT_KINDS)
@pytest.mark.parametrize("tokens", [32, 1024, 8192])
def test_each_kind_is_exactly_its_size_in_true_tokens(kind, tokens):
    content = sized_content(kind, tokens, seed=7, index=3, head="[bench request 3] ")
    assert chat_tokens(content) == tokens
    assert content.startswith("[bench request 3] ")


def test_a_65k_prompt_is_65k_tokens_with_the_template():
    content = sized_content("mixed", 65_536, seed=1, index=0)
    assert chat_tokens(content) == 65_536


@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_the_seed_and_index_fix_the_text(kind):
    one = sized_content(kind, 1024, seed=5, index=1)
    assert sized_content(kind, 1024, seed=5, index=1) == one
    assert sized_content(kind, 1024, seed=6, index=1) != one
    assert sized_content(kind, 1024, seed=5, index=2) != one


def test_the_kinds_tokenize_as_their_traffic_does():
    """bytes/4 over the true count: prose over-estimates, JSON and CJK under, hex far under."""
    ratio = {kind: bytes4_ratio(sized_content(kind, 8192, seed=1, index=0), QWEN3) for kind in TEXT_KINDS}
    assert ratio["prose"] > 1.1
    assert 0.95 < ratio["code"] < 1.15
    assert ratio["json"] < 0.95 and ratio["cjk"] < 0.95
    assert ratio["hex"] < 0.45
    assert 0.95 < ratio["mixed"] < 1.2


def test_cjk_is_cjk():
    content = sized_content("cjk", 1024, seed=1, index=0)
    assert sum(ord(c) > 0x2E80 for c in content) > len(content) / 2


def test_bytes4_hex_is_the_old_benchmark_text_byte_for_byte():
    spec = RequestSpec(4, CLASSES["1k"], 0.0)
    content = prompt_content(spec, 65, text="hex", tokenizer="bytes4")
    assert len(content.encode()) == 1024 * 4
    assert content.startswith("[bench request 4 seed 65 class 1k] ")
    assert content == ("[bench request 4 seed 65 class 1k] " + __import__("random").Random("65/4").randbytes(
        1024 * 4 // 2 + 1).hex())[:4096]
    assert chat_tokens(prompt_content(spec, 65, text="mixed", tokenizer="bytes4"), "bytes4") == 1024


def test_the_estimate_ratio_is_the_services_estimate_over_the_engines_count():
    specs = [RequestSpec(i, CLASSES["1k"], 0.0) for i in range(3)]
    contents = {s.index: prompt_content(s, 1, text="hex") for s in specs}
    estimates = service_estimates(BenchConfig(scenario="smoke", mode="full"), specs, contents)
    assert estimates is not None
    # the bytes rule counts the message text at the configured bytes per token (the service's
    # default, 2.5); hex is ~1.1 bytes a Qwen3 token
    from extproc.config import load_settings

    per_token = load_settings({}).bytes_per_token
    for s in specs:
        assert estimates[s.index] == math.ceil(len(contents[s.index].encode()) / per_token)
    arrivals = [{"id": f"bench-{s.index}", "prompt_tokens": 1024} for s in specs]

    class Record:
        def __init__(self, spec):
            self.spec = spec

    out = estimate_ratios([Record(s) for s in specs], arrivals, estimates)
    assert out["estimate_ratio"] == round(sum(estimates.values()) / 3072, 3) < 0.55
    assert set(out["estimate_ratio_by_class"]) == {"1k"}


def test_the_services_own_estimates_are_paired_request_by_request_and_windowed_by_send_time():
    # Two requests sent at 0 and 2 s (wall, K=30: 0 and 60 engine s), one never admitted.
    records = [RequestRecord(RequestSpec(i, CLASSES["1k"], 0.0), 0, sent=100.0 + 2 * i) for i in range(3)]
    arrivals = [{"id": "bench-0", "prompt_tokens": 1000}, {"id": "bench-1", "prompt_tokens": 1000}]
    estimates = {0: 600, 1: 1100}  # the services' "admitted" lines; request 2 has none
    out = gateway_estimate_ratios(records, arrivals, estimates, t0=100.0, k=30.0, window_from=60.0)
    assert out["gateway_estimate_ratio_by_class"] == {"1k": 0.85}  # 1,700 / 2,000
    assert out["gateway_estimate_ratio_window"] == {"from_s": 60.0, "ratio": 1.1, "by_class": {"1k": 1.1}}
    late = gateway_estimate_ratios(records, arrivals, estimates, t0=100.0, k=30.0, window_from=1000.0)
    assert late["gateway_estimate_ratio_window"] is None  # nothing sent that late
    assert gateway_estimate_ratios(records, arrivals, {}, t0=100.0, k=30.0, window_from=0.0) == {}
