"""The ext_proc conversation, message by message, without Envoy.

Each test plays Envoy's side of one stream with canned `ProcessingRequest`s (`CannedStream`),
asserts every `ProcessingResponse` the servicer writes exactly (which oneof, mode override,
timeout override, header mutations, immediate response status / headers / body), and then the
state the request leaves behind in the real gate and metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2

from extproc.admission import Admission
from extproc.bodyscan import scan_body
from extproc.contract import SERVICE_STALL_SECONDS
from extproc.metrics import Metrics
from extproc.outcomes import Outcome
from extproc.servicer import ExternalProcessor
from extproc.tokencount import Calibration
from extproc.wire import base_pb2, http_status_pb2, pb, processing_mode_pb2

from .conversation_helpers import (
    ENV,
    CannedStream,
    body_message,
    chat_body,
    chat_headers,
    headers_message,
    route_body_message,
    route_metadata,
    start_stack,
)

PARK_ENV = {**ENV, "ADMISSION_MAX_PARK_SECONDS": "30", "VLLM_MAX_QUEUE_DEPTH": "1"}

# --- the answers, spelled out --------------------------------------------------------------------

CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
BUFFER_BODY = pb.ProcessingResponse(  # a gated JSON request's headers: Envoy holds them until the whole body's answer
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED))
SKIP_BODY = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(request_body_mode=processing_mode_pb2.ProcessingMode.NONE))
PARK_35S = pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=35))  # park cap + 5 s


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def admitted(engine: str = "default", several_engines: bool = False) -> pb.ProcessingResponse:
    """Admitted to `engine`; with several engines, named where Envoy routes (the request's dynamic
    metadata) and the route chosen again."""
    answer = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[_set("x-admission-engine", engine)]),
        clear_route_cache=several_engines)))
    if several_engines:
        answer.dynamic_metadata.update({"llm_admission": {"engine": engine}})
    return answer


def rejected(status: int, outcome: str, error_type: str, message: str,
             retry_after: str | None = None) -> pb.ProcessingResponse:
    headers = [_set("content-type", "application/json"), _set("x-admission-outcome", outcome)]
    if retry_after is not None:
        headers.append(_set("retry-after", retry_after))
    body = json.dumps({"error": {"message": message, "type": error_type, "code": outcome}}, separators=(",", ":"))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=pb.HeaderMutation(set_headers=headers), body=body.encode(), details=f"admission_{outcome}"))


# --- harness -------------------------------------------------------------------------------------

Scenario = Callable[[Admission, Metrics, ExternalProcessor], Awaitable[None]]


def _run(scenario: Scenario, env: dict[str, str] = ENV) -> None:
    async def main() -> None:
        admission, metrics, servicer = await start_stack(env)
        await scenario(admission, metrics, servicer)

    asyncio.run(main())


def _serve(servicer: ExternalProcessor, stream: CannedStream) -> asyncio.Task[None]:
    return asyncio.ensure_future(servicer.Process(None, stream))  # type: ignore[arg-type]


def _sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _counted(metrics: Metrics, name: str, reason_label: str, value: str, engine: str = "default",
             model: str = "m") -> float | None:
    return _sample(metrics, name, engine=engine, model=model, **{reason_label: value})


async def _until(predicate: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0)
    await asyncio.wait_for(poll(), 5)


def _idle(admission: Admission, engine: str = "default") -> bool:
    gate = admission.gate(engine)
    return (gate.queue_depth, gate.inflight, admission.inflight) == (0, 0, 0)


async def _park(admission: Admission, servicer: ExternalProcessor, stream: CannedStream) -> None:
    """Take the one slot with another request, then park this stream's request."""
    body = chat_body()
    assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
    assert await stream.exchange(body_message(body)) == PARK_35S
    assert admission.gate("default").queue_depth == 1


# --- admitted ------------------------------------------------------------------------------------


