"""The gateway in front of a real vLLM of this module's own (not the session's): one started with
vLLM's own queue limit (`--max-num-queued-reqs`), then restarted once, on the same port, with
another KV geometry. Each test asserts what the engine itself did (its own counters).

vLLM's limit (vllm/v1/engine/async_llm.py, `_check_admission`) counts every unfinished request
(waiting + running) in the API server and refuses one more with a bare 503 (no Retry-After).
The gate lets at most max in-flight (4, the engine's --max-num-seqs) + one engine queue slot
into the engine and parks the rest, so a limit of 5 is never reached through the gate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import realengine
from devstack import wait_until

from ..integration.conftest import Stack
from ..integration.http import chat_body, open_raw, post
from .conftest import Engine, _require_engine

pytestmark = [pytest.mark.integration, pytest.mark.realengine]

MODEL = realengine.SERVED_NAME
CHAT = "/v1/chat/completions"
#: what the gate lets into the engine: --max-num-seqs + its one engine queue slot
GATE_BOUND = realengine.MAX_NUM_SEQS + 1
QUEUED_REQS = ("--max-num-queued-reqs", str(GATE_BOUND))
#: the restart's geometry: 288 blocks of 64 tokens = 18,432 KV tokens (was 640 x 32 = 20,480); vLLM
#: refuses to start with exactly the 16,384-token context's worth ("larger than the available KV cache")
NEW_BLOCKS, NEW_BLOCK_SIZE = 288, 64
#: 5 x (prompt + 3,000) fits the KV budget (20,480 x 0.9), so the gate admits five of them
LONG = chat_body("Tell me a long story.", model=MODEL, max_tokens=3000, ignore_eos=True, stream=True)


class OwnEngine:
    """The module's engine, replaced by its restart."""

    def __init__(self, engine: realengine.VllmEngine) -> None:
        self.current = engine


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnEngine]:
    _require_engine()
    engine = realengine.VllmEngine(tmp_path_factory.mktemp("vllm-own"), extra_args=QUEUED_REQS)
    try:
        engine.start()
    except BaseException:
        print(engine.log_tail(80))
        raise
    holder = OwnEngine(engine)
    yield holder
    holder.current.stop()


@pytest.fixture
def vllm(own: OwnEngine) -> realengine.VllmEngine:
    """This module's engine in place of the session's, for conftest's `engine` and `gateway`."""
    return own.current


def _rejections(engine: Engine) -> float:
    return engine.value("vllm:admission_rejections_total")


def test_vllms_own_queue_limit_answers_a_bare_503_when_full(engine: Engine) -> None:
    before = _rejections(engine)
    socks = [open_raw(engine.url + CHAT, LONG, f"direct-{i}") for i in range(GATE_BOUND)]
    try:
        wait_until(lambda: engine.busy() == GATE_BOUND, 120, "the engine holding five long generations")
        reply = post(engine.url + CHAT, chat_body("Hi", model=MODEL, max_tokens=4))
        assert reply.status == 503, reply.body
        assert "retry-after" not in reply.headers  # vLLM says nothing of when to come back
        error = reply.json()["error"]
        assert error["message"].startswith("The engine is currently busy and cannot accept new requests.")
        streamed = post(engine.url + CHAT, chat_body("Hi", model=MODEL, max_tokens=4, stream=True))
        assert streamed.status == 503, streamed.body  # a streamed one too, before any event
        assert streamed.json()["error"]["code"] == 503
        assert _rejections(engine) == before + 2  # its own counter, reason max_num_queued_reqs
    finally:
        for sock in socks:
            sock.close()


