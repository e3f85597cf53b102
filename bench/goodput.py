"""The capacity bound a deadline scenario's goodput is judged against (`goodput_bound`).

Issue 22: "the most requests the engine could finish within their deadlines at its measured
capacity (prefill and decode rates from the run itself)". Computed here as the number of the
run's own requests that an IDEALISED engine finishes in time when it runs them in
earliest-deadline-first order:

- prefill is one serial resource at the run's measured prefill rate (tokens/s): a request's
  prompt takes `prompt / prefill_rate` seconds, one prompt after another;
- decode runs in `lanes` parallel lanes (the engine's max-num-seqs), each at the measured decode
  rate at full batch divided by the lanes, and never slows the prefill (the idealisation); the
  prefill samples the first output token, so `output - 1` tokens are decoded;
- a request holds a lane and its whole KV (prompt + its output) from the start of its prefill to
  its end, and the KV held at once never exceeds `kv_tokens`: no preemption, no recompute;
- the scheduler knows every request's output length and deadline, starts a request only if it
  will finish by its deadline (work on a request whose client leaves is never spent), and at each
  moment starts the earliest-deadline request that can still make it and fits.

Greedy EDF is not proven optimal for this model, so the figure is an estimate of the bound, not
a theorem; it is an upper-bound-STYLE figure in that the engine it models never wastes a step,
never preempts and never starts a request it cannot finish. Pure: no clock, no IO.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    arrival: float  # seconds (any origin, the same for all)
    deadline: float  # absolute, same clock; math.inf for none
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Capacity:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # all lanes together, at full batch
    lanes: int  # max-num-seqs
    kv_tokens: int  # the engine's KV capacity


def edf_goodput(jobs: Sequence[Job], cap: Capacity, max_events: int = 1_000_000) -> int:
    """How many of `jobs` the idealised engine `cap` finishes by their deadlines (see above)."""
    if cap.prefill_tokens_per_s <= 0 or cap.decode_tokens_per_s <= 0 or cap.lanes < 1 or cap.kv_tokens < 1:
        raise ValueError(f"capacity must be positive: {cap}")
    lane_rate = cap.decode_tokens_per_s / cap.lanes
    pending = sorted(jobs, key=lambda j: j.arrival)
    ready: list[Job] = []  # arrived, not started, still able to make it
    running: list[tuple[float, int]] = []  # heap of (end, kv tokens)
    t = pending[0].arrival if pending else 0.0
    prefill_free = t
    kv_held = 0
    finished = 0
    nxt = 0
    for _ in range(max_events):
        while running and running[0][0] <= t:
            kv_held -= heapq.heappop(running)[1]
        while nxt < len(pending) and pending[nxt].arrival <= t:
            ready.append(pending[nxt])
            nxt += 1
        ready.sort(key=lambda j: j.deadline)
        started = False
        if prefill_free <= t:
            still: list[Job] = []
            for job in ready:
                need = job.prompt_tokens + job.output_tokens
                end = t + job.prompt_tokens / cap.prefill_tokens_per_s + max(0, job.output_tokens - 1) / lane_rate
                if end > job.deadline or need > cap.kv_tokens:
                    continue  # it can no longer make it (a later start only ends later): dropped
                if not started and len(running) < cap.lanes and kv_held + need <= cap.kv_tokens:
                    started = True
                    finished += 1
                    kv_held += need
                    heapq.heappush(running, (end, need))
                    prefill_free = t + job.prompt_tokens / cap.prefill_tokens_per_s
                    continue
                still.append(job)
            ready = still
        if not ready and nxt >= len(pending):
            return finished
        candidates = []
        if nxt < len(pending):
            candidates.append(pending[nxt].arrival)
        if ready:
            if prefill_free > t:
                candidates.append(prefill_free)
            elif not started and running:
                candidates.append(running[0][0])  # blocked on lanes or KV: the next end frees some
            elif started:
                candidates.append(prefill_free)
        if not candidates:
            return finished
        t = max(t, min(candidates))
    raise RuntimeError(f"edf_goodput: no end after {max_events} events")


def measured_capacity(completed: Sequence[tuple[int, int, float, float]], lanes: int, kv_tokens: int,
                      prefill_work: int | None = None, prefill_span_s: float | None = None) -> Capacity | None:
    """The run's own prefill and decode rates, on the engine's clock. `completed`: each completed
    request's (prompt tokens, output tokens, TTFT s, e2e s).

    - prefill rate: the larger of the engine's prefill work over the run (`prefill_work` tokens:
      prompts and recompute, in `prefill_span_s` seconds from the first send to the last answer:
      what an engine kept busy prefilling achieves, its decode steps included) and the
      fastest prompt / TTFT any one request saw (the one that queued least);
    - decode rate: the fastest per-sequence rate (output - 1) / (e2e - TTFT) any request with more
      than one output token saw, in each of `lanes` lanes (the idealisation: decode never slows
      prefill, so the least-disturbed decode is the lane's rate).

    None where no completed request allows a figure."""
    prefill = [p / ttft for p, _, ttft, _ in completed if ttft > 0 and p > 0]
    if prefill_work and prefill_span_s and prefill_span_s > 0:
        prefill.append(prefill_work / prefill_span_s)
    decode = [(o - 1) / (e2e - ttft) for _, o, ttft, e2e in completed if o > 1 and e2e > ttft]
    if not prefill or not decode:
        return None
    return Capacity(max(prefill), max(decode) * lanes, lanes, kv_tokens)