def test_the_admitted_debug_line_carries_the_prompt_estimate_and_its_source(caplog: pytest.LogCaptureFixture) -> None:
    body = chat_body(messages=[{"role": "user", "content": "x" * 4000}])

    estimated: list[float | None] = []

    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream(metadata=route_metadata())
        task = _serve(servicer, stream)
        assert await stream.exchange(route_body_message(body, request_id="est-1")) == admitted()
        stream.end()
        await asyncio.wait_for(task, 5)
        estimated.append(_sample(metrics, "admission_estimated_prompt_tokens_total", engine="default", model="m"))

    with caplog.at_level("DEBUG", logger="extproc.servicer"):
        _run(scenario)
    (line,) = [r for r in caplog.records if r.getMessage() == "admitted"]
    assert (line.request_id, line.estimate_source) == ("est-1", "prior")  # type: ignore[attr-defined]  # no calibration yet
    assert [line.prompt_tokens] == estimated and line.prompt_tokens > 1000  # type: ignore[attr-defined]


def test_a_request_under_the_limit_is_admitted_and_routed_then_freed_when_its_stream_ends() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        assert await stream.exchange(body_message(body)) == admitted()
        assert (admission.gate("default").inflight, admission.inflight) == (1, 1)
        # The response phase and trailers pass untouched while the engine answers.
        response = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
        assert await stream.exchange(response) == pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and stream.unanswered() == 0
        assert _counted(metrics, "admission_admitted_total", "via", "admitted") == 1
        assert _sample(metrics, "admission_decision_latency_seconds_count", engine="default",
                       outcome="admitted") == 1
        assert _sample(metrics, "extproc_internal_errors_total") == 0

    _run(scenario)


def test_an_ungated_path_skips_the_body_and_is_counted_as_passed_through() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        assert await stream.exchange(headers_message([(":method", "GET"), (":path", "/v1/models")], True)) == SKIP_BODY
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _sample(metrics, "admission_passthrough_total", reason="path_not_gated") == 1
        assert _idle(admission) and admission.recent("default") == ()

    _run(scenario)


def test_each_model_is_routed_to_its_engine_and_the_route_is_recomputed(tmp_path: Path) -> None:
    config = tmp_path / "engines.yaml"
    config.write_text("engines:\n"
                      "  - {name: small, url: 'http://127.0.0.1:8001', models: [a]}\n"
                      "  - {name: large, url: 'http://127.0.0.1:8002', models: [b]}\n")

    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        for model, engine in (("b", "large"), ("a", "small")):
            stream = CannedStream()
            task = _serve(servicer, stream)
            body = chat_body(model)
            assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
            assert await stream.exchange(body_message(body)) == admitted(engine, several_engines=True)
            assert admission.gate(engine).inflight == 1
            stream.end()
            await asyncio.wait_for(task, 5)
            assert _idle(admission, engine)
            assert _counted(metrics, "admission_admitted_total", "via", "admitted", engine, model) == 1

    _run(scenario, {"EXTPROC_CONFIG": str(config), "ADMISSION_KV_BUDGET": "false"})


# --- parked --------------------------------------------------------------------------------------


def test_a_parked_request_is_admitted_when_a_slot_frees() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream()
        task = _serve(servicer, stream)
        await _park(admission, servicer, stream)
        await admission.finish("default", holder.ticket)
        assert await stream.answer() == admitted()
        assert (admission.gate("default").queue_depth, admission.inflight) == (0, 1)
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and stream.unanswered() == 0
        assert _sample(metrics, "admission_parked_total", engine="default", model="m") == 1
        assert _counted(metrics, "admission_admitted_total", "via", "admitted_after_park") == 1
        assert _sample(metrics, "admission_park_duration_seconds_count", engine="default",
                       outcome="admitted_after_park") == 1
        # The decision latency counts the park answer and the admission, not the time parked.
        for outcome in ("parked", "admitted_after_park"):
            assert _sample(metrics, "admission_decision_latency_seconds_count", engine="default",
                           outcome=outcome) == 1

    _run(scenario, PARK_ENV)


def test_a_short_park_cap_still_parks_for_as_long_as_a_service_stall_is_allowed() -> None:
    """The park override is never below Envoy's message_timeout (SERVICE_STALL_SECONDS): with a
    1 s park cap it is 15 s, not 6 s, so a parked request survives a stall of the service."""
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        assert await stream.exchange(body_message(body)) == pb.ProcessingResponse(
            override_message_timeout=duration_pb2.Duration(seconds=int(SERVICE_STALL_SECONDS)))
        await admission.finish("default", holder.ticket)
        assert await stream.answer() == admitted()
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission)

    _run(scenario, {**PARK_ENV, "ADMISSION_MAX_PARK_SECONDS": "1"})


