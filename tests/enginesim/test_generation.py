"""Generations as a served model produces them: n, stop, EOS, ignore_eos, limits, /tokenize."""

from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.tokenizer import get_tokenizer

from .conftest import Sim

QWEN3 = get_tokenizer("qwen3")
CHAT = [{"role": "user", "content": "hello there"}]  # 10 tokens with Qwen3's template
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                         "parameters": {"type": "object", "properties": {
                                             "word": {"type": "string"}}, "required": ["word"]}}}


def client_for(sim: Sim) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sim.base_url}/v1", api_key="unused", max_retries=0)


def metric(text: str, name: str, **labels: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def post(sim: Sim, path: str, body: dict) -> tuple[int, dict]:
    async with sim.client.post(path, json=body) as resp:
        return resp.status, await resp.json()


# -- text and counts ----------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["vllm-0.33", "vllm-0.11"])
async def test_the_text_retokenizes_to_the_reported_completion_tokens(make_sim, profile):
    sim = await make_sim(profile=profile, output_len="geometric:20", seed=3)
    stops = lengths = 0
    async with client_for(sim) as client:
        for _ in range(12):
            answer = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                          max_tokens=40)
            choice = answer.choices[0]
            completion = answer.usage.completion_tokens
            # EOS counts in completion_tokens (it is an output token id) and adds no text
            eos = 1 if choice.finish_reason == "stop" else 0
            assert QWEN3.count_text(choice.message.content) == completion - eos
            assert answer.usage.prompt_tokens == 10
            stops += choice.finish_reason == "stop"
            lengths += choice.finish_reason == "length"
    assert stops and lengths  # mean 20 under a limit of 40: both endings happen


async def test_streamed_text_retokenizes_to_the_usage_and_each_chunk_is_one_token(make_sim):
    sim = await make_sim(output_len="fixed:9")
    async with client_for(sim) as client:
        stream = await client.completions.create(model="sim-model", prompt="hello there",
                                                 max_tokens=50, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert [QWEN3.count_text(t) for t in texts[:-1]] == [1] * 8
    assert texts[-1] == ""  # the EOS token: no text, finish_reason stop
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == 9
    assert QWEN3.count_text("".join(texts)) == 8


async def test_metrics_count_what_the_answers_report(make_sim):
    sim = await make_sim(output_len="geometric:12", seed=11)
    prompt_total = completion_total = 0
    async with client_for(sim) as client:
        for i in range(6):
            answer = await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "word " * (i + 1)}],
                max_tokens=30)
            prompt_total += answer.usage.prompt_tokens
            completion_total += answer.usage.completion_tokens
    text = await sim.metrics_text()
    assert metric(text, "vllm:prompt_tokens_total") == prompt_total
    assert metric(text, "vllm:generation_tokens_total") == completion_total
    assert metric(text, "vllm:request_generation_tokens_sum") == completion_total
    assert metric(text, "vllm:request_generation_tokens_count") == 6
    assert metric(text, "vllm:request_params_max_tokens_sum") == 6 * 30  # the limit, not the length
    assert (metric(text, "vllm:request_success_total", finished_reason="stop")
            + metric(text, "vllm:request_success_total", finished_reason="length")) == 6


# -- sampling parameters ------------------------------------------------------------------

async def test_ignore_eos_runs_to_max_tokens(make_sim):
    sim = await make_sim(output_len="fixed:3")
    async with client_for(sim) as client:
        short = await client.completions.create(model="sim-model", prompt="hi", max_tokens=20)
        full = await client.completions.create(model="sim-model", prompt="hi", max_tokens=20,
                                               extra_body={"ignore_eos": True})
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (3, "stop")
    assert (full.usage.completion_tokens, full.choices[0].finish_reason) == (20, "length")
    assert QWEN3.count_text(full.choices[0].text) == 20


async def test_a_stop_string_ends_the_sequence_and_is_withheld(make_sim):
    sim = await make_sim(output_len="fixed:6")
    async with client_for(sim) as client:
        answer = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                      max_tokens=30, stop=["\n\nEND"])
        shown = await client.chat.completions.create(
            model="sim-model", messages=CHAT, max_tokens=30, stop="\n\nEND",
            extra_body={"include_stop_str_in_output": True})
    choice = answer.choices[0]
    stop_tokens = QWEN3.count_text("\n\nEND")
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", "\n\nEND")
    assert answer.usage.completion_tokens == 6
    assert "END" not in choice.message.content
    assert QWEN3.count_text(choice.message.content) == 6 - stop_tokens
    assert shown.choices[0].message.content.endswith("\n\nEND")


async def test_n_choices_are_n_sequences_in_the_engine(make_sim):
    sim = await make_sim(profile="vllm-0.11")
    async with client_for(sim) as client:
        answer = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                      max_tokens=5, n=3)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(QWEN3.count_text(c.message.content) == 5 for c in answer.choices)
    assert len({c.message.content for c in answer.choices}) == 3
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (10, 15)
    state = await sim.state()
    assert [r["prompt_tokens"] for r in state["requests"]] == [10, 10, 10]
    assert state["finished"] == 3
    assert metric(await sim.metrics_text(), "vllm:generation_tokens_total") == 15


