"""Profile vllm-0.33 as a client and a scraper see it: the 0.33 metric families, sleep, and
the API server's queue limits (--max-num-queued-reqs / --max-num-queued-tokens).

Expected bodies are vLLM 0.33.0's (vllm/exceptions.py QueueOverflowError and
MaxQueuedTokensError, serve/exception_handling/error_response.py, the chat and completion
stream generators), written out here byte for byte.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from enginesim import server
from enginesim.cli import build_parser, config_from_args
from enginesim.metrics import EngineMetrics

from .conftest import Sim, poll, sim_config

CHAT = [{"role": "user", "content": "hello there"}]  # 10 prompt tokens (Qwen3 and its template)
BUSY = ('{"error":{"message":"The engine is currently busy and cannot accept new requests. '
        'Please try again later or on a different instance.","type":"Service Unavailable",'
        '"param":null,"code":503}}')
BACKLOG = ('{"error":{"message":"The engine has reached its prefill token backlog limit. '
           'Please try again later or on a different instance.","type":"Service Unavailable",'
           '"param":null,"code":503}}')


def client_for(sim: Sim) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sim.base_url}/v1", api_key="unused", max_retries=0)


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def rejections(text: str) -> dict[str, float]:
    return {dict(k)["reason"]: v
            for k, v in samples(text, "vllm:admission_rejections_total").items()}


async def post(sim: Sim, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with sim.client.post(path, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def hold_one(sim: Sim, prompt: str = "hello there", max_tokens: int = 4) -> asyncio.Task:
    """A completion that stays in flight (the engine is held) until released."""
    task = asyncio.create_task(post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": prompt, "max_tokens": max_tokens}))

    async def arrived() -> bool:
        return len((await sim.state())["requests"]) >= 1 and not task.done()
    await poll(arrived)
    return task


# -- metric families ----------------------------------------------------------------------

async def test_0_33_families_types_and_label_sets(make_sim):
    sim = await make_sim(data_parallel_size=2)
    text = await sim.metrics_text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["vllm:num_requests_waiting_by_reason"].type == "gauge"
    assert {(s.labels["engine"], s.labels["reason"])
            for s in fams["vllm:num_requests_waiting_by_reason"].samples} == {
        (e, r) for e in "01" for r in ("capacity", "deferred")}
    assert fams["vllm:engine_sleep_state"].type == "gauge"
    assert {(s.labels["engine"], s.labels["sleep_state"], s.value)
            for s in fams["vllm:engine_sleep_state"].samples} == {
        (e, st, v) for e in "01"
        for st, v in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0))}
    assert fams["vllm:admission_rejections"].type == "counter"
    assert rejections(text) == {"max_num_queued_reqs": 0.0, "max_num_queued_tokens": 0.0}
    for s in fams["vllm:admission_rejections"].samples:
        assert set(s.labels) == {"model_name", "reason"}  # the API server's: no engine label
    assert fams["vllm:request_num_preemptions"].type == "histogram"
    assert "vllm:time_per_output_token_seconds" not in fams  # removed after 0.11
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}


async def test_0_33_cache_config_info_carries_every_cache_setting(make_sim):
    sim = await make_sim(data_parallel_size=2)
    text = await sim.metrics_text()
    infos = [s for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"
             for s in f.samples]
    assert [s.labels["engine"] for s in infos] == ["0", "1"]
    labels = infos[0].labels
    assert len(labels) == 38  # 0.33 CacheConfig.__dict__ (37 entries) plus engine
    assert labels["enable_prefix_caching"] == "True"
    assert labels["gpu_memory_utilization"] == "0.92"
    assert labels["block_size"] == "16"
    # The frontend's copy sums num_gpu_blocks over the DP engines' ready responses.
    assert labels["num_gpu_blocks"] == "1024"
    assert labels["_block_size_resolved"] == "True"
    assert "swap_space" not in labels  # a 0.11 field 0.33 no longer has


async def test_waiting_by_reason_is_capacity_and_sums_to_waiting(make_sim):
    sim = await make_sim()
    await sim.control("hold", {"hold": True})
    tasks = [asyncio.create_task(post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "abcd", "max_tokens": 2})) for _ in range(3)]

    async def three_waiting() -> bool:
        return (await sim.state())["waiting"] == 3
    await poll(three_waiting)
    text = await sim.metrics_text()
    by_reason = {dict(k)["reason"]: v
                 for k, v in samples(text, "vllm:num_requests_waiting_by_reason").items()}
    assert by_reason == {"capacity": 3.0, "deferred": 0.0}
    assert list(samples(text, "vllm:num_requests_waiting").values()) == [3.0]
    await sim.control("hold", {"hold": False})
    for status, _, _ in await asyncio.gather(*tasks):
        assert status == 200


async def test_the_0_33_waiting_gauge_is_not_read_as_the_waiting_by_reason_family(make_sim):
    sim = await make_sim()
    await sim.control("pin", {"waiting": 7})
    text = await sim.metrics_text()
    assert list(samples(text, "vllm:num_requests_waiting").values()) == [7.0]


# -- sleep --------------------------------------------------------------------------------

@pytest.mark.parametrize(("level", "expected"), [
    (0, {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 0.0}),
    (1, {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}),
    (2, {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}),
])
async def test_sleep_state_gauge_per_level(make_sim, level, expected):
    sim = await make_sim()
    assert await sim.control("sleep", {"level": level}) == {"status": "sleeping", "level": level}
    text = await sim.metrics_text()
    state = {dict(k)["sleep_state"]: v for k, v in samples(text, "vllm:engine_sleep_state").items()}
    assert state == expected
    assert await sim.control("wake_up", {}) == {"status": "awake", "tags": None}
    text = await sim.metrics_text()
    state = {dict(k)["sleep_state"]: v for k, v in samples(text, "vllm:engine_sleep_state").items()}
    assert state == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


async def test_a_sleeping_engine_freezes_its_gauges_and_resumes_on_wake_up(make_sim):
    sim = await make_sim()
    await sim.control("sleep", {"level": 1})
    task = asyncio.create_task(post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "abcd", "max_tokens": 2}))

    async def arrived() -> bool:
        return (await sim.state())["waiting"] == 1
    await poll(arrived)
    text = await sim.metrics_text()
    # The request waits, but a sleeping engine records no scheduler stats: the gauges keep
    # the values of the last step (here the initial zeros).
    assert list(samples(text, "vllm:num_requests_waiting").values()) == [0.0]
    await sim.control("wake_up", {})
    status, _, _ = await task
    assert status == 200
    text = await sim.metrics_text()
    assert list(samples(text, "vllm:request_success_total").values()).count(1.0) == 1


# -- queue limits -------------------------------------------------------------------------

async def test_max_num_queued_reqs_answers_vllms_503_to_the_openai_client(make_sim):
    sim = await make_sim(max_num_queued_reqs=1)
    await sim.control("hold", {"hold": True})
    first = await hold_one(sim)
    async with client_for(sim) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="sim-model", messages=CHAT, max_tokens=2)
    assert info.value.status_code == 503
    assert info.value.body == json.loads(BUSY)["error"]
    assert "retry-after" not in {k.lower() for k in info.value.response.headers}
    status, headers, body = await post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "x", "max_tokens": 2})
    assert (status, body.decode()) == (503, BUSY)
    assert headers["Content-Type"].startswith("application/json")
    assert "Retry-After" not in headers
    assert rejections(await sim.metrics_text()) == {
        "max_num_queued_reqs": 2.0, "max_num_queued_tokens": 0.0}
    await sim.control("hold", {"hold": False})
    assert (await first)[0] == 200
    # The slot is free again once the first request has finished.
    status, _, _ = await post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "x", "max_tokens": 2})
    assert status == 200


async def test_a_full_queue_answers_a_stream_with_503_before_any_byte(make_sim):
    sim = await make_sim(max_num_queued_reqs=1)
    await sim.control("hold", {"hold": True})
    first = await hold_one(sim)
    for path, body in (("/v1/chat/completions", {"messages": CHAT}),
                       ("/v1/completions", {"prompt": "abc"})):
        status, headers, raw = await post(sim, path, {"model": "sim-model", "stream": True,
                                                       "max_tokens": 2, **body})
        assert (status, raw.decode()) == (503, BUSY)
        assert "Retry-After" not in headers
    async with client_for(sim) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="sim-model", messages=CHAT,
                                                 max_tokens=2, stream=True)
    assert info.value.status_code == 503
    await sim.control("hold", {"hold": False})
    assert (await first)[0] == 200


async def test_a_full_queue_answers_503_before_checking_the_prompt_length(make_sim):
    sim = await make_sim(max_num_queued_reqs=0)
    status, _, body = await post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "x" * 40000, "max_tokens": 2})
    assert (status, body.decode()) == (503, BUSY)
    status, _, body = await post(sim, "/v1/completions", {
        "model": "nope", "prompt": "x", "max_tokens": 2})
    assert status == 404  # the served-model check comes first


async def test_n_counts_as_n_slots(make_sim):
    sim = await make_sim(max_num_queued_reqs=2)
    status, _, body = await post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "x", "max_tokens": 2, "n": 3})
    assert (status, body.decode()) == (503, BUSY)


async def test_max_num_queued_tokens_counts_prompts_until_their_first_token(make_sim):
    # "hello there": 2 prompt tokens each (Qwen3); limit 4: two requests in prefill reach it.
    sim = await make_sim(max_num_queued_tokens=4)
    await sim.control("hold", {"hold": True})
    held = [await hold_one(sim)]
    held.append(asyncio.create_task(post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "hello there", "max_tokens": 4})))

    async def two() -> bool:
        return len((await sim.state())["requests"]) == 2
    await poll(two)
    # 2 tokens in prefill < 4 let the second in; now 4 >= 4: refused, whatever its size.
    status, headers, body = await post(sim, "/v1/completions", {
        "model": "sim-model", "prompt": "a", "max_tokens": 2})
    assert (status, body.decode()) == (503, BACKLOG)
    assert "Retry-After" not in headers
    assert rejections(await sim.metrics_text()) == {
        "max_num_queued_reqs": 0.0, "max_num_queued_tokens": 1.0}
    await sim.control("hold", {"hold": False})
    for task in held:
        assert (await task)[0] == 200


async def test_a_decoding_request_no_longer_counts_as_queued_tokens(make_sim):
    sim = await make_sim(max_num_queued_tokens=2)
    async with client_for(sim) as client:
        stream = await client.completions.create(model="sim-model", prompt="hello there",
                                                 max_tokens=50, stream=True)
        first = await stream.__anext__()  # its first token: prefill is over
        assert first.choices[0].text.startswith(" ")
        # 2 prompt tokens would reach the limit while prefilling; decoding, they do not count.
        done = await client.completions.create(model="sim-model", prompt="hello there",
                                               max_tokens=2)
        assert done.usage.completion_tokens == 2
        await stream.close()


async def test_a_stream_refused_by_the_second_check_gets_200_and_one_sse_error(make_sim,
                                                                              monkeypatch):
    """Both requests pass the preflight check; the first is added while the second renders,
    so add_request refuses the second after its 200 went out (vLLM's race window)."""
    sim = await make_sim(max_num_queued_reqs=1)
    await sim.control("hold", {"hold": True})
    rendering: list[asyncio.Event] = []
    release = asyncio.Event()

    async def slow_render(parsed: Any) -> None:
        event = asyncio.Event()
        rendering.append(event)
        event.set()
        if parsed.stream:
            await release.wait()
    monkeypatch.setattr(server, "_render", slow_render)

    for path, body, expected_event in (
            ("/v1/chat/completions", {"messages": CHAT}, BUSY),
            # the completion stream json.dumps the error with the default separators
            ("/v1/completions", {"prompt": "abc"}, json.dumps(json.loads(BUSY)))):
        await sim.control("reset", {})
        await sim.control("hold", {"hold": True})
        release.clear()
        rendering.clear()
        streamed = asyncio.create_task(post(sim, path, {
            "model": "sim-model", "stream": True, "max_tokens": 2, **body}))

        async def streaming_rendering() -> bool:
            return len(rendering) == 1
        await poll(streaming_rendering)
        other = await hold_one(sim)  # passes both checks while the stream renders
        release.set()
        status, headers, raw = await streamed
        assert status == 200
        assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert raw.decode() == f"data: {expected_event}\n\ndata: [DONE]\n\n"
        assert rejections(await sim.metrics_text())["max_num_queued_reqs"] == 1.0
        await sim.control("hold", {"hold": False})
        assert (await other)[0] == 200


async def test_the_openai_client_sees_the_sse_error_event_of_a_refused_stream(make_sim,
                                                                              monkeypatch):
    sim = await make_sim(max_num_queued_reqs=1)
    await sim.control("hold", {"hold": True})
    release = asyncio.Event()
    started = asyncio.Event()

    async def slow_render(parsed: Any) -> None:
        if parsed.stream:
            started.set()
            await release.wait()
    monkeypatch.setattr(server, "_render", slow_render)

    async def consume() -> list[Any]:
        async with client_for(sim) as client:
            stream = await client.chat.completions.create(
                model="sim-model", messages=CHAT, max_tokens=2, stream=True)
            return [chunk async for chunk in stream]

    task = asyncio.create_task(consume())
    await started.wait()
    other = await hold_one(sim)
    release.set()
    with pytest.raises(openai.APIError) as info:
        await task
    assert info.value.message == json.loads(BUSY)["error"]["message"]
    await sim.control("hold", {"hold": False})
    assert (await other)[0] == 200


# -- configuration ------------------------------------------------------------------------

def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(["--max-num-queued-reqs", "8",
                                      "--max-num-queued-tokens", "0"])
    config = config_from_args(args)
    assert (config.max_num_queued_reqs, config.max_num_queued_tokens) == (8, 0)
    unset = config_from_args(build_parser().parse_args([]))
    assert (unset.max_num_queued_reqs, unset.max_num_queued_tokens) == (None, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-num-queued-reqs", "-1"])


def test_vllm_0_11_has_no_queue_limits():
    with pytest.raises(ValueError, match="vLLM 0.11 has no queue limits"):
        sim_config(profile="vllm-0.11", max_num_queued_reqs=4)


async def test_the_0_11_profile_keeps_its_exposition(make_sim):
    sim = await make_sim(profile="vllm-0.11")
    text = await sim.metrics_text()
    for absent in ("vllm:num_requests_waiting_by_reason", "vllm:admission_rejections",
                   "vllm:engine_sleep_state", "vllm:request_num_preemptions"):
        assert absent not in text
    assert "vllm:time_per_output_token_seconds" in text
    expected = EngineMetrics("sim-model", sim_config().scheduler, [0],
                             process_collectors=False, profile="vllm-0.11").exposition()
    names = [line.split(" ")[2] for line in expected.decode().splitlines()
             if line.startswith("# TYPE")]
    served = [line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE")
              and line.split(" ")[2].startswith("vllm:")]
    assert served == names
