"""Finding `model` and `stream` anywhere in the body, and the 4xx outcomes for bad bodies."""

from __future__ import annotations

import json

import pytest

from extproc.bodyscan import MAX_DEPTH, BodyError, scan_body
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


def test_stream_defaults_to_false_and_is_read_as_the_engine_reads_it() -> None:
    assert scan_body(b'{"model":"m"}').stream is False
    assert scan_body(b'{"model":"m","stream":null}').stream is False
    # pydantic's lax bool, as vLLM validates it: these stream.
    for value in (b'true', b'"yes"', b'"True"', b'"on"', b'"1"', b'1', b'1.0'):
        assert scan_body(b'{"model":"m","stream":%s}' % value).stream is True, value
    for value in (b'false', b'"no"', b'"off"', b'"0"', b'0', b'0.0'):
        assert scan_body(b'{"model":"m","stream":%s}' % value).stream is False, value


def test_measures_message_text_in_utf8_bytes_not_roles() -> None:
    facts = scan_body(json.dumps({"model": "m", "messages": MESSAGES}, ensure_ascii=False).encode())
    assert facts.prompt_bytes == len(b"be brief") + len("héllo".encode())


def test_measures_text_parts_and_completion_prompts() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}
    assert scan_body(json.dumps(chat).encode()).prompt_bytes == 4
    assert scan_body(b'{"model":"m","prompt":["ab","cde"]}').prompt_bytes == 5
    assert scan_body(b'{"model":"m","prompt":"abc"}').prompt_bytes == 3


def test_the_generation_limit_is_the_larger_positive_of_the_two_fields() -> None:
    assert scan_body(b'{"model":"m","max_tokens":5}').generation_limit == 5
    facts = scan_body(b'{"model":"m","max_tokens":5,"max_completion_tokens":9}')
    assert (facts.max_tokens, facts.max_completion_tokens, facts.generation_limit) == (5, 9, 9)
    # /v1/completions honours max_tokens only; chat reads `max_completion_tokens or max_tokens`.
    assert scan_body(b'{"model":"m","max_tokens":900,"max_completion_tokens":9}').generation_limit == 900
    assert scan_body(b'{"model":"m","max_tokens":900,"max_completion_tokens":0}').generation_limit == 900
    assert scan_body(b'{"model":"m","max_tokens":0}').generation_limit is None
    assert scan_body(b'{"model":"m","max_tokens":null}').generation_limit is None
    assert scan_body(b'{"model":"m","max_tokens":true}').max_tokens == 1  # pydantic: True -> 1


@pytest.mark.parametrize(
    "value,expected",
    [
        (b'100000', 100000),
        (b'"100000"', 100000),
        (b'" 100000 "', 100000),
        (b'"+100000"', 100000),
        (b'"100000.0"', 100000),
        (b'100000.0', 100000),
        (b'1e5', 100000),
        (b'"-5"', -5),
        (b'false', 0),
    ],
)
def test_max_tokens_is_read_as_pydantic_lax_mode_reads_it(value: bytes, expected: int) -> None:
    assert scan_body(b'{"model":"m","max_tokens":%s}' % value).max_tokens == expected
    assert scan_body(b'{"model":"m","max_completion_tokens":%s}' % value).max_completion_tokens == expected


@pytest.mark.parametrize(
    "value",
    [b'100000.5', b'"100000."', b'"abc"', b'"1e5"', b'"0x10"', b'""', b'"100000.5"', b'[]', b'{}', b'[100000]',
     b'"1_000"', b'"\\u000b5"', b'"%s"' % (b"1" * 65)],
)
def test_max_tokens_the_engine_would_reject_is_a_400_here(value: bytes) -> None:
    for key in (b"max_tokens", b"max_completion_tokens"):
        with pytest.raises(BodyError) as info:
            scan_body(b'{"model":"m","%s":%s}' % (key, value))
        assert info.value.outcome is Outcome.INVALID_BODY


@pytest.mark.parametrize("value", [b'2', b'1.5', b'"maybe"', b'" true"', b'[]', b'{"a":1}'])
def test_stream_the_engine_would_reject_is_a_400_here(value: bytes) -> None:
    with pytest.raises(BodyError) as info:
        scan_body(b'{"model":"m","stream":%s}' % value)
    assert info.value.outcome is Outcome.INVALID_BODY


