"""The local stack: it survives losing a race for a port it picked (what made a CI run fail once), and
`make run` (`python -m devstack`) never starts a gateway that lies: a busy port, a bad setting or an
unreachable engine is one line and a non-zero exit; Ctrl-C answers parked requests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devstack import PORT_VARIABLES, ChildExited, LocalStack, busy_ports, free_port, http_get, wait_until

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


# --- `make run` (python -m devstack) as a newcomer meets it ----------------------------------------


def _devstack_env(tmp_path: Path, **extra: str) -> tuple[dict[str, str], dict[str, int]]:
    ports = {var: free_port() for _, var, _, _ in PORT_VARIABLES}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ADMISSION_", "EXTPROC_", "ENGINE", "DEVSTACK_"))}
    env.update({var: str(port) for var, port in ports.items()})
    env.update(extra)
    return env, ports


def _run_devstack(tmp_path: Path, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devstack", "--workdir", str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_an_unreachable_engine_is_waited_for_with_the_reason_then_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nobody listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        engine = f"http://127.0.0.1:{closed.getsockname()[1]}"
        env, ports = _devstack_env(tmp_path, ENGINE_URL=engine, DEVSTACK_ENGINE_WAIT_SECONDS="2")
        proc = _run_devstack(tmp_path, env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"engine unreachable at {engine} (" in proc.stdout  # said while waiting, with the reason
    assert "refused" in proc.stdout.lower()
    assert proc.stderr.strip().splitlines() == [
        f"devstack: engine unreachable at {engine} for 2 s ([Errno 111] Connection refused); "
        "not starting a gateway that could not gate it"]
    assert "Try:" not in proc.stdout and "Traceback" not in proc.stderr
    assert busy_ports({"envoy": ports["DEVSTACK_PORT"], "status": ports["DEVSTACK_STATUS_PORT"]}) == []


def test_a_busy_port_is_named_before_anything_starts(tmp_path: Path) -> None:
    env, ports = _devstack_env(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports["DEVSTACK_STATUS_PORT"]))
        squatter.listen()
        proc = _run_devstack(tmp_path, env)
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        f"devstack: port(s) already in use on 127.0.0.1: {ports['DEVSTACK_STATUS_PORT']} (DEVSTACK_STATUS_PORT)")
    assert proc.stdout == ""  # nothing was started, no "ready", no curl line
    assert busy_ports({"engine": ports["DEVSTACK_ENGINE_PORT"]}) == []


def test_a_bad_setting_is_one_line_without_a_traceback(tmp_path: Path) -> None:
    env, _ = _devstack_env(tmp_path, ADMISSION_MAX_PARK_SECONDS="abc")
    proc = _run_devstack(tmp_path, env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "devstack: configuration error: ADMISSION_MAX_PARK_SECONDS='abc': must be a number > 0.0 and <= 3590.0"]
    assert proc.stdout == ""


def test_ctrl_c_answers_a_parked_request_503_shutting_down(tmp_path: Path) -> None:
    env, ports = _devstack_env(tmp_path, ENGINE_POLL_INTERVAL_SECONDS="0.2")
    # Its own process group, as a shell's foreground job is: Ctrl-C is SIGINT to that whole group.
    with (tmp_path / "devstack.out").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "devstack", "--workdir", str(tmp_path / "run")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    envoy = f"http://127.0.0.1:{ports['DEVSTACK_PORT']}"
    status = f"http://127.0.0.1:{ports['DEVSTACK_STATUS_PORT']}"
    engine = f"http://127.0.0.1:{ports['DEVSTACK_ENGINE_PORT']}"
    try:
        wait_until(lambda: "Ctrl-C stops all 3 (enginesim, extproc, envoy)" in (tmp_path / "devstack.out").read_text(),
                   60, "the banner")
        banner = (tmp_path / "devstack.out").read_text()
        assert f"status page:                 {status}/" in banner
        post(engine + "/control/pin", b'{"running": 4, "waiting": 1}', {"content-type": "application/json"})
        wait_until(lambda: '"gate_open": false' in http_get(status + "/debug/engines")[1].decode(), 30, "gate closed")
        with ThreadPoolExecutor(1) as pool:
            parked = pool.submit(post, envoy + "/v1/chat/completions", chat_body("parked"), None, 60)
            wait_until(lambda: '"queue_depth": 1' in http_get(status + "/debug/engines")[1].decode(), 30, "a park")
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
            reply = parked.result(timeout=60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert reply.status == 503, reply.body
    assert reply.headers["x-admission-outcome"] == "shutting_down"
    assert busy_ports(ports) == []  # every child is gone


def test_an_unknown_engine_kind_is_named_before_anything_starts(tmp_path: Path) -> None:
    env, _ = _devstack_env(tmp_path, ENGINE="vllm-gpu")
    proc = _run_devstack(tmp_path, env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("devstack: ENGINE='vllm-gpu': must be sim (the embedded simulator) or vllm")
    assert proc.stdout == ""
