"""What a request leaves behind while it is parked or streams (issue 14), and gauges read on scrape.

A parked or admitted request holds its ext_proc stream for as long as it waits or generates (up
to thousands at once): its coroutines must not keep the request body (up to MAX_BODY_BYTES) alive.
The stream's coroutine chain is inspected frame by frame while the request is parked and while it
is admitted and open; the stand-in for Envoy's side of the stream is conversation_helpers'.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.metrics import Metrics
from extproc.outcomes import Outcome
from extproc.wire import pb

from .conversation_helpers import CannedStream, chat_request as _request, start_stack as _setup


def _frame_locals(task: asyncio.Task[Any]) -> list[object]:
    """Every local of every coroutine frame the task is suspended in, outermost first."""
    values: list[object] = []
    coro: Any = task.get_coro()
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        values.extend(coro.cr_frame.f_locals.values())
        coro = coro.cr_await
    return values


def _holds_the_body(values: list[object], body: bytes) -> bool:
    for value in values:
        if isinstance(value, pb.ProcessingRequest) and value.HasField("request_body"):
            return True
        if isinstance(value, pb.HttpBody) or (isinstance(value, bytes) and value == body):
            return True
    return False


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0)  # yield to the stream's task until it reaches the state


@pytest.mark.parametrize("parked", [False, True])
def test_a_parked_or_admitted_request_does_not_keep_its_body(parked: bool) -> None:
    async def scenario() -> None:
        admission, _, servicer = await _setup()
        holder = None
        if parked:
            holder = await admission.arrive("default", "m")  # the one slot is taken: the next request parks
            assert holder.outcome is Outcome.ADMITTED
        messages = _request()
        body = messages[1].request_body.body
        stream = CannedStream(messages, lambda response: None)
        task = asyncio.ensure_future(servicer.Process(None, stream))  # type: ignore[arg-type]
        want = "override_message_timeout" if parked else "request_body"
        await asyncio.wait_for(_until(lambda: any(r.HasField(want) for r in stream.written)), 5)
        await asyncio.sleep(0)
        assert not task.done()
        assert admission.gate("default").queue_depth == (1 if parked else 0)
        assert not _holds_the_body(_frame_locals(task), body)
        if holder is not None:
            await admission.finish("default", holder.ticket)  # room: the parked request is admitted
            await asyncio.wait_for(_until(lambda: any(r.HasField("request_body") for r in stream.written)), 5)
            await asyncio.sleep(0)
            assert admission.inflight == 1 and not task.done()
            assert not _holds_the_body(_frame_locals(task), body)
        stream.ended.set()
        await asyncio.wait_for(task, 5)
        assert admission.inflight == 0

    asyncio.run(scenario())


def test_the_engine_gauges_are_read_when_scraped() -> None:
    async def scenario() -> None:
        admission, metrics, _ = await _setup()

        def sample(name: str) -> float | None:
            return metrics.registry.get_sample_value(name, {"engine": "default"})

        assert (sample("admission_inflight"), sample("admission_queue_depth")) == (0, 0)
        first = await admission.arrive("default", "m", tokens=100)
        second = await admission.arrive("default", "m", tokens=50)
        assert (first.outcome, second.outcome) == (Outcome.ADMITTED, Outcome.PARKED)
        assert (sample("admission_inflight"), sample("admission_queue_depth")) == (1, 1)
        assert sample("admission_kv_reserved_tokens") == first.ticket.reserved
        assert sample("admission_effective_load") == 1
        assert sample("engine_state_is_stale") == 0
        await admission.finish("default", first.ticket)  # admits the parked one
        assert (sample("admission_inflight"), sample("admission_queue_depth")) == (1, 0)
        await admission.finish("default", second.ticket)
        assert (sample("admission_inflight"), sample("admission_kv_reserved_tokens")) == (0, 0)

    asyncio.run(scenario())


def test_metric_children_are_kept_and_are_the_labelled_ones() -> None:
    metrics = Metrics(CollectorRegistry())
    child = metrics.child(metrics.admitted, "default", "m", "admitted")
    assert metrics.child(metrics.admitted, "default", "m", "admitted") is child
    child.inc()
    assert metrics.registry.get_sample_value(
        "admission_admitted_total", {"engine": "default", "model": "m", "via": "admitted"}) == 1
    assert metrics.child(metrics.rejected, "default", "m", "queue_full") is not child
