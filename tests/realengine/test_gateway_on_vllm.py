"""The gateway in front of a real vLLM: each test asserts what the engine itself did (its own
counters and gauges), not only what the gateway says it did."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import realengine
from devstack import console_script, wait_until

from ..integration.conftest import Stack
from ..integration.http import chat_body, open_raw, post
from .conftest import Engine

pytestmark = [pytest.mark.integration, pytest.mark.realengine]

MODEL = realengine.SERVED_NAME
CHAT = "/v1/chat/completions"


def test_check_reads_the_real_engines_gauges_and_capacity(vllm: realengine.VllmEngine) -> None:
    proc = subprocess.run([console_script("extproc"), "check", vllm.url, "--json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = json.loads(proc.stdout)["engines"]
    assert report["dialect"] == "vllm"
    assert report["version"] == "0.32.0"  # the engine's own /version, not a guess from its families
    assert all(s["found"] for s in report["series"]), report["series"]
    # --num-gpu-blocks-override 640 x --block-size 32, read from the engine's cache_config_info
    assert report["capacity_tokens"] == realengine.NUM_BLOCKS * realengine.BLOCK_SIZE == 20480
    assert report["capacity_source"].startswith("vllm:cache_config_info")
    assert report["parsed"]["block_size"] == realengine.BLOCK_SIZE


def test_the_openai_client_is_admitted_and_the_engine_serves_it(gateway: Callable[..., Stack], engine: Engine) -> None:
    stack = gateway()
    before = engine.value("vllm:request_success_total")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=8)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert engine.value("vllm:request_success_total") == before + 1
    assert stack.metric("admission_admitted_total") == 1


def test_the_estimate_is_the_engines_own_count(gateway: Callable[..., Stack], engine: Engine) -> None:
    # Every prompt goes to the engine's /tokenize: the estimate the gate reserved is exactly what
    # the engine then counted for the request.
    stack = gateway({"ADMISSION_TOKENIZE_ABOVE_BYTES": "1"})
    before = engine.value("vllm:prompt_tokens_total")
    content = "The quick brown fox jumps over the lazy dog. " * 40
    reply = post(stack.url + CHAT, chat_body(content, model=MODEL, max_tokens=4), {"x-request-id": "counted"})
    assert reply.status == 200, reply.body
    engine_count = reply.json()["usage"]["prompt_tokens"]
    assert engine.value("vllm:prompt_tokens_total") - before == engine_count
    admitted = [json.loads(line) for line in stack.service_log().splitlines()
                if '"admitted"' in line and '"counted"' in line]
    assert [(a["prompt_tokens"], a["estimate_source"]) for a in admitted] == [(engine_count, "engine")]


def test_a_request_the_whole_cache_cannot_hold_never_reaches_the_engine(gateway: Callable[..., Stack],
                                                                        engine: Engine) -> None:
    stack = gateway()
    before = engine.value("vllm:request_success_total") + engine.value("vllm:prompt_tokens_total")
    # two sequences of up to 12,000 tokens each: more than the 20,480 KV tokens the engine has
    # (each within the 16,384-token context, or the context rule would answer first)
    reply = post(stack.url + CHAT, chat_body("Hello", model=MODEL, max_tokens=12000, n=2))
    assert reply.headers["x-admission-outcome"] == "exceeds_kv_capacity", reply.body
    assert reply.json()["error"]["code"] == "exceeds_kv_capacity"
    assert engine.value("vllm:request_success_total") + engine.value("vllm:prompt_tokens_total") == before


def test_a_prompt_over_max_model_len_is_refused_at_once_as_vllm_would_and_never_reaches_it(
        gateway: Callable[..., Stack], engine: Engine) -> None:
    # ~18,000 tokens: over the 16,384-token context the engine lists on /v1/models, within its
    # 20,480 KV tokens (so the KV budget admits it). Counted exactly by the engine's /tokenize, it
    # gets the engine's own answer from the gateway at once, and the engine sees no request.
    stack = gateway({"ADMISSION_TOKENIZE_ABOVE_BYTES": "1"})
    long = chat_body("The quick brown fox jumps over the lazy dog. " * 900, model=MODEL, max_tokens=4)
    answered = engine.http_requests(CHAT)
    direct = post(engine.url + CHAT, long)  # what vLLM itself answers
    assert direct.status == 400
    assert "This model's maximum context length is 16384 tokens" in direct.json()["error"]["message"]
    # its API server counts a request after answering it
    wait_until(lambda: engine.http_requests(CHAT) == answered + 1, 30, "the engine counting the direct request")
    before = (engine.http_requests(CHAT), engine.value("vllm:prompt_tokens_total"))
    reply = post(stack.url + CHAT, long)
    assert reply.status == 400, reply.body
    assert reply.headers["x-admission-outcome"] == "context_length_exceeded"
    message = reply.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 16384 tokens. However, your prompt contains ")
    count = int(message.split("contains ")[1].split()[0])
    # the engine's exact count (not vLLM's "at least 16385"), within the KV cache
    assert realengine.MAX_MODEL_LEN < count < realengine.NUM_BLOCKS * realengine.BLOCK_SIZE
    short = chat_body("Hi", model=MODEL, max_tokens=17000)  # an output limit over the context: no count needed
    reply = post(stack.url + CHAT, short)
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["message"].startswith("max_tokens=17000 cannot be greater than max_model_len=16384.")
    assert (engine.http_requests(CHAT), engine.value("vllm:prompt_tokens_total")) == before
    assert stack.metric("admission_rejected_total", reason="context_length_exceeded") == 2
    assert stack.engine_state()["inflight"] == 0


def test_a_full_engine_parks_the_next_request_until_one_ends(gateway: Callable[..., Stack], engine: Engine) -> None:
    # Four slots (max-num-seqs 4) plus one engine queue slot: five long generations fill the gate's
    # bound; the sixth parks, and the engine never holds more than five; when one client hangs up
    # the engine aborts it and the parked request goes in.
    stack = gateway()
    long = chat_body("Tell me a long story.", model=MODEL, max_tokens=3000, ignore_eos=True, stream=True)
    socks = [open_raw(stack.url + CHAT, long, f"long-{i}") for i in range(5)]
    try:
        stack.wait_state(lambda s: s["inflight"] == 5, "five long generations admitted", 60)
        with ThreadPoolExecutor(1) as pool:
            parked = pool.submit(post, stack.url + CHAT, chat_body("Hi", model=MODEL, max_tokens=4),
                                 {"x-request-id": "parked"}, 300)
            stack.wait_state(lambda s: s["queue_depth"] == 1, "the sixth request parked", 60)
            assert engine.busy() <= 5
            socks.pop(0).close()  # one client gone: the engine aborts its request, a slot frees
            reply = parked.result(timeout=300)
        assert reply.status == 200, reply.body
        assert stack.metric("admission_admitted_total", via="admitted_after_park") == 1
        assert engine.value("vllm:num_preemptions_total") == 0
    finally:
        for sock in socks:
            sock.close()


def test_a_client_gone_mid_stream_frees_its_slot_and_the_engine_aborts(gateway: Callable[..., Stack],
                                                                         engine: Engine) -> None:
    stack = gateway()
    body = chat_body("Tell me a long story.", model=MODEL, max_tokens=6000, ignore_eos=True, stream=True)
    sock = open_raw(stack.url + CHAT, body, "gone")
    try:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # streaming has begun
        stack.wait_state(lambda s: s["inflight"] == 1, "the stream admitted")
        wait_until(lambda: engine.busy() == 1, 60, "the engine running it")
    finally:
        sock.close()
    stack.wait_state(lambda s: s["inflight"] == 0, "the slot freed", 60)
    wait_until(lambda: engine.busy() == 0, 60, "the engine aborting the request")
    assert engine.value("vllm:request_success_total") >= 0  # the engine is still serving
    assert post(stack.url + CHAT, chat_body("Hi", model=MODEL, max_tokens=2)).status == 200


def test_a_model_the_engine_does_not_serve_is_404_and_never_reaches_it(gateway: Callable[..., Stack],
                                                                        engine: Engine) -> None:
    stack = gateway()
    before = engine.value("vllm:prompt_tokens_total")
    reply = post(stack.url + CHAT, chat_body("Hello", model="not-served", max_tokens=4))
    assert reply.status == 404
    assert reply.json()["error"]["code"] == "unknown_model"
    assert MODEL in reply.json()["error"]["message"]
    assert engine.value("vllm:prompt_tokens_total") == before


def test_streaming_through_the_gateway_ends_with_the_ticket(gateway: Callable[..., Stack], engine: Engine) -> None:
    stack = gateway()
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=16, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    stack.wait_state(lambda s: s["inflight"] == 0, "the ticket released at the stream's end")


def test_envoy_closes_an_idle_engine_connection_before_vllm_does(gateway: Callable[..., Stack],
                                                                 engine: Engine) -> None:
    # vLLM closes an idle keep-alive connection after 5 s; a request Envoy writes onto it just then
    # fails (503 connection_termination). Envoy must close first: by its own idle timer, never by
    # the engine's close.
    stack = gateway()
    assert post(stack.url + CHAT, chat_body("Hi", model=MODEL, max_tokens=2)).status == 200
    wait_until(lambda: stack.envoy_stat(r"^cluster\.[^.]+\.upstream_cx_idle_timeout$") >= 1, 60,
               "Envoy closing the idle engine connection itself")
    assert stack.envoy_stat(r"^cluster\.[^.]+\.upstream_cx_destroy_remote$") == 0
    assert post(stack.url + CHAT, chat_body("Hi again", model=MODEL, max_tokens=2)).status == 200
