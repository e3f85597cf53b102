"""Text that tokenizes near one token a byte: many tiny content parts, spaced digits. The engine
(the simulator, counting like vLLM: text parts joined with "\\n", a real vocabulary and chat
template) is the ground truth; the estimate must never be below it, by the bytes rule alone
(no engine to ask) or by the source the estimator picks."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from extproc.bodyscan import scan_body
from extproc.estimate import TemplateOverhead, prompt_from_bytes
from extproc.tokencount import Calibration
from extproc.tokenizer import get_tokenizer
from tests.unit.test_estimate import _close_estimators, estimate, estimator, serve, sim_app, sources

__all__ = ["_close_estimators", "serve"]  # fixtures shared with test_estimate.py

TEMPLATES = ("qwen3", "qwen2.5", "llama3")
# The prior, and the most a learned rate may reach (ADMISSION_BYTES_PER_TOKEN_MAX's default).
RATES = (2.5, 4.0)


def one_character_parts(count: int = 1900) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "abcdefghij"[i % 10]} for i in range(count)]}]


def spaced_digits(count: int = 3000, seed: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"role": "user", "content": " ".join(str(rng.randrange(10)) for _ in range(count))}]


def body(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "sim-model", "messages": messages, "max_tokens": 16}).encode()


@pytest.mark.parametrize("messages", [one_character_parts(), spaced_digits()], ids=["1900-parts", "spaced-digits"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_the_bytes_rule_is_never_below_the_engines_count_for_near_one_byte_a_token_text(
        messages: list[dict[str, Any]], template: str) -> None:
    facts = scan_body(body(messages))
    truth = get_tokenizer(template).count_chat(messages)
    for rate in RATES:
        estimated = prompt_from_bytes(facts, rate, 1.0, TemplateOverhead())
        assert truth <= estimated <= 1.05 * truth + 40, (template, rate, estimated, truth)


def test_the_separators_between_text_parts_are_rendered_bytes() -> None:
    two = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"text": "world", "type": "text"}]}]
    assert scan_body(body(two)).prompt_bytes == len("hello\nworld")
    bare = [{"role": "user", "content": ["hello", {"type": "text", "text": "world"}, "again"]}]
    assert scan_body(body(bare)).prompt_bytes == len("hello\nworld\nagain")
    one = [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
           {"role": "assistant", "content": "hi"}]
    assert scan_body(body(one)).prompt_bytes == len("hello") + len("hi")
    # Tool calls are not content parts: no separators between them.
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]
    assert scan_body(body(calls)).prompt_bytes == 2 * (len("f") + len("{}"))
    # A list of prompts is several prompts, not one joined text.
    assert scan_body(b'{"model":"m","prompt":["ab","cde"]}').prompt_bytes == 5


def test_dense_text_is_counted_a_token_a_byte_and_prose_at_the_rate() -> None:
    assert scan_body(body(one_character_parts(10))).dense_bytes == 10 + 9  # parts and separators
    assert scan_body(body(spaced_digits(100))).dense_bytes == 199
    prose = "The quick brown fox jumps over the lazy dog, twice in 2024."
    facts = scan_body(body([{"role": "user", "content": prose}]))
    assert facts.dense_bytes == 3 * 4  # four digits, each with a byte on either side
    assert facts.prompt_bytes == len(prose)


def test_dense_text_stays_out_of_the_learned_rate() -> None:
    """The engine counted the dense text's tokens too: the rate is learned from the rest only."""
    cal = Calibration(prior=2.5, low=1.0, high=8.0, learn=True, min_evidence=100)
    messages = [{"role": "user", "content": "a" * 4000 + " " + " ".join("5" * 500)}]
    facts = scan_body(body(messages))
    dense = facts.dense_bytes
    assert dense == 3 * 500 and facts.prompt_bytes == 5000
    cal.engine_counted(0.0, 0.0)
    cal.finished(facts, TemplateOverhead())
    cal.engine_counted(875.0 + dense + TemplateOverhead().tokens(facts), 1.0)  # the rest at 4 bytes a token
    assert cal.bytes_per_token() == (pytest.approx(4.0), True)


async def test_a_body_of_many_tiny_parts_is_counted_by_the_engine(serve: Any) -> None:
    """The threshold is on the body (58 KB here), not on the 3,799 bytes of text it renders."""
    url = await serve(sim_app())
    est, metrics = estimator(url)  # ADMISSION_TOKENIZE_ABOVE_BYTES: the default 8 KiB
    messages = one_character_parts()
    cost = await estimate(est, body(messages))
    assert cost.source == "engine"
    assert cost.prompt_tokens == get_tokenizer("qwen3").count_chat(messages) == 3807
    assert sources(metrics) == {"engine": 1}


async def test_spaced_digits_under_the_threshold_are_estimated_at_least_at_the_engines_count(serve: Any) -> None:
    url = await serve(sim_app())
    est, _ = estimator(url)
    messages = spaced_digits()
    payload = body(messages)
    assert len(payload) < 8192
    cost = await estimate(est, payload)
    assert cost.source == "prior"
    assert cost.prompt_tokens >= get_tokenizer("qwen3").count_chat(messages)