def test_a_duplicate_key_takes_its_last_value_as_json_loads_does() -> None:
    body = b'{"model":"m","max_tokens":5,"stream":true,"max_tokens":"100000","stream":false}'
    assert json.loads(body)["max_tokens"] == "100000"
    facts = scan_body(body)
    assert (facts.max_tokens, facts.stream) == (100000, False)
    # An invalid earlier value does not matter; an invalid last one does.
    assert scan_body(b'{"model":"m","max_tokens":[1],"max_tokens":7}').max_tokens == 7
    with pytest.raises(BodyError):
        scan_body(b'{"model":"m","max_tokens":7,"max_tokens":{"a":[1]}}')


@pytest.mark.parametrize("ws", [b"\x0b", b"\x0c"])
def test_vertical_tab_and_form_feed_are_not_json_whitespace(ws: bytes) -> None:
    body = b'{"model":%s"m"}' % ws
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(BodyError) as info:
        scan_body(body)
    assert info.value.outcome is Outcome.INVALID_BODY


def test_deep_nesting_is_rejected_and_shallow_nesting_is_not() -> None:
    deep = 100_000
    with pytest.raises(BodyError) as info:
        scan_body(b'{"model":"m","x":' + b"[" * deep + b"]" * deep + b"}")
    assert info.value.outcome is Outcome.INVALID_BODY and "nested" in info.value.message
    ok = MAX_DEPTH - 1  # plus the top-level object
    assert scan_body(b'{"model":"m","x":' + b"[" * ok + b"]" * ok + b"}").model == "m"
    with pytest.raises(BodyError):
        scan_body(b'{"model":"m","x":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}")
    with pytest.raises(RecursionError):
        json.loads(b'{"x":' + b"[" * 1000 + b"]" * 1000 + b"}")


def test_a_lone_surrogate_in_the_model_is_rejected_and_a_pair_is_read() -> None:
    with pytest.raises(BodyError) as info:
        scan_body(b'{"model":"m\\ud800"}')
    assert info.value.outcome is Outcome.INVALID_BODY
    with pytest.raises(BodyError):
        scan_body(b'{"model":"m\\udc00\\ud800"}')
    with pytest.raises(BodyError):  # yajl pairs a high surrogate with any next escape
        scan_body(b'{"model":"\\ud83d\\u3333de00"}')
    assert scan_body(b'{"model":"m\\ud83d\\ude00"}').model == "m\U0001f600"
    assert scan_body(b'{"model":"m?\\\\ud800"}').model == "m?\\ud800"  # an escaped backslash, not an escape
    assert scan_body(b'{"model":"m?","x":"\\ud83d\\ude00"}').model == "m?"


@pytest.mark.parametrize(
    "body,outcome",
    [
        (b"not json", Outcome.INVALID_BODY),
        (b"", Outcome.INVALID_BODY),
        (b"[1, 2]", Outcome.INVALID_BODY),
        (b'"model"', Outcome.INVALID_BODY),
        (b'{"model": "m"', Outcome.INVALID_BODY),  # truncated
        (b'{"model": "m"} {"model": "n"}', Outcome.INVALID_BODY),  # trailing document
        (b'{"model": "m"}"n', Outcome.INVALID_BODY),  # trailing unterminated string (yajl ignores it)
        (b'{"model": "m"} "n}', Outcome.INVALID_BODY),
        (b'{"model": "m"}"n\\', Outcome.INVALID_BODY),
        (b'{"model": "m"}1', Outcome.INVALID_BODY),
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


def test_trailing_whitespace_is_json() -> None:
    assert scan_body(b'{"model": "m"} \r\n\t ').model == "m"


def test_a_one_megabyte_prompt_is_scanned_without_keeping_it() -> None:
    content = "x" * (1 << 20)
    facts = scan_body(json.dumps({"messages": [{"role": "user", "content": content}], "model": "m"}).encode())
    assert facts.model == "m" and facts.prompt_bytes == 1 << 20
