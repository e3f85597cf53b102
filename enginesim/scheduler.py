"""A pure model of the vLLM V1 (0.11) scheduler: KV blocks, token budget, preemption.

No asyncio, no IO, no clock: every method that needs time takes it as an argument, so
tests drive it step by step with hand-checkable numbers.

The rules it reproduces (vllm/v1/core/sched/scheduler.py and kv_cache_manager.py in 0.11):

- A request has ``num_tokens = prompt_tokens + output_tokens`` and ``num_computed_tokens``
  (tokens whose KV is in the cache). Each step tries to let every request catch up:
  it schedules ``min(num_tokens - num_computed_tokens, remaining budget)`` tokens for it.
  A decoding request therefore takes 1 token of budget; a prefilling one a chunk
  (chunked prefill). ``num_computed_tokens`` advances when the step is scheduled.
- A request holds ``ceil(num_computed_tokens / block_size)`` blocks. One block of the pool
  is vLLM's reserved "null block", so ``num_gpu_blocks - 1`` blocks are usable and
  ``kv_cache_usage = used_blocks / (num_gpu_blocks - 1)`` (BlockPool.get_usage).
- RUNNING requests are scheduled first, in admission order. When one cannot allocate the
  blocks for its tokens, the most recently admitted running request (the tail of the
  running list) is preempted: its blocks are freed, ``num_computed_tokens`` is reset to 0
  (recompute: the prompt AND the tokens it already generated must be prefilled again),
  and it goes to the FRONT of the waiting queue. Allocation is retried; if the request
  itself is the victim, scheduling of running requests stops for this step.
- WAITING requests are admitted FIFO, only in a step in which nothing was preempted,
  while ``len(running) < max_num_seqs``, budget remains and the blocks for their next
  chunk can be allocated. The head of the queue blocks the ones behind it.
- When a request's KV has caught up with all its tokens at the end of a step, one new
  token is sampled. Generated tokens survive preemption (they were already returned to
  the client); only their KV is recomputed. A request finishes when it has generated
  ``max_tokens`` tokens (the simulator behaves as if ``ignore_eos`` were set); its blocks
  are freed. Prefix caching is not modelled.

Step duration comes from a linear cost model (see ``CostModel``).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

__all__ = [
    "CostModel",
    "FinishedRequestStats",
    "RequestRejected",
    "RequestStatus",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SimRequest",
    "StepOutput",
    "TokenOutput",
]


@dataclass(frozen=True)
class CostModel:
    """Engine time of one step: overhead + prefill tokens + decoding sequences.

    Defaults reproduce the reference engine (``--preset reference``):
    a lone decoding sequence runs one step of ``0.020 + 0.01333 = 0.0333 s``, i.e. 30 tok/s;
    an uncontended long prefill runs steps of 2048 tokens (the token budget) costing
    ``0.020 + 2048 * 0.0019 = 3.911 s``, i.e. 2048 / 3.911 = 523.6 tok/s (~525 tok/s), so a
    65,536-token prompt takes 32 such steps, ~125 s, and its recompute after a preemption
    costs the same again.
    """

    step_overhead_s: float = 0.020
    per_prefill_token_s: float = 0.0019
    per_decode_seq_s: float = 0.01333

    def step_duration(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Engine seconds for a step with this batch composition."""
        return (
            self.step_overhead_s
            + prefill_tokens * self.per_prefill_token_s
            + decode_seqs * self.per_decode_seq_s
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Static engine geometry (one DP rank)."""

    num_gpu_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks (--num-gpu-blocks) must be >= 2: one block is vLLM's "
                             "reserved null block")

    @property
    def usable_blocks(self) -> int:
        """Blocks a request can hold: the pool minus vLLM's null block."""
        return self.num_gpu_blocks - 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, after a preemption
    FINISHED = "finished"
    ABORTED = "aborted"


class RequestRejected(ValueError):
    """A request the engine refuses at arrival (vLLM answers HTTP 400)."""


@dataclass(eq=False)
class SimRequest:
    """One request's progress through the engine."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_time: float
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must catch up with."""
        return self.prompt_tokens + self.num_output_tokens

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, {self.status.value}, prompt={self.prompt_tokens}, "
            f"out={self.num_output_tokens}/{self.max_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.num_blocks})"
        )


@dataclass
class ScheduledStep:
    """What one call to ``schedule`` decided; ``complete`` turns it into outputs."""

    start_time: float
    duration: float
    num_scheduled_tokens: dict[str, int]
    prefill_tokens: int
    decode_seqs: int
    preempted: list[str]
    admitted: list[str]

    @property
    def end_time(self) -> float:
        return self.start_time + self.duration

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(frozen=True)
class TokenOutput:
    """One generated token: ``index`` counts from 0 within its request."""

    request_id: str
    index: int
    finished: bool


@dataclass(frozen=True)
class FinishedRequestStats:
    """Per-request intervals, defined as vllm/v1/metrics/stats.py defines them."""

    request_id: str
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int
    queued_time: float
    prefill_time: float
    inference_time: float
    decode_time: float
    mean_time_per_output_token: float


@dataclass
class StepOutput:
    """Everything a completed step produced, including the iteration stats vLLM logs."""

    end_time: float
    tokens: list[TokenOutput] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler gauges as vLLM publishes them."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    used_blocks: int