def test_a_message_while_parked_is_not_answered_and_the_park_goes_on() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream()
        task = _serve(servicer, stream)
        await _park(admission, servicer, stream)
        await _until(lambda: stream.reads == 3)  # headers, body, and the read that watches the park
        stream.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        await _until(lambda: stream.reads == 4)  # read, and the next read started
        assert stream.unanswered() == 0 and admission.gate("default").queue_depth == 1
        await admission.finish("default", holder.ticket)
        assert await stream.answer() == admitted()
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission)

    _run(scenario, PARK_ENV)


def test_a_stream_that_ends_while_parked_leaves_the_queue_as_client_gone() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream()
        task = _serve(servicer, stream)
        await _park(admission, servicer, stream)
        stream.end()
        await asyncio.wait_for(task, 5)
        assert stream.unanswered() == 0
        assert admission.gate("default").queue_depth == 0
        assert _counted(metrics, "admission_rejected_total", "reason", "client_gone") == 1
        await admission.finish("default", holder.ticket)  # the freed slot admits nobody
        assert _idle(admission)
        assert _counted(metrics, "admission_admitted_total", "via", "admitted_after_park") == 0
        assert _sample(metrics, "extproc_internal_errors_total") == 0

    _run(scenario, PARK_ENV)


def test_a_stream_that_breaks_while_parked_leaves_the_queue_as_client_gone() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream()
        task = _serve(servicer, stream)
        await _park(admission, servicer, stream)
        stream.reset(ConnectionResetError("stream reset by peer"))
        await asyncio.wait_for(task, 5)  # not an error: the client is gone
        assert admission.gate("default").queue_depth == 0
        assert _counted(metrics, "admission_rejected_total", "reason", "client_gone") == 1
        assert _sample(metrics, "extproc_internal_errors_total") == 0
        await admission.finish("default", holder.ticket)
        assert _idle(admission)

    _run(scenario, PARK_ENV)


def test_a_stream_cancelled_while_parked_leaves_the_queue_as_client_gone() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream()
        task = _serve(servicer, stream)
        await _park(admission, servicer, stream)
        task.cancel()  # what grpc.aio does to the handler when Envoy resets the stream
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert admission.gate("default").queue_depth == 0
        assert _counted(metrics, "admission_rejected_total", "reason", "client_gone") == 1
        assert _sample(metrics, "extproc_internal_errors_total") == 0
        await admission.finish("default", holder.ticket)
        assert _idle(admission)

    _run(scenario, PARK_ENV)


# --- after admission: the ticket is finished exactly once ---------------------------------------


def _merged(calibration: Calibration) -> tuple[float, float]:
    calibration.engine_counted(0.0, 1.0)  # a first counter reading, then one that merges what is pending
    calibration.engine_counted(1_000.0, 2.0)
    return calibration.finished_bytes, calibration.finished_fixed


async def _finished(servicer: ExternalProcessor) -> tuple[float, float]:
    """What the estimator was told had finished: (text bytes, fixed tokens), each finish adding its
    request's ("hi" is two bytes, counted a token each, with the template's framing)."""
    return _merged(servicer.estimator.calibration["default"])


def _one_finish(servicer: ExternalProcessor, body: bytes) -> tuple[float, float]:
    """What one finish of `body` tells a fresh calibration."""
    calibration = Calibration(2.5, 1.0, 4.0, True)
    calibration.finished(scan_body(body), servicer.estimator.overhead)
    return _merged(calibration)


@pytest.mark.parametrize("how", ["read fails", "cancelled"])
def test_a_stream_reset_after_admission_finishes_the_ticket_once(how: str) -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        assert await stream.exchange(body_message(body)) == admitted()
        await _until(lambda: stream.reads == 3)  # waiting for the HTTP stream's end
        if how == "cancelled":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
            errors = 0.0
        else:  # a broken read outside a park fails the stream: counted, Envoy's failure mode decides
            stream.reset(ConnectionResetError("stream reset by peer"))
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(task, 5)
            errors = 1.0
        assert _idle(admission)
        assert await _finished(servicer) == _one_finish(servicer, body)  # one request's prompt, once
        assert _sample(metrics, "extproc_internal_errors_total") == errors

    _run(scenario)


