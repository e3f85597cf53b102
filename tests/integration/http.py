"""A plain HTTP/1.1 client for the tests: what curl would send, nothing rewritten."""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(url: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 30.0,
         chunked: bool = False) -> Reply:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        hdrs = {"content-type": "application/json", **(headers or {})}
        if chunked:
            conn.putrequest("POST", parts.path)
            for k, v in {**hdrs, "transfer-encoding": "chunked"}.items():
                conn.putheader(k, v)
            conn.endheaders()
            for i in range(0, len(body), 65536):
                piece = body[i:i + 65536]
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            conn.send(b"0\r\n\r\n")
        else:
            conn.request("POST", parts.path, body=body, headers=hdrs)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def get(url: str, timeout: float = 10.0) -> Reply:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def chat_body(content: str = "Hello", model: str = "sim-model", model_last: bool = False, **extra: Any) -> bytes:
    """A chat request; `model_last` puts `model` after everything else, as some clients do."""
    doc: dict[str, Any] = {} if model_last else {"model": model}
    doc["messages"] = [{"role": "user", "content": content}]
    doc.update(extra)
    if model_last:
        doc["model"] = model
    return json.dumps(doc).encode()


def open_raw(url: str, body: bytes, request_id: str) -> socket.socket:
    """Send a request on a raw socket and return it unread, so a test can hang up mid-park."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}\r\ncontent-type: application/json\r\n"
        f"x-request-id: {request_id}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock
