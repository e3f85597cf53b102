"""A parked ticket decided while its park response is still being written keeps its decision.

The interleaving is forced with canned ext_proc events: a stand-in for grpc.aio's servicer
context (Envoy's side of the stream) runs a completion inside the `write` of the park answer,
exactly where the event loop can run one in production. The service's own objects are real.
"""

from __future__ import annotations

import asyncio

import grpc

from extproc.outcomes import Outcome
from extproc.wire import pb

from .conversation_helpers import CannedStream, chat_request as _request, start_stack as _setup


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