async def test_n_streamed_choices_each_end_with_their_finish_reason(make_sim):
    sim = await make_sim()
    async with client_for(sim) as client:
        stream = await client.chat.completions.create(
            model="sim-model", messages=CHAT, max_tokens=4, n=2, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert [QWEN3.count_text(texts[i]) for i in (0, 1)] == [4, 4]
    assert chunks[-1].usage.completion_tokens == 8


async def test_n_below_one_is_400(sim):
    status, body = await post(sim, "/v1/completions", {"model": "sim-model", "prompt": "hi", "n": 0})
    assert status == 400 and body["error"]["code"] == 400


async def test_without_max_tokens_the_limit_is_the_context_left(make_sim):
    sim = await make_sim(output_len="fixed:1000")  # EOS after the limit: the limit decides
    prompt = [7] * 4000  # token ids; max_model_len 4096
    async with client_for(sim) as client:
        answer = await client.completions.create(model="sim-model", prompt=prompt)
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (96, "length")
    capped = await make_sim(default_max_tokens=12)
    async with client_for(capped) as client:
        answer = await client.completions.create(model="sim-model", prompt="hi")
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (12, "length")


async def test_without_max_tokens_the_default_model_ends_with_eos_after_no_limit_len(make_sim):
    sim = await make_sim()  # --output-len max, --no-limit-len 16
    async with client_for(sim) as client:
        answer = await client.completions.create(model="sim-model", prompt="hi")
        forced = await client.completions.create(model="sim-model", prompt=[7] * 4000,
                                                 extra_body={"ignore_eos": True})
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (16, "stop")
    assert QWEN3.count_text(answer.choices[0].text) == 15  # the 16th is the EOS token
    assert (forced.usage.completion_tokens, forced.choices[0].finish_reason) == (96, "length")
    (first, second) = (await sim.state())["requests"]
    assert (first["max_tokens"], second["max_tokens"]) == (4096 - 1, 96)  # the limit: the context left


async def test_a_request_seed_fixes_its_length_and_text(make_sim):
    sim = await make_sim(output_len="geometric:30")
    async with client_for(sim) as client:
        a, b = [await client.completions.create(model="sim-model", prompt="hi", max_tokens=200,
                                                seed=42) for _ in range(2)]
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == b.usage.completion_tokens


async def test_bytes4_keeps_the_old_counts_and_texts(make_sim):
    sim = await make_sim(tokenizer="bytes4")
    async with client_for(sim) as client:
        chat = await client.chat.completions.create(model="sim-model", messages=CHAT, max_tokens=2,
                                                    tools=[TOOL])
    assert chat.choices[0].message.content == " tok0 tok1"
    assert chat.usage.prompt_tokens == 3  # ceil(11 bytes / 4); no template, tools not counted


# -- /tokenize and /detokenize ------------------------------------------------------------

async def test_tokenize_a_prompt_like_vllm(sim):
    status, body = await post(sim, "/tokenize", {"model": "sim-model", "prompt": "hello there"})
    assert status == 200
    assert body == {"count": 2, "max_model_len": 4096, "tokens": [14990, 1052], "token_strs": None}


async def test_tokenize_messages_with_the_template_and_tools(sim):
    status, plain = await post(sim, "/tokenize", {"model": "sim-model", "messages": CHAT})
    assert status == 200 and plain["count"] == 10 and plain["tokens"][0] == 151644
    status, tools = await post(sim, "/tokenize", {"model": "sim-model", "messages": CHAT, "tools": [TOOL]})
    assert tools["count"] == QWEN3.count_chat(CHAT, [TOOL])
    assert tools["count"] > 10 + QWEN3.count_text(json.dumps(TOOL)) + 70
    async with client_for(sim) as client:  # the count is what a generation reports
        answer = await client.chat.completions.create(model="sim-model", messages=CHAT, tools=[TOOL],
                                                      max_tokens=1)
    assert answer.usage.prompt_tokens == tools["count"]


async def test_tokenize_refuses_an_unknown_model_and_a_body_without_a_prompt(sim):
    assert (await post(sim, "/tokenize", {"model": "other", "prompt": "x"}))[0] == 404
    assert (await post(sim, "/tokenize", {"model": "sim-model"}))[0] == 400


async def test_detokenize_inverts_tokenize(sim):
    _, ids = await post(sim, "/tokenize", {"prompt": "Hello world, 你好"})
    status, body = await post(sim, "/detokenize", {"model": "sim-model", "tokens": ids["tokens"]})
    assert (status, body) == (200, {"prompt": "Hello world, 你好"})
    assert (await post(sim, "/detokenize", {"tokens": [10 ** 9]}))[0] == 400