class Scheduler:
    """vLLM V1 FCFS scheduler over a block-granular KV cache (one DP rank)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._requests: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.used_blocks = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_tokens: int, max_tokens: int,
                    arrival_time: float) -> SimRequest:
        """Queue a request at the tail of WAITING, or raise RequestRejected."""
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if prompt_tokens < 1 or max_tokens < 1:
            raise RequestRejected("prompt_tokens and max_tokens must be >= 1")
        max_len = self.config.max_model_len
        if prompt_tokens >= max_len:
            raise RequestRejected(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of the "
                "input messages.")
        if prompt_tokens + max_tokens > max_len:
            raise RequestRejected(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {max_len} tokens and your request has "
                f"{prompt_tokens} input tokens ({max_tokens} > {max_len} - {prompt_tokens}).")
        request = SimRequest(request_id, prompt_tokens, max_tokens, arrival_time)
        self._requests[request_id] = request
        self.waiting.append(request)
        return request

    def get(self, request_id: str) -> SimRequest | None:
        return self._requests.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Drop an unfinished request and free its blocks; False if unknown or done."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.ABORTED
        self.num_aborted += 1
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> SchedulerStats:
        """Current gauges: running, waiting, KV usage (fraction of usable blocks)."""
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.used_blocks / self.config.usable_blocks,
            used_blocks=self.used_blocks,
        )

    # -- stepping -------------------------------------------------------------------------

    def schedule(self, now: float) -> ScheduledStep:
        """Decide the next batch at engine time ``now`` and allocate its KV blocks."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        decoding: set[str] = set()
        preempted: list[SimRequest] = []
        admitted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          cfg.max_model_len - 1 - request.num_computed_tokens)
            if num_new <= 0:
                index += 1
                continue
            can_schedule = True
            while not self._allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    can_schedule = False
                    break
            if not can_schedule:
                break
            if request.num_output_tokens > 0 and num_new == 1 and (
                    request.num_computed_tokens == request.num_tokens - 1):
                decoding.add(request.request_id)
            scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1

        if not preempted:
            while self.waiting and budget > 0:
                if len(self.running) >= cfg.max_num_seqs:
                    break
                request = self.waiting[0]
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if not self._allocate(request, num_new):
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time is None:
                    # vLLM ignores re-scheduling after a preemption for queue/prefill times.
                    request.first_scheduled_time = now
                admitted.append(request.request_id)
                scheduled[request.request_id] = num_new
                budget -= num_new

        for request_id, num_new in scheduled.items():
            self._requests[request_id].num_computed_tokens += num_new

        prefill_tokens = sum(n for rid, n in scheduled.items() if rid not in decoding)
        decode_seqs = len(decoding)
        duration = cfg.cost.step_duration(prefill_tokens, decode_seqs) if scheduled else 0.0
        return ScheduledStep(
            start_time=now,
            duration=duration,
            num_scheduled_tokens=scheduled,
            prefill_tokens=prefill_tokens,
            decode_seqs=decode_seqs,
            preempted=[r.request_id for r in preempted],
            admitted=admitted,
        )

    def complete(self, step: ScheduledStep, end_time: float | None = None) -> StepOutput:
        """Apply the model's outputs for ``step``: sample tokens, finish, free blocks."""
        end = step.end_time if end_time is None else end_time
        output = StepOutput(end_time=end, num_preemptions=len(step.preempted))
        self.num_preemptions += len(step.preempted)
        for request_id in step.num_scheduled_tokens:
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted (or preempted by a later schedule) while the step ran
            if request.num_computed_tokens < request.num_tokens:
                continue  # a partial prefill chunk: nothing is sampled yet
            request.num_output_tokens += 1
            output.num_generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = end
                output.num_prompt_tokens += request.prompt_tokens
                output.time_to_first_tokens.append(end - request.arrival_time)
            else:
                assert request.last_token_time is not None
                output.inter_token_latencies.append(end - request.last_token_time)
            request.last_token_time = end
            finished = request.num_output_tokens >= request.max_tokens
            output.tokens.append(TokenOutput(request_id, request.num_output_tokens - 1, finished))
            if finished:
                output.finished.append(self._finish(request, end))
        return output

    def step(self, now: float) -> tuple[ScheduledStep, StepOutput]:
        """Schedule and complete one step at once (for tests and offline runs)."""
        scheduled = self.schedule(now)
        return scheduled, self.complete(scheduled)

    # -- internals ------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(min(num_tokens, self.config.max_model_len) / self.config.block_size)

    def _allocate(self, request: SimRequest, num_new_tokens: int) -> bool:
        needed = self._blocks_for(request.num_computed_tokens + num_new_tokens) - request.num_blocks
        if needed > self.config.usable_blocks - self.used_blocks:
            return False
        if needed > 0:
            request.num_blocks += needed
            self.used_blocks += needed
        return True

    def _free(self, request: SimRequest) -> None:
        self.used_blocks -= request.num_blocks
        request.num_blocks = 0

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _finish(self, request: SimRequest, now: float) -> FinishedRequestStats:
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finished_time = now
        del self._requests[request.request_id]
        self.num_finished += 1
        assert request.first_scheduled_time is not None
        assert request.first_token_time is not None and request.last_token_time is not None
        decode_time = request.last_token_time - request.first_token_time
        generated = request.num_output_tokens
        return FinishedRequestStats(
            request_id=request.request_id,
            finish_reason="length",
            e2e_latency=now - request.arrival_time,
            num_prompt_tokens=request.prompt_tokens,
            num_generation_tokens=generated,
            max_tokens_param=request.max_tokens,
            queued_time=request.first_scheduled_time - request.arrival_time,
            prefill_time=request.first_token_time - request.first_scheduled_time,
            inference_time=request.last_token_time - request.first_scheduled_time,
            decode_time=decode_time,
            mean_time_per_output_token=decode_time / (generated - 1) if generated > 1 else 0.0,
        )
