"""Finding `model` and `stream` anywhere in the body, and the 4xx outcomes for bad bodies."""

from __future__ import annotations

import json

import pytest

from extproc.bodyscan import BodyError, scan_body
from extproc.outcomes import Outcome

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]


@pytest.mark.parametrize(
    "doc",
    [
        {"model": "m", "messages": MESSAGES, "stream": True},  # openai-python 3.x order
        {"messages": MESSAGES, "model": "m", "stream": True},  # openai-python 1.x order
        {"messages": MESSAGES, "stream": True, "temperature": 0.2, "model": "m"},  # model last
    ],
)
def test_finds_model_and_stream_wherever_they_are(doc: dict) -> None:
    facts = scan_body(json.dumps(doc).encode())
    assert (facts.model, facts.stream) == ("m", True)


def test_nested_model_keys_do_not_count_as_the_top_level_model() -> None:
    doc = {"messages": [{"role": "user", "content": "x", "model": "evil"}], "metadata": {"model": "x"}, "model": "m"}
    assert scan_body(json.dumps(doc).encode()).model == "m"


def test_stream_defaults_to_false_and_only_true_means_streaming() -> None:
    assert scan_body(b'{"model":"m"}').stream is False
    assert scan_body(b'{"model":"m","stream":"yes"}').stream is False


def test_measures_message_text_in_utf8_bytes_not_roles() -> None:
    facts = scan_body(json.dumps({"model": "m", "messages": MESSAGES}, ensure_ascii=False).encode())
    assert facts.prompt_bytes == len("be brief".encode()) + len("héllo".encode())


def test_measures_text_parts_and_completion_prompts() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}
    assert scan_body(json.dumps(chat).encode()).prompt_bytes == 4
    assert scan_body(b'{"model":"m","prompt":["ab","cde"]}').prompt_bytes == 5
    assert scan_body(b'{"model":"m","prompt":"abc"}').prompt_bytes == 3


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert scan_body(b'{"model":"m","max_tokens":5}').max_tokens == 5
    assert scan_body(b'{"model":"m","max_tokens":5,"max_completion_tokens":9}').max_tokens == 9
    assert scan_body(b'{"model":"m","max_tokens":true}').max_tokens is None


@pytest.mark.parametrize(
    "body,outcome",
    [
        (b"not json", Outcome.INVALID_BODY),
        (b"", Outcome.INVALID_BODY),
        (b"[1, 2]", Outcome.INVALID_BODY),
        (b'"model"', Outcome.INVALID_BODY),
        (b'{"model": "m"', Outcome.INVALID_BODY),  # truncated
        (b'{"model": "m"} {"model": "n"}', Outcome.INVALID_BODY),  # trailing document
        (b'{"model": "m", "x": NaN}', Outcome.INVALID_BODY),
        (b"\xff\xfe{}", Outcome.INVALID_BODY),
        (b'{"messages": []}', Outcome.MISSING_MODEL),
        (b'{"model": ""}', Outcome.MISSING_MODEL),
        (b'{"model": null}', Outcome.MISSING_MODEL),
        (b'{"model": ["m"]}', Outcome.MISSING_MODEL),
        (b'{"model": "a", "messages": [], "model": "b"}', Outcome.DUPLICATE_MODEL),
        (b'{"model": "a", "model": "a"}', Outcome.DUPLICATE_MODEL),
    ],
)
def test_bad_bodies_map_to_their_outcome(body: bytes, outcome: Outcome) -> None:
    with pytest.raises(BodyError) as info:
        scan_body(body)
    assert info.value.outcome is outcome
    assert info.value.message


def test_a_one_megabyte_prompt_is_scanned_without_keeping_it() -> None:
    content = "x" * (1 << 20)
    facts = scan_body(json.dumps({"messages": [{"role": "user", "content": content}], "model": "m"}).encode())
    assert facts.model == "m" and facts.prompt_bytes == 1 << 20
