"""A parked ticket decided while its park response is still being written keeps its decision.

The interleaving is forced with canned ext_proc events: a stand-in for grpc.aio's servicer
context (Envoy's side of the stream) runs a completion inside the `write` of the park answer,
exactly where the event loop can run one in production. The service's own objects are real.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from extproc.admission import Admission
from extproc.config import load_settings
from extproc.gate import EngineSnapshot
from extproc.metrics import Metrics
from extproc.outcomes import Outcome
from extproc.servicer import ExternalProcessor
from extproc.wire import base_pb2, pb

ENV = {"ADMISSION_OBSERVE_MODELS": "m", "ADMISSION_MAX_INFLIGHT": "1", "ADMISSION_KV_BUDGET": "false"}


def _request(model: str = "m") -> list[pb.ProcessingRequest]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"),
               ("content-length", str(len(body)))]
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]


class CannedStream:
    """Envoy's side of one ext_proc stream: canned messages in, answers recorded, a hook per answer."""

    def __init__(self, messages: list[pb.ProcessingRequest], on_write: Callable[[pb.ProcessingResponse], object]) -> None:
        self._messages = list(messages)
        self._on_write = on_write
        self.written: list[pb.ProcessingResponse] = []
        self.ended = asyncio.Event()  # the HTTP stream is over: further reads see EOF

    async def read(self) -> object:
        if self._messages:
            return self._messages.pop(0)
        await self.ended.wait()
        return grpc.aio.EOF

    async def write(self, response: pb.ProcessingResponse) -> None:
        self.written.append(response)
        await asyncio.sleep(0)  # a real write yields to the loop: other streams run here
        result = self._on_write(response)
        if inspect.isawaitable(result):
            await result


async def _setup() -> tuple[Admission, Metrics, ExternalProcessor]:
    settings = load_settings(ENV)
    metrics = Metrics(CollectorRegistry())
    admission = Admission(settings, metrics)
    await admission.observe("default", EngineSnapshot(running=0, waiting=0, kv_usage=0.0, scrape_started=admission.now()))
    return admission, metrics, ExternalProcessor(settings, admission, metrics)


def test_wait_returns_a_decision_made_before_it_was_called() -> None:
    async def scenario() -> None:
        admission, _, _ = await _setup()
        first = await admission.arrive("default", "m")
        parked = await admission.arrive("default", "m")
        assert (first.outcome, parked.outcome) == (Outcome.ADMITTED, Outcome.PARKED)
        await admission.finish("default", first.ticket)  # admits the parked ticket before anyone waits
        decision = await asyncio.wait_for(admission.wait("default", parked.ticket), 1)
        assert decision.outcome is Outcome.ADMITTED_AFTER_PARK

    asyncio.run(scenario())


def test_a_completion_during_the_park_write_admits_the_request_without_an_internal_error() -> None:
    async def scenario() -> None:
        admission, metrics, servicer = await _setup()
        holder = await admission.arrive("default", "m")  # the one slot is taken
        assert holder.outcome is Outcome.ADMITTED

        async def on_write(response: pb.ProcessingResponse) -> None:
            if response.HasField("override_message_timeout"):
                await admission.finish("default", holder.ticket)  # the holder completes mid-write
            elif response.HasField("request_body"):
                stream.ended.set()  # admitted: the request goes upstream and completes

        stream = CannedStream(_request(), on_write)
        await asyncio.wait_for(servicer.Process(None, stream), 5)  # type: ignore[arg-type]
        kinds = [r.WhichOneof("response") or "override_message_timeout" for r in stream.written]
        assert kinds == ["request_headers", "override_message_timeout", "request_body"]
        mutation = stream.written[-1].request_body.response.header_mutation.set_headers
        assert [h.header.key for h in mutation] == ["x-admission-engine"]
        assert metrics.registry.get_sample_value("extproc_internal_errors_total") == 0
        gate = admission.gate("default")
        assert (gate.queue_depth, gate.inflight) == (0, 0)

    asyncio.run(scenario())


def test_a_park_write_that_fails_takes_the_ticket_out_of_the_queue() -> None:
    async def scenario() -> None:
        admission, _, servicer = await _setup()
        holder = await admission.arrive("default", "m")

        def on_write(response: pb.ProcessingResponse) -> None:
            if response.HasField("override_message_timeout"):
                raise grpc.aio.UsageError("RPC already finished")  # the client left as it parked

        stream = CannedStream(_request(), on_write)
        try:
            await asyncio.wait_for(servicer.Process(None, stream), 5)  # type: ignore[arg-type]
        except grpc.aio.UsageError:
            pass
        gate = admission.gate("default")
        assert gate.queue_depth == 0  # not left to block the queue until the park cap
        await admission.finish("default", holder.ticket)
        assert gate.inflight == 0

    asyncio.run(scenario())
