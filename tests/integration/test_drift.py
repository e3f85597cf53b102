"""Max in-flight must equal the engine's --max-num-seqs, which no engine gauge shows. vLLM never
runs more than --max-num-seqs at once, so an engine reporting more running requests than the
configured limit proves the two differ: the service logs it once per transition, counts it
(`admission_engine_limit_drift_total`) and shows by how much (`admission_engine_running_over_limit`)."""

from __future__ import annotations

import json
from collections.abc import Callable

from devstack import wait_until

from .conftest import Stack

DRIFT_LOG = "the engine runs more requests than max_inflight"
BACK_LOG = "the engine runs no more requests than max_inflight again"


def _records(stack: Stack, message: str) -> list[dict]:
    out = []
    for line in stack.service_log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and str(record.get("msg", "")).startswith(message):
            out.append(record)
    return out


def test_running_above_max_inflight_is_logged_once_counted_and_shown(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack({"ADMISSION_MAX_INFLIGHT": "3", "EXTPROC_LOG_FORMAT": "json"})
    stack.wait_state(lambda s: s["state"] == "fresh", "the first poll")
    # From the start: the counter at 0, nothing over the limit, nothing logged.
    assert stack.metric("admission_engine_limit_drift_total", engine="default") == 0
    assert stack.metric("admission_engine_running_over_limit", engine="default") == 0

    # Running exactly at the limit is not drift.
    stack.pin(running=3, waiting=0)
    wait_until(lambda: stack.metric("vllm_requests_running", engine="default") == 3, 10,
               "the gateway to read running=3")
    assert stack.metric("admission_engine_limit_drift_total", engine="default") == 0
    assert _records(stack, DRIFT_LOG) == []

    # An engine started with --max-num-seqs 8 behind a gateway configured for 3.
    stack.pin(running=5, waiting=0)
    wait_until(lambda: stack.metric("admission_engine_running_over_limit", engine="default") == 2, 10,
               "running_over_limit to read 2")
    assert stack.metric("admission_engine_limit_drift_total", engine="default") == 1
    # Many more polls at running=5: still one transition, one log line.
    polls = stack.metric("engine_poll_duration_seconds_count", engine="default")
    wait_until(lambda: stack.metric("engine_poll_duration_seconds_count", engine="default") >= polls + 5, 10,
               "5 more polls")
    stack.pin(running=7)
    wait_until(lambda: stack.metric("admission_engine_running_over_limit", engine="default") == 4, 10, "over by 4")
    assert stack.metric("admission_engine_limit_drift_total", engine="default") == 1
    [record] = _records(stack, DRIFT_LOG)
    assert record["level"] == "WARNING" and record["logger"] == "extproc.observer"
    assert record["engine"] == "default" and record["running"] == 5 and record["max_inflight"] == 3

    # Back within the limit: shown at 0, logged once; drifting again counts a second transition.
    stack.pin(running=1)
    wait_until(lambda: stack.metric("admission_engine_running_over_limit", engine="default") == 0, 10, "back to 0")
    wait_until(lambda: len(_records(stack, BACK_LOG)) == 1, 5, "the recovery to be logged")
    stack.pin(running=4)
    wait_until(lambda: stack.metric("admission_engine_limit_drift_total", engine="default") == 2, 10,
               "a second transition")
    assert len(_records(stack, DRIFT_LOG)) == 2
