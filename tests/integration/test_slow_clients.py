"""Slow clients cannot lock everyone out of the listener.

Hundreds of connections that send a partial request header and then one byte now and then (a
slowloris) once held every slot of Envoy's connection cap (166 for the default 512 MiB limit) for
as long as they trickled: every new client was refused. The generated config closes each of them
`REQUEST_HEADERS_TIMEOUT_SECONDS` after its first byte (a 408), whatever it trickles, so a new
client is served once that has passed. The real Envoy with the deployment's overload manager, the
real service and the simulator, on loopback; every loop is bounded in count and time.
"""

from __future__ import annotations

import http.client
import socket
import threading

import pytest

from devstack import wait_until
from extproc.config import load_settings
from extproc.envoyconf import (
    DEFAULT_ENVOY_MEMORY_LIMIT_BYTES,
    REQUEST_HEADERS_TIMEOUT_SECONDS,
    max_downstream_connections,
)

from .conftest import Stack

pytestmark = pytest.mark.integration

SLOW_CLIENTS = 400  # well past the cap: the fault run used 170
PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nx-slow: "


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """One more header byte on every slow connection every 2 s, until stopped or 120 s have passed."""
    for _ in range(60):
        if stop.wait(2.0):
            return
        for sock in socks:
            try:
                sock.send(b"a")
            except OSError:
                pass  # closed by Envoy: counted when the test reads it


def _served(stack: Stack) -> int | None:
    """A normal client's GET /v1/models: its status, or None when its connection was refused."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.local.envoy_port, timeout=10)
    try:
        conn.request("GET", "/v1/models")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def _closed_how(sock: socket.socket) -> str:
    """`408` for a connection Envoy answered (the headers timeout), `refused` for one it closed unanswered."""
    sock.settimeout(10)
    try:
        head = sock.recv(64)
    except OSError:
        return "refused"  # reset
    if head.startswith(b"HTTP/1.1 408"):
        return "408"
    return "refused" if head == b"" else head.decode(errors="replace")


def test_slow_header_connections_cannot_refuse_new_clients_beyond_the_headers_timeout(make_stack) -> None:  # noqa: ANN001
    stack = make_stack(envoy_args={"memory_limit_bytes": DEFAULT_ENVOY_MEMORY_LIMIT_BYTES})
    cap = max_downstream_connections(DEFAULT_ENVOY_MEMORY_LIMIT_BYTES,
                                     load_settings(stack.local.service_env()).max_body_bytes)
    assert cap < SLOW_CLIENTS
    socks: list[socket.socket] = []
    stop = threading.Event()
    trickler = threading.Thread(target=_trickle, args=(socks, stop), daemon=True)
    try:
        for _ in range(SLOW_CLIENTS):
            sock = socket.create_connection(("127.0.0.1", stack.local.envoy_port), timeout=10)
            try:
                sock.sendall(PARTIAL_HEAD)
            except OSError:
                pass  # refused at once: over the cap
            socks.append(sock)
        trickler.start()
        # Every slot is taken by a slow client, the rest refused.
        wait_until(lambda: stack.envoy_stat("^listener\\..*downstream_global_cx_overflow$") >= SLOW_CLIENTS - cap,
                   30, "the connections over the cap to be refused")

        # A normal client that retries a refused connection is served once the headers timeout has
        # closed the slow ones (it was refused for as long as they trickled); the deadline is generous.
        attempts: list[int | None] = []
        wait_until(lambda: attempts.append(_served(stack)) or attempts[-1] == 200,
                   REQUEST_HEADERS_TIMEOUT_SECONDS * 3 + 60, "a new client to be served", interval=0.2)

        # Each slow connection was either answered 408 by the headers timeout (every slot of the
        # cap, and any a slot freed early went to) or refused at once.
        stop.set()
        closed = [_closed_how(sock) for sock in socks]
        assert closed.count("408") + closed.count("refused") == SLOW_CLIENTS, sorted(set(closed))
        assert closed.count("408") >= cap
        assert stack.envoy_stat("^http\\.inference\\.downstream_rq_header_timeout$") == closed.count("408")
        print(f"\n{SLOW_CLIENTS} slow-header connections, cap {cap}: {closed.count('408')} answered 408 by the "
              f"headers timeout, {closed.count('refused')} refused at once; the new client was refused "
              f"{attempts.count(None)} times, then served")
    finally:
        stop.set()
        for sock in socks:
            sock.close()
        if trickler.is_alive():
            trickler.join(10)


def test_idle_keep_alive_connections_give_their_slots_up_as_the_cap_nears(make_stack) -> None:  # noqa: ANN001
    """At 90% of the connection cap the overload manager scales the 60 s downstream idle timeout down
    to 1 s: idle keep-alive connections are closed long before 60 s, leaving slots for new clients."""
    from extproc.envoyconf import DOWNSTREAM_IDLE_TIMEOUT_SECONDS

    cap = 10
    stack = make_stack(envoy_args={"memory_limit_bytes": DEFAULT_ENVOY_MEMORY_LIMIT_BYTES,
                                   "downstream_connections": cap})
    conns = [http.client.HTTPConnection("127.0.0.1", stack.local.envoy_port, timeout=30) for _ in range(cap - 1)]
    try:
        for conn in conns:  # one request each, then the connection stays open and idle (keep-alive)
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
        # Well before the unscaled 60 s (a generous deadline, not a measurement), Envoy closes them.
        wait_until(lambda: stack.envoy_stat("^http\\.inference\\.downstream_cx_idle_timeout$") >= 1,
                   DOWNSTREAM_IDLE_TIMEOUT_SECONDS * 2 // 3, "Envoy to close idle connections under pressure")
        assert _served(stack) == 200
    finally:
        for conn in conns:
            conn.close()