def test_a_park_decision_and_a_stream_end_at_once_admit_then_free() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream()
        task = _serve(servicer, stream)
        await _park(admission, servicer, stream)
        stream.end()
        await admission.finish("default", holder.ticket)  # decided before the loop sees either
        await asyncio.wait_for(task, 5)
        assert stream.written[-1] == admitted()
        assert _idle(admission)
        assert await _finished(servicer) == _one_finish(servicer, chat_body())

    _run(scenario, PARK_ENV)


# --- rejected ------------------------------------------------------------------------------------


def test_a_full_queue_is_answered_503_with_retry_after_and_the_stream_ends() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        parked = await admission.arrive("default", "m")
        assert parked.outcome is Outcome.PARKED
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        assert await stream.exchange(body_message(body)) == rejected(
            503, "queue_full", "service_unavailable",
            "engine `default` is at capacity and its queue is full; retry later", retry_after="5")
        await asyncio.wait_for(task, 5)  # the servicer ends the stream itself
        assert stream.unanswered() == 0
        assert (admission.gate("default").queue_depth, admission.inflight) == (1, 1)  # the others, untouched
        assert _counted(metrics, "admission_rejected_total", "reason", "queue_full") == 1
        assert _sample(metrics, "admission_decision_latency_seconds_count", engine="default",
                       outcome="queue_full") == 1
        await admission.finish("default", holder.ticket)
        await admission.finish("default", parked.ticket)
        assert _idle(admission)

    _run(scenario, PARK_ENV)


def test_a_request_larger_than_the_kv_cache_is_answered_400_with_its_sizes() -> None:
    env = {**ENV, "ADMISSION_KV_BUDGET": "true", "ADMISSION_KV_CAPACITY_TOKENS": "1000"}

    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body(max_tokens=5000)
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        answer = await stream.exchange(body_message(body))
        await asyncio.wait_for(task, 5)
        decided = admission.recent("default")[-1]
        assert decided.outcome == "exceeds_kv_capacity"
        message = json.loads(answer.immediate_response.body)["error"]["message"]
        sizes = re.fullmatch(r"this request needs about (\d+) tokens of KV cache \(prompt ~(\d+) \+ up to 5000 "
                             r"generated\), more than engine `default` holds in total \(1000\); shorten the prompt "
                             r"or lower max_tokens", message)
        assert sizes is not None
        needed, prompt = int(sizes[1]), int(sizes[2])
        assert prompt + 5000 == decided.tokens and needed >= decided.tokens  # the gate rounds up to its blocks
        assert answer == rejected(400, "exceeds_kv_capacity", "invalid_request_error", message)
        assert _idle(admission)

    _run(scenario, env)


def test_a_request_during_shutdown_is_answered_503() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        await admission.shutdown()
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        assert await stream.exchange(body_message(body)) == rejected(
            503, "shutting_down", "service_unavailable", "the admission service is shutting down; retry", "5")
        await asyncio.wait_for(task, 5)
        assert _counted(metrics, "admission_rejected_total", "reason", "shutting_down") == 1
        assert _idle(admission)

    _run(scenario)


def test_a_body_prefix_over_the_cap_is_answered_413_json() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(headers_message([(":method", "POST"), (":path", "/v1/chat/completions"),
                                                      ("content-type", "application/json")])) == BUFFER_BODY
        prefix = body[:10] + b" " * (1048576 - 10)  # what Envoy cut at its buffer limit (the cap)
        assert await stream.exchange(body_message(prefix, end_of_stream=False)) == rejected(
            413, "body_too_large", "invalid_request_error", "request body exceeds the limit of 1048576 bytes")
        await asyncio.wait_for(task, 5)
        assert _counted(metrics, "admission_rejected_total", "reason", "body_too_large", "none", "") == 1
        assert _idle(admission) and admission.recent("default") == ()

    _run(scenario)


def test_a_declared_length_over_the_cap_is_answered_413_at_the_headers() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        assert await stream.exchange(headers_message([(":method", "POST"), (":path", "/v1/completions"),
                                                      ("content-length", "2000000")])) == rejected(
            413, "body_too_large", "invalid_request_error",
            "request body (2000000 bytes) exceeds the limit of 1048576 bytes")
        await asyncio.wait_for(task, 5)
        assert stream.reads == 1
        assert _counted(metrics, "admission_rejected_total", "reason", "body_too_large", "none", "") == 1

    _run(scenario)


@pytest.mark.parametrize(("body", "status", "outcome", "error_type", "message"), [
    (b"not json", 400, "invalid_body", "invalid_request_error", None),
    (b'{"messages": []}', 400, "missing_model", "invalid_request_error", None),
    (chat_body("nope"), 404, "unknown_model", "not_found_error", "The model `nope` does not exist. Known models: m"),
])
def test_a_body_that_cannot_be_admitted_is_answered_with_its_status(
        body: bytes, status: int, outcome: str, error_type: str, message: str | None) -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        answer = await stream.exchange(body_message(body))
        text = message or json.loads(answer.immediate_response.body)["error"]["message"]
        assert answer == rejected(status, outcome, error_type, text)
        await asyncio.wait_for(task, 5)
        assert _counted(metrics, "admission_rejected_total", "reason", outcome, "none", "") == 1
        assert _idle(admission) and admission.recent("default") == ()

    _run(scenario, {**ENV, "ADMISSION_MODELS_REFRESH_SECONDS": "0"})


# --- one-message routes (the headers phase skipped) ----------------------------------------------


def test_a_one_message_request_is_admitted_on_its_body_alone_then_freed_when_its_stream_ends() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream(metadata=route_metadata())
        task = _serve(servicer, stream)
        assert await stream.exchange(route_body_message(chat_body(), request_id="one-1")) == admitted()
        assert (admission.gate("default").inflight, admission.inflight) == (1, 1)
        assert await stream.exchange(pb.ProcessingRequest(response_headers=pb.HttpHeaders())) == \
            pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and stream.unanswered() == 0
        assert _counted(metrics, "admission_admitted_total", "via", "admitted") == 1
        assert _sample(metrics, "admission_decision_latency_seconds_count", engine="default", outcome="admitted") == 1

    _run(scenario)


def test_a_one_message_request_parks_and_is_admitted_when_a_slot_frees() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream(metadata=route_metadata())
        task = _serve(servicer, stream)
        assert await stream.exchange(route_body_message(chat_body())) == PARK_35S
        assert admission.gate("default").queue_depth == 1
        await admission.finish("default", holder.ticket)
        assert await stream.answer() == admitted()
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and stream.unanswered() == 0
        assert _counted(metrics, "admission_admitted_total", "via", "admitted_after_park") == 1

    _run(scenario, PARK_ENV)


def test_a_one_message_request_that_leaves_while_parked_leaves_the_queue_as_client_gone() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        stream = CannedStream(metadata=route_metadata())
        task = _serve(servicer, stream)
        assert await stream.exchange(route_body_message(chat_body())) == PARK_35S
        stream.end()
        await asyncio.wait_for(task, 5)
        assert admission.gate("default").queue_depth == 0 and stream.unanswered() == 0
        await admission.finish("default", holder.ticket)
        assert _idle(admission)

    _run(scenario, PARK_ENV)


def test_a_one_message_request_on_a_full_queue_is_answered_503_and_the_stream_ends() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        holder = await admission.arrive("default", "m")
        parked = await admission.arrive("default", "m")
        stream = CannedStream(metadata=route_metadata())
        task = _serve(servicer, stream)
        assert await stream.exchange(route_body_message(chat_body())) == rejected(
            503, "queue_full", "service_unavailable",
            "engine `default` is at capacity and its queue is full; retry later", retry_after="5")
        await asyncio.wait_for(task, 5)
        assert _counted(metrics, "admission_rejected_total", "reason", "queue_full") == 1
        await admission.finish("default", holder.ticket)
        await admission.finish("default", parked.ticket)
        assert _idle(admission)

    _run(scenario, PARK_ENV)


