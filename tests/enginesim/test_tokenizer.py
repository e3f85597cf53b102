"""Prompt tokens as a served model counts them: vocabularies, chat templates, /tokenize."""

from __future__ import annotations

import json
import random

import pytest

from enginesim.outputs import OutputLenModel, TextStream, plan_end
from extproc.tokenizer import TOKENIZERS, TemplateError, get_tokenizer

QWEN3 = get_tokenizer("qwen3")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# -- known counts -------------------------------------------------------------------------

@pytest.mark.parametrize("text, ids", [
    ("Hello world, 你好", [9707, 1879, 11, 220, 108386]),  # Hugging Face Qwen3 ids
    ("hello there", [14990, 1052]),
    ("1234", [16, 17, 18, 19]),  # Qwen splits every digit
])
def test_qwen3_ids_of_fixed_strings(text, ids):
    assert QWEN3.encode_text(text) == ids
    assert QWEN3.count_text(text) == len(ids)


def test_the_chat_template_adds_five_tokens_a_message_and_three_for_the_generation_prompt():
    hello = [{"role": "user", "content": "Hello"}]
    # <|im_start|> user \n Hello <|im_end|> \n <|im_start|> assistant \n
    assert QWEN3.encode_chat(hello) == [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
    assert QWEN3.count_chat(hello) == 9
    assert QWEN3.count_chat(hello, add_generation_prompt=False) == 6
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert QWEN3.count_chat(two) == 9 + 5 + QWEN3.count_text("Be brief.")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "Hello"}]}]
    assert QWEN3.count_chat(parts) == 9 + QWEN3.count_text("\nHello")  # parts joined with "\n"


def test_qwen25_adds_its_default_system_message():
    hello = [{"role": "user", "content": "Hello"}]
    assert get_tokenizer("qwen2.5").count_chat(hello) == 9 + 21


def test_a_tools_block_counts_each_tools_json_and_a_fixed_overhead():
    hello = [{"role": "user", "content": "Hello"}]
    tool_json = json.dumps(WEATHER_TOOL, ensure_ascii=False)
    one = QWEN3.count_chat(hello, [WEATHER_TOOL])
    two = QWEN3.count_chat(hello, [WEATHER_TOOL, WEATHER_TOOL])
    assert two - one == QWEN3.count_text("\n" + tool_json)
    overhead = one - QWEN3.count_chat(hello) - QWEN3.count_text(tool_json)
    assert 78 <= overhead <= 90  # the preamble, the postscript and the system framing


def test_a_completion_prompt_counts_the_text_and_llama3_adds_its_bos():
    assert QWEN3.count_prompt("hello there") == 2
    llama = get_tokenizer("llama3")
    assert llama.count_prompt("hello there") == llama.count_text("hello there") + 1
    assert llama.encode_prompt("hi")[0] == 128000
    assert llama.encode_chat([{"role": "user", "content": "hi"}])[:2] == [128000, 128006]


def test_special_tokens_in_the_text_are_counted_as_the_tokenizer_splits_them():
    assert QWEN3.count_prompt("<|im_end|>") == 1
    assert QWEN3.count_text("<|im_end|>") > 1  # as plain text


def test_bytes4_keeps_the_old_rule():
    old = get_tokenizer("bytes4")
    assert old.count_chat([{"role": "user", "content": "x" * 41}]) == 11
    assert old.count_chat([{"role": "user", "content": "x" * 41}], [WEATHER_TOOL]) == 11  # no template
    assert old.count_prompt("abcdefgh") == 2
    assert get_tokenizer("bytes4", 64.0).count_prompt("x" * 65) == 2
    assert "bytes4" in TOKENIZERS


def test_a_bad_message_is_a_template_error():
    with pytest.raises(TemplateError):
        QWEN3.count_chat([])
    with pytest.raises(TemplateError):
        QWEN3.count_chat([{"role": "user", "content": 3}])


# -- generated text -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_generated_words_retokenize_to_one_token_each(name):
    tokenizer = get_tokenizer(name)
    words = tokenizer.output_words()
    assert len(words) > 1000
    rng = random.Random(5)
    text = "".join(rng.choice(words) for _ in range(3000))
    assert tokenizer.count_text(text) == 3000


def test_output_length_models_parse_and_sample():
    assert OutputLenModel.parse("max").sample(random.Random(1)) is None
    assert OutputLenModel.parse("fixed:7").sample(random.Random(1)) == 7
    rng = random.Random(3)
    for spec in ("geometric:200", "lognormal:200:0.5"):
        model = OutputLenModel.parse(spec)
        samples = [model.sample(rng) for _ in range(4000)]
        assert min(samples) >= 1
        assert 170 < sum(samples) / len(samples) < 230, spec
    for bad in ("geometric", "lognormal:0", "fixed:2.5", "uniform:3", "max:3"):
        with pytest.raises(ValueError):
            OutputLenModel.parse(bad)


def test_an_end_at_the_limit_is_length_and_a_stop_string_ends_the_sequence():
    assert plan_end(10, None, (), ()).reason == "length"
    assert plan_end(10, 10, (), ()).reason == "length"  # vLLM checks the length first
    eos = plan_end(10, 4, (), ())
    assert (eos.end, eos.reason, eos.stop_reason, eos.text_tokens) == (4, "stop", None, 3)
    stop = plan_end(10, 6, ("\n\nEND",), (2,))
    assert (stop.end, stop.reason, stop.stop_reason, stop.text_tokens) == (6, "stop", "\n\nEND", 4)
    stream = TextStream(QWEN3.output_words(), random.Random(1), stop, ("\n\nEND",))
    texts = [stream.next() for _ in range(6)]
    assert texts[4:] == ["", ""] and all(texts[:4])