def test_behind_the_gate_no_request_meets_vllms_queue_limit(gateway: Callable[..., Stack], engine: Engine) -> None:
    # The long generations run to their end (read whole by their clients); each that ends lets a
    # parked one in. (A client that hangs up instead frees the gate's slot at once, while vLLM
    # counts the request until it has processed the abort: in one run of three, one of three
    # parked requests released so got vLLM's 503. See docs/reliability.md.)
    stack = gateway()
    before, served = _rejections(engine), engine.value("vllm:request_success_total")
    with ThreadPoolExecutor(GATE_BOUND + 3) as pool:
        long = [pool.submit(post, stack.url + CHAT, LONG, {"x-request-id": f"long-{i}"}, 600)
                for i in range(GATE_BOUND)]
        stack.wait_state(lambda s: s["inflight"] == GATE_BOUND, "five long generations admitted", 60)
        short = [pool.submit(post, stack.url + CHAT, chat_body("Hi", model=MODEL, max_tokens=4),
                             {"x-request-id": f"short-{i}"}, 600) for i in range(3)]
        stack.wait_state(lambda s: s["queue_depth"] == 3 or s["inflight"] < GATE_BOUND,
                         "three more parked by the gate", 60)
        replies = [f.result(timeout=600) for f in long + short]
    assert [r.status for r in replies] == [200] * (GATE_BOUND + 3), [r.body[:300] for r in replies]
    assert _rejections(engine) == before  # the engine's own limit never refused one
    assert engine.value("vllm:request_success_total") == served + GATE_BOUND + 3
    assert stack.metric("admission_admitted_total", via="admitted_after_park") >= 1


def test_the_benchmarks_vllm_builtin_mode_reports_what_the_engines_own_limit_refused(
        vllm: realengine.VllmEngine, engine: Engine, tmp_path: Path) -> None:
    # real-short: 8 clients back to back, 40 streamed requests; the engine takes 5 at a time, so
    # the clients meet its limit. A client sees a refusal as a 503 or as an error event in a
    # stream that began (`incomplete`, APIError); the engine counted more refusals than clients
    # saw in both runs measured (7 against 0; 24 against 11), so only that bound is asserted.
    before = _rejections(engine)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.admission", "--scenario", "real-short", "--mode", "vllm-builtin",
         "--engine-url", vllm.url, "--workdir", str(tmp_path), "--quiet"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mode"] == "vllm-builtin" and result["parked"] == 0
    assert result["engine_admission_rejections"] == _rejections(engine) - before  # the engine's counter
    assert result["engine_admission_rejections"] > 0, result
    refused = sum(result["rejected"].values()) + sum(result["incomplete"].values())
    assert 0 < refused and result["completed"] + refused + result["gave_up"] == result["requests"] == 40, (
        result["rejected"], result["incomplete"])
    assert result["peak_engine_running_plus_waiting"] <= GATE_BOUND


def test_capacity_follows_an_engine_restart_with_another_geometry(own: OwnEngine,
                                                                  gateway: Callable[..., Stack]) -> None:
    stack = gateway()
    snapshot = stack.engine_state()["snapshot"]
    assert snapshot["capacity_tokens"] == realengine.NUM_BLOCKS * realengine.BLOCK_SIZE == 20480
    # two sequences of up to 9,500 tokens: fit 20,480 KV tokens, not 18,432
    big = chat_body("Hello", model=MODEL, max_tokens=9500, n=2)
    # start-up took over 10 minutes on a loaded 2-core machine once (torch.compile warm-up)
    own.current = own.current.restart(num_blocks=NEW_BLOCKS, block_size=NEW_BLOCK_SIZE, timeout=1200)
    stack.wait_state(lambda s: (s.get("snapshot") or {}).get("capacity_tokens") == NEW_BLOCKS * NEW_BLOCK_SIZE,
                     "the gateway reading the new engine's capacity", 120)
    engine = Engine(own.current.url)
    reply = post(stack.url + CHAT, big)
    assert reply.headers.get("x-admission-outcome") == "exceeds_kv_capacity", reply.body
    reply = post(stack.url + CHAT, chat_body("Hello", model=MODEL, max_tokens=8))  # fits the new geometry
    assert reply.status == 200, reply.body
    assert engine.value("vllm:request_success_total") == 1  # the new engine served it (its counters began at 0)
    engine.wait_idle()