@pytest.mark.parametrize(("body", "status", "outcome"), [
    (b"", 400, "invalid_body"),
    (b"{not json", 400, "invalid_body"),
    (chat_body("nobody-serves-this"), 404, "unknown_model"),
    (b'{"messages": []}', 400, "missing_model"),
])
def test_a_one_message_body_that_cannot_be_admitted_is_answered_with_its_status(body: bytes, status: int,
                                                                                outcome: str) -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream(metadata=route_metadata())
        task = _serve(servicer, stream)
        answer = await stream.exchange(route_body_message(body))
        assert answer.immediate_response.status.code == status
        assert json.loads(answer.immediate_response.body)["error"]["code"] == outcome
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and admission.recent("default") == ()

    _run(scenario, {**ENV, "ADMISSION_MODELS_REFRESH_SECONDS": "0"})


def test_a_one_message_route_reads_the_endpoint_it_names_and_the_request_id_attribute() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        written: list[pb.ProcessingResponse] = []

        async def write(response: pb.ProcessingResponse) -> None:
            written.append(response)

        conversation = servicer.conversation(write, "/v1/completions")
        await conversation.receive(route_body_message(b'{"model": "m", "prompt": "hi", "max_tokens": 2}', "req-9"))
        assert repr(conversation.stream).startswith("<Stream req-9 /v1/completions open engine=default ")
        routed = conversation.stream.routed
        assert routed is not None and routed.endpoint.path == "/v1/completions" and routed.facts.prompt_bytes == 2
        await conversation.close()
        assert written == [admitted()] and _idle(admission)

    _run(scenario)


def test_a_one_message_stream_that_starts_with_headers_is_a_two_message_conversation() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream(metadata=route_metadata())
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(chat_headers(body)) == BUFFER_BODY
        assert await stream.exchange(body_message(body)) == admitted()
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission)

    _run(scenario)


# --- out of order --------------------------------------------------------------------------------


def test_a_stream_that_starts_with_a_body_is_answered_continue_until_it_ends() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        body = chat_body()
        assert await stream.exchange(body_message(body)) == CONTINUE_BODY
        assert await stream.exchange(chat_headers(body)) == CONTINUE_HEADERS
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and admission.recent("default") == ()
        assert _sample(metrics, "extproc_internal_errors_total") == 0

    _run(scenario)


def test_a_stream_that_starts_with_the_response_phase_is_answered_continue() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        assert await stream.exchange(pb.ProcessingRequest(response_headers=pb.HttpHeaders())) == \
            pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        assert await stream.exchange(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x"))) == \
            pb.ProcessingResponse(response_body=pb.BodyResponse())
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and admission.recent("default") == ()

    _run(scenario)


def test_trailers_instead_of_a_body_are_answered_continue_and_nothing_is_admitted() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        assert await stream.exchange(chat_headers(chat_body())) == BUFFER_BODY
        assert await stream.exchange(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())) == \
            pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and admission.recent("default") == ()

    _run(scenario)


def test_a_stream_that_ends_before_its_body_leaves_nothing_behind() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        assert await stream.exchange(chat_headers(chat_body())) == BUFFER_BODY
        stream.end()
        await asyncio.wait_for(task, 5)
        assert _idle(admission) and admission.recent("default") == ()

    _run(scenario)


def test_the_stream_state_has_a_readable_repr() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        written: list[pb.ProcessingResponse] = []

        async def write(response: pb.ProcessingResponse) -> None:
            written.append(response)

        conversation = servicer.conversation(write)
        body = chat_body()
        await conversation.receive(chat_headers(body, request_id="req-7"))
        assert repr(conversation) == "<Conversation <Stream req-7 /v1/chat/completions body engine=None None>>"
        await conversation.receive(body_message(body))
        assert repr(conversation.stream).startswith("<Stream req-7 /v1/chat/completions open engine=default ")
        await conversation.close()
        assert written == [BUFFER_BODY, admitted()] and _idle(admission)

    _run(scenario)


def test_read_errors_other_than_while_parked_are_not_swallowed() -> None:
    async def scenario(admission: Admission, metrics: Metrics, servicer: ExternalProcessor) -> None:
        stream = CannedStream()
        task = _serve(servicer, stream)
        stream.reset(grpc.aio.UsageError("broken"))
        with pytest.raises(grpc.aio.UsageError):
            await asyncio.wait_for(task, 5)
        assert _sample(metrics, "extproc_internal_errors_total") == 1

    _run(scenario)
