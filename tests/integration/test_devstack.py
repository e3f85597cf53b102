"""The local stack survives losing a race for a port it picked (what made a CI run fail once)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from devstack import ChildExited, LocalStack

from .conftest import FAST
from .http import chat_body, post


def test_a_picked_port_taken_before_the_child_binds_it_is_picked_again(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path, extproc_env=FAST)
    taken = stack.grpc_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            stack.start()
            assert stack.grpc_port != taken
            assert post(stack.url + "/v1/chat/completions", chat_body()).status == 200
        finally:
            stack.stop()


def test_a_fixed_port_that_is_taken_fails_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        stack = LocalStack(tmp_path, extproc_env=FAST, grpc_port=squatter.getsockname()[1])
        with pytest.raises(ChildExited, match="cannot listen on 127.0.0.1:[0-9]+ \\(EXTPROC_LISTEN\\)") as info:
            stack.start()
        assert "Traceback" not in info.value.output  # one clear line, not a stack dump
