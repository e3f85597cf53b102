"""The simulator over HTTP: the official openai client, /metrics, and /control."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from enginesim.scheduler import CostModel, SchedulerConfig
from extproc.tokenizer import get_tokenizer

from .conftest import Sim, poll

# Qwen3 (the default tokenizer): "hello there" is 2 tokens; the chat template adds 5 for the
# message and 3 for the generation prompt.
CHAT = [{"role": "user", "content": "hello there"}]
CHAT_TOKENS = 10
QWEN3 = get_tokenizer("qwen3")


def words(text: str) -> int:
    """Tokens of a generated text: each generated word is one token."""
    return QWEN3.count_text(text)


def client_for(sim: Sim) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sim.base_url}/v1", api_key="unused", max_retries=0)


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name} {labels}")


# -- OpenAI API ---------------------------------------------------------------------------

async def test_streaming_chat_parses_with_the_openai_client(sim):
    async with client_for(sim) as client:
        stream = await client.chat.completions.create(
            model="sim-model", messages=CHAT, max_tokens=4, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]

    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert words(text) == 4 and text.startswith(" ")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (CHAT_TOKENS, 4)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


async def test_streaming_completion_parses_with_the_openai_client(sim):
    async with client_for(sim) as client:
        stream = await client.completions.create(model="sim-model", prompt="abcdefgh",
                                                 max_tokens=3, stream=True)
        chunks = [chunk async for chunk in stream]

    assert [words(c.choices[0].text) for c in chunks] == [1, 1, 1]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[0].object == "text_completion"


async def test_non_streaming_responses_carry_text_and_usage(make_sim):
    # max_model_len 64: without max_tokens a request may generate up to the context left
    small = SchedulerConfig(num_gpu_blocks=64, block_size=16, max_num_seqs=4,
                            max_num_batched_tokens=2048, max_model_len=64, cost=CostModel(
                                step_overhead_s=0.001, per_prefill_token_s=0.00001,
                                per_decode_seq_s=0.001))
    sim = await make_sim(scheduler=small, no_limit_len=0)  # no EOS: run to the limit
    async with client_for(sim) as client:
        chat = await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                    max_completion_tokens=2)
        completion = await client.completions.create(model="sim-model", prompt="x" * 40)

    assert chat.object == "chat.completion"
    assert words(chat.choices[0].message.content) == 2
    assert chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (CHAT_TOKENS, 2)
    assert completion.usage.prompt_tokens == 5  # forty x: "xxxxxxxx" is one Qwen3 token
    assert completion.usage.completion_tokens == 64 - 5  # the context left, as vLLM
    assert words(completion.choices[0].text) == 59
    assert completion.choices[0].finish_reason == "length"


async def test_sse_headers_and_done_marker(sim):
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 2, "stream": True}
    async with sim.client.post("/v1/completions", json=body) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = await resp.text()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])


async def test_unknown_model_is_404_with_vllm_error_body(sim):
    async with client_for(sim) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="other", messages=CHAT)
    assert info.value.body["type"] == "NotFoundError"  # openai unwraps {"error": {...}}
    assert info.value.body["message"] == "The model `other` does not exist."


async def test_invalid_json_is_400(sim):
    async with sim.client.post("/v1/chat/completions", data=b"{not json",
                               headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["code"] == 400 and body["error"]["param"] is None


async def test_context_overflow_is_400_bad_request(sim):
    async with client_for(sim) as client:
        with pytest.raises(openai.BadRequestError, match="maximum context length is 4096"):
            await client.completions.create(model="sim-model", prompt="1" * 4000,
                                            max_tokens=200)  # Qwen3: a token per digit
    state = await sim.state()
    assert state["requests"] == []  # never reached the engine


async def test_models_and_health(sim):
    async with client_for(sim) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    assert models.data[0].model_extra["max_model_len"] == 4096
    async with sim.client.get("/health") as resp:
        assert resp.status == 200 and await resp.read() == b""


# -- /metrics -----------------------------------------------------------------------------

async def test_metrics_exposes_vllm_0_11_families_with_their_labels(make_sim):
    sim = await make_sim(profile="vllm-0.11")
    async with sim.client.get("/metrics") as resp:
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await resp.text()
    fams = families(text)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:cache_config_info": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert fams[name].type == kind, name
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        (s,) = fams[name].samples
        assert s.labels == {"model_name": "sim-model", "engine": "0"}
    assert [s.name for s in fams["vllm:num_preemptions"].samples] == [
        "vllm:num_preemptions_total"]
    assert "vllm:num_preemptions_created" in fams  # text 0.0.4 writes _created as a gauge
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert "model_name" not in info.labels
    assert info.labels["engine"] == "0"
    assert (info.labels["num_gpu_blocks"], info.labels["block_size"]) == ("512", "16")
    assert len(info.labels) == 21  # every vLLM 0.11 CacheConfig field, plus engine
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.0\n' in text
    ttft_buckets = [s.labels["le"] for s in fams["vllm:time_to_first_token_seconds"].samples
                    if s.name.endswith("_bucket")]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-1] == "+Inf"


async def test_metrics_count_tokens_and_requests(sim):
    async with client_for(sim) as client:
        for _ in range(2):
            await client.completions.create(model="sim-model", prompt="hello there", max_tokens=5)
    text = await sim.metrics_text()
    labels = {"model_name": "sim-model", "engine": "0"}
    assert sample(text, "vllm:prompt_tokens_total", **labels) == 4  # 2 x 2 Qwen3 tokens
    assert sample(text, "vllm:generation_tokens_total", **labels) == 10
    assert sample(text, "vllm:request_success_total", finished_reason="length") == 2
    assert sample(text, "vllm:time_to_first_token_seconds_count", **labels) == 2
    assert sample(text, "vllm:request_decode_time_seconds_count", **labels) == 2
    assert sample(text, "vllm:num_requests_running", **labels) == 0
    assert sample(text, "vllm:kv_cache_usage_perc", **labels) == 0


async def test_pinned_gauges_replace_the_models_values_until_unpinned(sim):
    await sim.control("pin", {"running": 3, "waiting": 7, "kv_usage": 0.95})
    text = await sim.metrics_text()
    assert sample(text, "vllm:num_requests_running") == 3
    assert sample(text, "vllm:num_requests_waiting") == 7
    assert sample(text, "vllm:kv_cache_usage_perc") == 0.95

    await sim.control("pin", {"waiting": None})
    text = await sim.metrics_text()
    assert sample(text, "vllm:num_requests_running") == 3
    assert sample(text, "vllm:num_requests_waiting") == 0

    await sim.control("unpin", {})
    text = await sim.metrics_text()
    assert sample(text, "vllm:num_requests_running") == 0
    assert sample(text, "vllm:kv_cache_usage_perc") == 0


async def test_metrics_mode_fail_gives_500(sim):
    await sim.control("metrics_mode", {"mode": "fail"})
    async with sim.client.get("/metrics") as resp:
        assert resp.status == 500


async def test_metrics_mode_garbage_is_not_prometheus_text(sim):
    await sim.control("metrics_mode", {"mode": "garbage"})
    async with sim.client.get("/metrics") as resp:
        assert resp.status == 200
        body = await resp.read()
    assert body.startswith(b"<html>")
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(body.decode("utf-8", "replace")))


async def test_metrics_mode_missing_drops_the_three_gauges(sim):
    await sim.control("metrics_mode", {"mode": "missing"})
    fams = families(await sim.metrics_text())
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting"):
        assert name not in fams
    assert "vllm:cache_config_info" in fams and "vllm:num_preemptions" in fams


async def test_metrics_mode_hang_never_answers(sim):
    await sim.control("metrics_mode", {"mode": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        async with sim.client.get("/metrics", timeout=aiohttp.ClientTimeout(total=0.3)):
            pass
    await sim.control("metrics_mode", {"mode": "ok"})
    assert "vllm:num_requests_running" in await sim.metrics_text()


async def test_metrics_mode_truncated_cuts_inside_the_kv_value(sim):
    await sim.control("pin", {"kv_usage": 0.97})
    await sim.control("metrics_mode", {"mode": "truncated"})
    text = await sim.metrics_text()
    assert text.endswith('} 0.') and text.splitlines()[-1].startswith("vllm:kv_cache_usage_perc{")
    assert "vllm:cache_config_info" not in text


async def test_metrics_mode_half_keeps_the_gauges_and_loses_cache_config_info(sim):
    await sim.control("metrics_mode", {"mode": "half"})
    text = await sim.metrics_text()
    fams = families(text)
    assert text.endswith("\n")
    assert "vllm:num_requests_running" in fams and "vllm:kv_cache_usage_perc" in fams
    assert "vllm:cache_config_info" not in fams


@pytest.mark.parametrize("mode,value", [("nan", "NaN"), ("out_of_range", "1.5")])
async def test_metrics_modes_nan_and_out_of_range_rewrite_every_kv_value(sim, mode, value):
    await sim.control("metrics_mode", {"mode": mode})
    text = await sim.metrics_text()
    kv = [line for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{")]
    assert kv and all(line.endswith("} " + value) for line in kv)
    assert "vllm:cache_config_info" in families(text)


async def test_unknown_metrics_mode_is_rejected(sim):
    async with sim.client.post("/control/metrics_mode", json={"mode": "weird"}) as resp:
        assert resp.status == 400


# -- hold, disconnects, arrivals, reset ---------------------------------------------------

async def test_hold_keeps_requests_in_place_until_released(sim):
    await sim.control("hold", {"hold": True})
    async with client_for(sim) as client:
        task = asyncio.create_task(client.chat.completions.create(
            model="sim-model", messages=CHAT, max_tokens=2))

        async def queued() -> bool:
            return (await sim.state())["waiting"] == 1

        await poll(queued)
        text = await sim.metrics_text()
        assert sample(text, "vllm:num_requests_waiting") == 1  # a held engine shows its queue
        await asyncio.sleep(0.05)
        assert not task.done()

        await sim.control("hold", {"hold": False})
        result = await asyncio.wait_for(task, 5)
    assert words(result.choices[0].message.content) == 2
    assert (await sim.state())["finished"] == 1


async def test_hold_sends_no_response_bytes_for_requests_that_arrive_while_held(sim):
    await sim.control("hold", {"hold": True})
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1, "stream": True}
    request = asyncio.create_task(sim.client.post("/v1/completions", json=body))
    await asyncio.sleep(0.1)
    assert not request.done()
    await sim.control("hold", {"hold": False})
    async with await asyncio.wait_for(request, 5) as resp:
        assert resp.status == 200
        assert (await resp.text()).endswith("data: [DONE]\n\n")


async def test_client_disconnect_aborts_the_request_and_frees_its_blocks(make_sim):
    slow = SchedulerConfig(num_gpu_blocks=512, block_size=16, max_num_seqs=4,
                           max_num_batched_tokens=2048, max_model_len=4096,
                           cost=CostModel(0.01, 0.00001, 0.01))
    sim = await make_sim(scheduler=slow)
    body = {"model": "sim-model", "prompt": "x" * 400, "max_tokens": 3000, "stream": True}
    resp = await sim.client.post("/v1/completions", json=body)
    await resp.content.readuntil(b"\n\n")  # the first token arrived: the request is running
    assert (await sim.state())["engines"][0]["used_blocks"] > 0
    resp.close()

    async def aborted() -> bool:
        state = await sim.state()
        return state["aborted"] == 1 and state["engines"][0]["used_blocks"] == 0

    await poll(aborted)
    assert (await sim.state())["requests"][0]["state"] == "aborted"


async def test_non_streaming_client_that_gives_up_aborts_its_queued_request(sim):
    await sim.control("hold", {"hold": True})
    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1}
    with pytest.raises(asyncio.TimeoutError):
        async with sim.client.post("/v1/completions", json=body,
                                   timeout=aiohttp.ClientTimeout(total=0.2)):
            pass

    async def aborted() -> bool:
        state = await sim.state()
        return state["aborted"] == 1 and state["waiting"] == 0

    await poll(aborted)
    assert sample(await sim.metrics_text(), "vllm:num_requests_waiting") == 0


async def test_arrivals_list_requests_in_the_order_the_engine_saw_them(sim):
    await sim.control("hold", {"hold": True})
    tasks = []
    for i in range(3):
        body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1, "user": f"u{i}"}
        tasks.append(asyncio.create_task(sim.client.post(
            "/v1/completions", json=body, headers={"X-Request-Id": f"id-{i}"})))

        async def arrived(n: int = i + 1) -> bool:
            return (await sim.state())["waiting"] == n

        await poll(arrived)
    await sim.control("hold", {"hold": False})
    for task in tasks:
        async with await task as resp:
            assert resp.status == 200
    async with sim.client.post("/v1/completions",
                               json={"model": "sim-model", "prompt": "x", "max_tokens": 1}):
        pass
    async with sim.client.get("/control/arrivals") as resp:
        arrivals = (await resp.json())["arrivals"]

    assert [a["id"] for a in arrivals] == ["id-0", "id-1", "id-2", "3"]
    assert [a["user"] for a in arrivals] == ["u0", "u1", "u2", None]
    assert {a["model"] for a in arrivals} == {"sim-model"}


async def test_reset_clears_requests_counters_pins_and_modes(sim):
    async with client_for(sim) as client:
        await client.completions.create(model="sim-model", prompt="hi", max_tokens=2)
    await sim.control("pin", {"running": 4})
    await sim.control("metrics_mode", {"mode": "missing"})
    await sim.control("hold", {"hold": True})

    await sim.control("reset", {})

    state = await sim.state()
    assert (state["finished"], state["requests"], state["held"]) == (0, [], False)
    assert state["pins"] == {"running": None, "waiting": None, "kv_usage": None}
    text = await sim.metrics_text()
    assert sample(text, "vllm:generation_tokens_total") == 0
    assert sample(text, "vllm:num_requests_running") == 0
    async with client_for(sim) as client:  # and the engine still serves
        await client.completions.create(model="sim-model", prompt="hi", max_tokens=1)


@pytest.mark.parametrize("profile", ["vllm-0.33", "vllm-0.11"])
async def test_data_parallel_ranks_have_their_own_series_and_share_requests(make_sim, profile):
    sim = await make_sim(data_parallel_size=2, profile=profile)
    async with client_for(sim) as client:
        await asyncio.gather(*[
            client.completions.create(model="sim-model", prompt="abcd", max_tokens=2)
            for _ in range(4)])
    text = await sim.metrics_text()
    fams = families(text)
    infos = fams["vllm:cache_config_info"].samples
    assert sorted(s.labels["engine"] for s in infos) == ["0", "1"]
    # vLLM's API server sums the ranks' blocks and writes that total on every rank's line.
    assert {s.labels["num_gpu_blocks"] for s in infos} == {str(2 * 512)}
    running = fams["vllm:num_requests_running"].samples
    assert sorted(s.labels["engine"] for s in running) == ["0", "1"]
    for engine in ("0", "1"):
        assert sample(text, "vllm:request_success_total", engine=engine,
                      finished_reason="length") == 2
    state = await sim.state()
    assert [r["engine"] for r in state["requests"]] == [0, 1, 0, 1]


async def test_time_scale_keeps_reported_durations_in_engine_seconds(make_sim):
    # The reference engine at 1000x: an 8192-token prompt is 4 chunks of 2048 tokens and
    # 30 decode steps follow; wall-clock jitter must not leak into the histograms.
    reference = SchedulerConfig(num_gpu_blocks=9527, block_size=16, max_num_seqs=4,
                                max_num_batched_tokens=2048, max_model_len=131072,
                                cost=CostModel())
    sim = await make_sim(scheduler=reference, time_scale=1000.0)
    async with client_for(sim) as client:
        await client.completions.create(model="sim-model", prompt=[1] * 8192,  # token ids
                                        max_tokens=31)
    text = await sim.metrics_text()
    prefill = sample(text, "vllm:request_prefill_time_seconds_sum")
    decode = sample(text, "vllm:request_decode_time_seconds_sum")
    chunk = 0.020 + 2048 * 0.0019
    assert prefill == pytest.approx(4 * chunk, rel=1e-9)
    assert decode == pytest.approx(30 * (0.020 + 0.01333), rel=1e-9)
    assert sample(text, "vllm:request_queue_time_seconds_sum") == pytest.approx(0, abs=1e-9)
    assert 8192 / prefill == pytest.approx(523.6, abs=0.1)  # ~525 tok/s uncontended prefill
    assert 30 / decode == pytest.approx(30.0, abs=0.01)     # 30 tok/s lone decode


async def test_timeline_records_when_the_engine_held_requests_and_their_whole_kv_need(sim):
    await sim.control("hold", {"hold": True})
    body = {"model": "sim-model", "prompt": "abcdefgh", "max_tokens": 30}  # 1 + 30 tokens (Qwen3): 2 blocks
    task = asyncio.create_task(sim.client.post("/v1/completions", json=body))

    async def arrived() -> bool:
        return (await sim.state())["waiting"] == 1

    await poll(arrived)
    async with sim.client.get("/control/timeline") as resp:
        held = await resp.json()
    await sim.control("hold", {"hold": False})
    async with await task as resp:
        assert resp.status == 200
    async with sim.client.get("/control/timeline") as resp:
        done = await resp.json()

    assert (held["max_num_seqs"], held["capacity_tokens"], held["block_size"]) == (4, 511 * 16, 16)
    assert [row[1:] for row in held["timeline"]] == [[0, 0], [1, 32]]
    assert [row[1:] for row in done["timeline"]] == [[0, 0], [1, 32], [0, 0]]
    times = [row[0] for row in done["timeline"]]
    assert times == sorted(times)
    async with sim.client.get("/control/arrivals") as resp:
        (arrival,) = (await resp.json())["arrivals"]
    assert times[0] <= arrival["wall_time"] <= times[1]  # the same (monotonic) clock as the timeline


async def test_state_counts_the_tokens_the_engine_computed_for_each_request(sim):
    async with client_for(sim) as client:
        await client.chat.completions.create(model="sim-model", messages=CHAT, max_tokens=4)
    (request,) = (await sim.state())["requests"]
    # 10 prompt tokens in the prefill (which samples the first token), then one step per further token.
    assert (request["prompt_tokens"], request["computed_tokens"]) == (CHAT_TOKENS, CHAT_TOKENS + 4 - 1)
