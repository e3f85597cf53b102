"""Envoy's side of an ext_proc stream, in process: canned messages in, the servicer's answers out.

`CannedStream` stands in for grpc.aio's servicer context (`read` / `write`, the stream's gRPC
metadata), the way httpcore's
tests feed canned bytes to its connection: the service's own objects (settings, admission, gate,
metrics, servicer) are real. Messages can be queued up front or sent one at a time and answered
(`exchange`); the stream can end (`end`, or the `ended` event) or break (`reset`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Mapping

import grpc
from google.protobuf import struct_pb2
from prometheus_client import CollectorRegistry

from extproc.admission import Admission
from extproc.config import load_settings
from extproc.contract import ENDPOINT_METADATA, EXT_PROC_ATTRIBUTES, REQUEST_ID_ATTRIBUTE
from extproc.gate import EngineSnapshot
from extproc.metrics import Metrics
from extproc.servicer import ExternalProcessor
from extproc.wire import base_pb2, pb

#: One engine `default` serving `m`, one request at a time, no KV budget.
ENV = {"ADMISSION_OBSERVE_MODELS": "m", "ADMISSION_MAX_INFLIGHT": "1", "ADMISSION_KV_BUDGET": "false"}


def headers_message(headers: list[tuple[str, str]], end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]),
        end_of_stream=end_of_stream))


def body_message(body: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def chat_body(model: str = "m", **fields: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       **fields}).encode()


def chat_headers(body: bytes, path: str = "/v1/chat/completions", request_id: str = "r-1") -> pb.ProcessingRequest:
    return headers_message([(":method", "POST"), (":path", path), ("content-type", "application/json"),
                            ("content-length", str(len(body))), ("x-request-id", request_id)])


def route_body_message(body: bytes, request_id: str = "r-1") -> pb.ProcessingRequest:
    """A one-message route's only message: the whole body, the request id as Envoy's attribute."""
    attributes = struct_pb2.Struct()
    attributes.update({REQUEST_ID_ATTRIBUTE: request_id})
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True),
                                attributes={EXT_PROC_ATTRIBUTES: attributes})


def route_metadata(path: str = "/v1/chat/completions") -> tuple[tuple[str, str], ...]:
    """The gRPC metadata of a one-message route's stream: the gated path it names."""
    return ((ENDPOINT_METADATA, path),)


def chat_request(model: str = "m") -> list[pb.ProcessingRequest]:
    """A chat completion's two request-phase messages: headers, then the whole body."""
    body = chat_body(model)
    return [chat_headers(body), body_message(body)]


class CannedStream:
    """Envoy's side of one ext_proc stream: canned messages in, answers recorded, a hook per answer."""

    def __init__(self, messages: list[pb.ProcessingRequest] | None = None,
                 on_write: Callable[[pb.ProcessingResponse], object] | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._messages = list(messages or ())
        self._metadata = metadata
        self._on_write = on_write
        self._error: BaseException | None = None
        self._arrived = asyncio.Event()
        self._answers: asyncio.Queue[pb.ProcessingResponse] = asyncio.Queue()
        self.written: list[pb.ProcessingResponse] = []
        self.reads = 0  # reads the servicer started
        self.ended = asyncio.Event()  # the HTTP stream is over: further reads see EOF

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The stream's gRPC metadata (a one-message route names its gated path there)."""
        return self._metadata

    async def read(self) -> object:
        self.reads += 1
        while True:
            if self._messages:
                return self._messages.pop(0)
            if self._error is not None:
                raise self._error
            if self.ended.is_set():
                return grpc.aio.EOF
            self._arrived.clear()
            waits = [asyncio.ensure_future(self._arrived.wait()), asyncio.ensure_future(self.ended.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def write(self, response: pb.ProcessingResponse) -> None:
        self.written.append(response)
        self._answers.put_nowait(response)
        await asyncio.sleep(0)  # a real write yields to the loop: other streams run here
        if self._on_write is not None:
            result = self._on_write(response)
            if inspect.isawaitable(result):
                await result

    def send(self, message: pb.ProcessingRequest) -> None:
        """Envoy sends one more message."""
        self._messages.append(message)
        self._arrived.set()

    def end(self) -> None:
        """The HTTP stream ends: reads see EOF once the queued messages are read."""
        self.ended.set()

    def reset(self, error: BaseException) -> None:
        """The stream breaks: reads raise `error` once the queued messages are read."""
        self._error = error
        self._arrived.set()

    async def answer(self, timeout: float = 5.0) -> pb.ProcessingResponse:
        """The servicer's next answer (waits for it)."""
        return await asyncio.wait_for(self._answers.get(), timeout)

    async def exchange(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
        """Send one message and return the answer to it."""
        self.send(message)
        return await self.answer()

    def unanswered(self) -> int:
        """Answers written that no `answer` / `exchange` has collected."""
        return self._answers.qsize()


async def start_stack(env: Mapping[str, str] = ENV) -> tuple[Admission, Metrics, ExternalProcessor]:
    """Settings, metrics (initialised), admission with every engine freshly observed idle, and the servicer."""
    settings = load_settings(env)
    metrics = Metrics(CollectorRegistry())
    metrics.initialise(settings)  # every configured series at 0, as the service starts
    admission = Admission(settings, metrics)
    for engine in settings.engines:
        await admission.observe(engine.name, EngineSnapshot(running=0, waiting=0, kv_usage=0.0,
                                                            scrape_started=admission.now()))
    return admission, metrics, ExternalProcessor(settings, admission, metrics)
