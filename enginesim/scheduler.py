"""A pure model of the vLLM V1 scheduler: KV blocks, token budget, preemption, and (profile
``vllm-0.33``) the full-prompt admission check, prefix caching and async scheduling.

No asyncio, no IO, no clock: every method that needs time takes it as an argument, so
tests drive it step by step with hand-checkable numbers.

Two engine profiles (``EngineProfile``, chosen by ``--profile``):

``vllm-0.11`` reproduces vllm/v1/core/sched/scheduler.py and kv_cache_manager.py of 0.11 as
the simulator always has (no prefix caching, synchronous scheduling):

- A request has ``num_tokens = prompt_tokens + output_tokens`` and ``num_computed_tokens``
  (tokens whose KV is in the cache). Each step tries to let every request catch up:
  it schedules ``min(num_tokens - num_computed_tokens, remaining budget)`` tokens for it.
  A decoding request therefore takes 1 token of budget; a prefilling one a chunk
  (chunked prefill). ``num_computed_tokens`` advances when the step is scheduled.
- A request holds ``ceil(num_computed_tokens / block_size)`` blocks. One block of the pool
  is vLLM's reserved "null block", so ``num_gpu_blocks - 1`` blocks are usable and
  ``kv_cache_usage = 1 - free_blocks / (num_gpu_blocks - 1)`` (BlockPool.get_usage).
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
  ``max_tokens`` tokens, or earlier at ``eos_at`` when the model ends it (EOS or a stop
  string, decided at arrival by ``enginesim.outputs``; vLLM checks the length first, so an
  end at ``max_tokens`` is "length"); its blocks are freed. A preemption is counted in the
  step that preempted (vLLM counts it when the victim next emits; the 0.11 profile keeps the
  simulator's historical simplification).

``vllm-0.33`` (the default) adds what vLLM 0.33.0 does by default, read from its wheel:

- Full-prompt admission check (``scheduler_reserve_full_isl=True``, vllm/config/scheduler.py,
  default from 0.19): ``KVCacheManager.allocate_slots(..., full_sequence_must_fit=True)``
  (vllm/v1/core/kv_cache_manager.py) admits a WAITING request only if the blocks for its
  whole ``num_tokens`` (prompt + outputs so far, capped at max_model_len), minus its prefix
  cache hit, fit in the FREE blocks. A check, not a reservation: nothing is set aside, and
  the tokens it will generate are not counted. See ``Scheduler._allocate``.
- Prefix caching (``enable_prefix_caching=True``, vllm/config/cache.py): see ``BlockPool``.
- Async scheduling (``async_scheduling`` resolved to True, vllm/config/vllm.py;
  vllm/v1/core/sched/async_scheduler.py, vllm/v1/engine/core.py step_with_batch_queue):
  the scheduler runs one batch ahead of the GPU. See ``Scheduler.schedule`` (output
  placeholders) and ``enginesim.engine`` (the pipeline and its timing).
- Preemption counter timing: the PREEMPTED event rides on the victim's next output
  (``EngineCoreOutput.events``, counted by IterationStats.update_from_events in
  vllm/v1/metrics/stats.py), so ``StepOutput.num_preemptions`` counts a preemption in the
  step whose output carries the victim's next token (never, if it is aborted first).

Step duration comes from a cost model: ``CostModel`` (linear, the ``reference`` and ``small``
presets) or ``MemoryBoundCostModel`` (weights + KV reads vs compute, the ``h100-llama8b``
preset).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "BatchShape",
    "BlockPool",
    "CostModel",
    "EngineProfile",
    "FinishedRequestStats",
    "MemoryBoundCostModel",
    "RequestRejected",
    "RequestStatus",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SimRequest",
    "StepOutput",
    "TokenOutput",
    "get_profile",
]


# -- engine profiles ----------------------------------------------------------------------


@dataclass(frozen=True)
class EngineProfile:
    """Which vLLM scheduler behaviours are on. ``PROFILES`` holds the two released ones;
    tests may build others (``dataclasses.replace``) to isolate one behaviour."""

    name: str
    reserve_full_isl: bool
    enable_prefix_caching: bool
    async_scheduling: bool
    count_preemption_on_next_output: bool


PROFILES: dict[str, EngineProfile] = {
    "vllm-0.33": EngineProfile("vllm-0.33", reserve_full_isl=True, enable_prefix_caching=True,
                               async_scheduling=True, count_preemption_on_next_output=True),
    "vllm-0.11": EngineProfile("vllm-0.11", reserve_full_isl=False, enable_prefix_caching=False,
                               async_scheduling=False, count_preemption_on_next_output=False),
}
DEFAULT_PROFILE = "vllm-0.33"


def get_profile(profile: str | EngineProfile) -> EngineProfile:
    """The profile named ``profile`` (or ``profile`` itself); ValueError if unknown."""
    if isinstance(profile, EngineProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"profile must be one of {tuple(PROFILES)}, got {profile!r}") from None


# -- cost models --------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchShape:
    """What a step computes, as a cost model needs it.

    ``kv_tokens_read``: for every scheduled request, the KV positions its attention reads
    (everything computed before the step plus the new tokens). ``attention_pairs``: query-key
    pairs of causal attention, ``sum over requests of sum_{j=1..new} (computed_before + j)``.
    """

    prefill_tokens: int
    decode_seqs: int
    kv_tokens_read: int = 0
    attention_pairs: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


@dataclass(frozen=True)
class CostModel:
    """Linear: engine time of one step = overhead + prefill tokens + decoding sequences.

    Defaults reproduce the reference engine (``--preset reference``):
    a lone decoding sequence runs one step of ``0.020 + 0.01333 = 0.0333 s``, i.e. 30 tok/s;
    an uncontended long prefill runs steps of 2048 tokens (the token budget) costing
    ``0.020 + 2048 * 0.0019 = 3.911 s``, i.e. 2048 / 3.911 = 523.6 tok/s (~525 tok/s), so a
    65,536-token prompt takes 32 such steps, ~125 s, and its recompute after a preemption
    costs the same again. Every decoding sequence costs the same, so batching buys (almost)
    no throughput: that is what ``MemoryBoundCostModel`` corrects.

    ``per_attention_pair_s`` (default 0, off) adds the causal attention's query-key pairs
    (``BatchShape.attention_pairs``): where a model is so small that attention dominates a long
    prompt's later chunks (the ``cpu-tiny`` preset: an 8,192-token prompt costs ~16x a 2,048-token
    one on the real engine, not 4x), a prefill chunk deep into a prompt costs more than the first.
    """

    step_overhead_s: float = 0.020
    per_prefill_token_s: float = 0.0019
    per_decode_seq_s: float = 0.01333
    per_attention_pair_s: float = 0.0

    kind = "linear"

    def step_duration(self, prefill_tokens: int, decode_seqs: int, attention_pairs: int = 0) -> float:
        """Engine seconds for a step with this batch composition."""
        return (
            self.step_overhead_s
            + prefill_tokens * self.per_prefill_token_s
            + decode_seqs * self.per_decode_seq_s
            + attention_pairs * self.per_attention_pair_s
        )

    def duration(self, shape: BatchShape) -> float:
        return self.step_duration(shape.prefill_tokens, shape.decode_seqs, shape.attention_pairs)

    def describe(self) -> str:
        return (f"cost=linear step_overhead_s={self.step_overhead_s:g} "
                f"per_prefill_token_s={self.per_prefill_token_s:g} "
                f"per_decode_seq_s={self.per_decode_seq_s:g}"
                + (f" per_attention_pair_s={self.per_attention_pair_s:g}" if self.per_attention_pair_s else ""))


@dataclass(frozen=True)
class MemoryBoundCostModel:
    """A roofline step cost: a step is as slow as the larger of its memory and compute time.

    ``duration = step_overhead_s + max(memory_s, compute_s)`` with

    - ``memory_s = (weight_bytes + kv_tokens_read * kv_bytes_per_token) / memory_bandwidth``:
      every step reads the weights once, and every scheduled sequence reads its whole KV;
    - ``compute_s = (tokens * flops_per_token + attention_pairs * flops_per_attention_pair)
      / compute_flops``: 2 x parameters per token for the matmuls, plus causal attention
      (QK^T and AV: 4 x layers x query width FLOPs per query-key pair).

    Decoding is memory-bound: one sequence pays a whole weight read for one token, 64 pay it
    once for 64 tokens, so batching multiplies throughput until the KV reads dominate (the KV
    cache is full). Prefill chunks are compute-bound. ``memory_bandwidth`` and
    ``compute_flops`` are achieved rates (peak x efficiency), see the ``h100-llama8b`` preset
    in enginesim/config.py for the calibration.
    """

    weight_bytes: float
    kv_bytes_per_token: float
    memory_bandwidth: float  # bytes/s achieved
    flops_per_token: float
    flops_per_attention_pair: float
    compute_flops: float  # FLOP/s achieved
    step_overhead_s: float = 0.0

    kind = "memory-bound"

    def __post_init__(self) -> None:
        for name in ("weight_bytes", "kv_bytes_per_token", "memory_bandwidth", "flops_per_token",
                     "flops_per_attention_pair", "compute_flops", "step_overhead_s"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.memory_bandwidth <= 0 or self.compute_flops <= 0:
            raise ValueError("memory_bandwidth and compute_flops must be > 0")

    def memory_s(self, shape: BatchShape) -> float:
        return (self.weight_bytes + shape.kv_tokens_read * self.kv_bytes_per_token) \
            / self.memory_bandwidth

    def compute_s(self, shape: BatchShape) -> float:
        return (shape.num_tokens * self.flops_per_token
                + shape.attention_pairs * self.flops_per_attention_pair) / self.compute_flops

    def duration(self, shape: BatchShape) -> float:
        return self.step_overhead_s + max(self.memory_s(shape), self.compute_s(shape))

    def describe(self) -> str:
        return (f"cost=memory-bound step_overhead_s={self.step_overhead_s:g} "
                f"weight_bytes={self.weight_bytes:g} kv_bytes_per_token={self.kv_bytes_per_token:g} "
                f"memory_bandwidth={self.memory_bandwidth:g} flops_per_token={self.flops_per_token:g} "
                f"flops_per_attention_pair={self.flops_per_attention_pair:g} "
                f"compute_flops={self.compute_flops:g}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Static engine geometry (one DP rank)."""

    num_gpu_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    cost: CostModel | MemoryBoundCostModel = field(default_factory=CostModel)

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


# -- the block pool -----------------------------------------------------------------------


class BlockPool:
    """vLLM's BlockPool (vllm/v1/core/block_pool.py) with its prefix cache.

    Block 0 is the null block and never handed out. Each block has a reference count and,
    once it is full of computed tokens, a block hash (``cache_block``). The free queue holds
    every block with no reference, in eviction order (FreeKVCacheBlockQueue):

    - ``get_new_blocks`` pops from its front; a popped block that still carries a hash is
      evicted from the cache then (``_maybe_evict_cached_block``): cached blocks stay
      reusable until their space is actually needed;
    - ``free_blocks`` takes a request's blocks in eviction priority order (the scheduler
      passes them tail first) and puts blocks without a hash at the FRONT (reused first) and
      hashed ones at the BACK, so the cache is LRU and a request's prefix blocks outlive its
      tail blocks;
    - ``touch`` gives a cache hit a reference, taking it out of the free queue if it was free.

    ``num_free`` counts cached-but-free blocks as free, and so does ``usage``
    (``BlockPool.get_usage``: ``1 - free / (num_gpu_blocks - 1)``): a cache full of evictable
    blocks reads 0 %. With caching disabled (the 0.11 profile) nothing is ever hashed and the
    pool is a plain free list.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_gpu_blocks
        self.block_hash: list[Hashable | None] = [None] * num_gpu_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.cached: dict[Hashable, dict[int, None]] = {}
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a hash (held or free)."""
        return sum(len(blocks) for blocks in self.cached.values())

    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_gpu_blocks - 1)

    def get_cached_block(self, block_hash: Hashable) -> int | None:
        blocks = self.cached.get(block_hash)
        return next(iter(blocks)) if blocks else None

    def touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self.free_queue[block]
            self.ref_cnt[block] += 1

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self.free_queue.popitem(last=False)
            self._maybe_evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def cache_block(self, block: int, block_hash: Hashable) -> None:
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        self.block_hash[block] = block_hash
        self.cached.setdefault(block_hash, {})[block] = None

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """Drop one reference from each block, first to be evicted first."""
        evict_first: list[int] = []
        for block in ordered_blocks:
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is None:
                    evict_first.append(block)
                else:
                    self.free_queue[block] = None  # back of the queue: LRU
        for block in reversed(evict_first):
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)

    def _maybe_evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is None:
            return
        blocks = self.cached[block_hash]
        del blocks[block]
        if not blocks:
            del self.cached[block_hash]
        self.block_hash[block] = None
        self.num_evicted += 1


# -- requests and step records ------------------------------------------------------------


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
    """One request's progress through the engine.

    ``prefix``: ``(key, n)`` says the first ``n`` prompt tokens are the text named ``key``, so
    requests with the same key share those full blocks' hashes (a shared system prompt).
    Everything else a request computes hashes to blocks of its own.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_time: float
    prefix: tuple[str, int] | None = None
    eos_at: int | None = None  # the model ends the sequence (EOS or a stop string) at this token
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # vLLM 0.33 bookkeeping (all stay 0 in the 0.11 profile)
    num_output_placeholders: int = 0  # tokens sampled by a step still in flight (async)
    num_in_flight_tokens: int = 0  # tokens scheduled in steps not completed yet
    num_stale_output_tokens: int = 0  # in-flight tokens scheduled before a preemption
    num_cached_blocks: int = 0  # leading blocks that carry their hash
    unreported_preemptions: int = 0  # preemptions whose event waits for the next output
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    # the most tokens of context it has ever had computed: what it computes again below this
    # mark after a preemption is recompute (``Scheduler.num_recomputed_tokens``)
    max_computed_tokens: int = 0
    num_recomputed_tokens: int = 0
    deferred: bool = False  # skipped by the waiting loop (vLLM's deferred_waiting)
    serial: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must catch up with."""
        return self.prompt_tokens + self.num_output_tokens

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def end_tokens(self) -> int:
        """Tokens it generates in all: ``max_tokens``, or fewer if the model ends it first."""
        return self.max_tokens if self.eos_at is None else min(self.max_tokens, self.eos_at)

    def block_hash(self, index: int, block_size: int) -> Hashable:
        """The hash of full block ``index``: chained in vLLM (kv_cache_utils.hash_block_tokens),
        so naming the chain is enough: a block inside the shared prefix is ``(key, index)``,
        any later one belongs to this request alone."""
        if self.prefix is not None:
            key, length = self.prefix
            if (index + 1) * block_size <= length:
                return ("prefix", key, index)
        return ("request", self.serial, index)

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, {self.status.value}, prompt={self.prompt_tokens}, "
            f"out={self.num_output_tokens}/{self.max_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.num_blocks})"
        )


@dataclass
class ScheduledStep:
    """What one call to ``schedule`` decided; ``complete`` turns it into outputs.

    ``samples``: the requests whose KV catches up with all their tokens in this step, so
    the step samples a token for them. ``prefix_cache_queries``/``hits``: tokens looked up
    and found in the prefix cache by this step's admissions (vLLM's PrefixCacheStats:
    requests never preempted count in the first pair, resumed ones in ``preempted_*``).
    """

    start_time: float
    duration: float
    num_scheduled_tokens: dict[str, int]
    prefill_tokens: int
    decode_seqs: int
    preempted: list[str]
    admitted: list[str]
    samples: list[str] = field(default_factory=list)
    kv_tokens_read: int = 0
    attention_pairs: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preempted_prefix_cache_queries: int = 0
    preempted_prefix_cache_hits: int = 0
    # tokens of context (prompt and generated) computed again because of a preemption, by request
    recomputed_tokens: dict[str, int] = field(default_factory=dict)

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
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class StepOutput:
    """Everything a completed step produced, including the iteration stats vLLM logs.

    ``num_preemptions``: 0.11 profile, the preemptions decided when this step was scheduled;
    0.33 profile, the preemptions whose victim emits a token in this step's output (vLLM's
    PREEMPTED event rides on that output).
    """

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
    """The scheduler gauges as vLLM publishes them.

    ``num_waiting_reqs`` is every waiting request (what ``vllm:num_requests_waiting`` shows);
    ``num_deferred_waiting_reqs`` is the part of it vLLM 0.33 reports as
    ``num_skipped_waiting_reqs`` (reason ``deferred``): a preempted request whose in-flight
    output has not arrived yet (async scheduling). ``cached_blocks``: blocks carrying a
    prefix-cache hash, free or held.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    used_blocks: int
    num_deferred_waiting_reqs: int = 0
    cached_blocks: int = 0


# -- the scheduler ------------------------------------------------------------------------


class Scheduler:
    """vLLM V1 FCFS scheduler over a block-granular KV cache (one DP rank)."""

    def __init__(self, config: SchedulerConfig,
                 profile: str | EngineProfile = DEFAULT_PROFILE) -> None:
        self.config = config
        self.profile = get_profile(profile)
        self.pool = BlockPool(config.num_gpu_blocks, self.profile.enable_prefix_caching)
        self._requests: dict[str, SimRequest] = {}
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.num_preemptions = 0
        # tokens of context computed again after a preemption (what a prefix-cache hit on
        # resuming saves is not counted): the cost of the engine's preemptions, in tokens
        self.num_recomputed_tokens = 0
        self.num_finished = 0
        self.num_aborted = 0
        self._serial = 0

    @property
    def used_blocks(self) -> int:
        """Blocks not in the free queue (cached-but-free blocks count as free)."""
        return self.config.usable_blocks - self.pool.num_free

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_tokens: int, max_tokens: int,
                    arrival_time: float, prefix: tuple[str, int] | None = None,
                    eos_at: int | None = None) -> SimRequest:
        """Queue a request at the tail of WAITING, or raise RequestRejected.

        ``eos_at``: the model's own end (EOS or a stop string) at that output token, before
        ``max_tokens``; the request then finishes with reason ``stop``."""
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
        if prefix is not None and not 0 <= prefix[1] <= prompt_tokens:
            raise ValueError(f"prefix length must be in 0..{prompt_tokens}, got {prefix[1]}")
        self._serial += 1
        if eos_at is not None and eos_at < 1:
            raise ValueError(f"eos_at must be >= 1, got {eos_at}")
        request = SimRequest(request_id, prompt_tokens, max_tokens, arrival_time, prefix=prefix,
                             eos_at=eos_at, serial=self._serial)
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
        """Current gauges: running, waiting, KV usage (BlockPool.get_usage)."""
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.pool.usage(),
            used_blocks=self.used_blocks,
            num_deferred_waiting_reqs=sum(1 for r in self.waiting if r.deferred),
            cached_blocks=self.pool.num_cached if self.profile.enable_prefix_caching else 0,
        )

    # -- stepping -------------------------------------------------------------------------

    def schedule(self, now: float) -> ScheduledStep:
        """Decide the next batch at engine time ``now`` and allocate its KV blocks.

        Async scheduling (0.33; AsyncScheduler._update_after_schedule): a request whose
        step will sample a token gets an output placeholder, so the NEXT ``schedule`` can
        already give it its next decode token although that step has not completed;
        ``num_tokens + placeholders - num_computed_tokens`` is what it still needs. A
        request whose in-flight token is its last (``outputs + placeholders >= max_tokens``)
        is not scheduled again, but keeps its slot and blocks until that output arrives.
        """
        cfg = self.config
        prof = self.profile
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        decoding: set[str] = set()
        preempted: list[SimRequest] = []
        admitted: list[str] = []
        step = ScheduledStep(start_time=now, duration=0.0, num_scheduled_tokens=scheduled,
                             prefill_tokens=0, decode_seqs=0, preempted=[], admitted=admitted)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            ahead = request.num_output_placeholders
            if request.num_output_tokens + ahead >= request.end_tokens:
                index += 1  # its last token is in flight
                continue
            num_new = min(request.num_tokens + ahead - request.num_computed_tokens, budget,
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
            if request.num_output_tokens + ahead > 0 and num_new == 1 and (
                    request.num_computed_tokens == request.num_tokens + ahead - 1):
                decoding.add(request.request_id)
            scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1

        if not preempted:
            skipped: list[SimRequest] = []
            while self.waiting and budget > 0:
                if len(self.running) >= cfg.max_num_seqs:
                    break
                request = self.waiting[0]
                if request.num_stale_output_tokens > 0:
                    # vLLM 0.33: its in-flight output is still to be delivered; resuming now
                    # could resample that position. Skipped (deferred) for this pass.
                    request.deferred = True
                    skipped.append(self.waiting.popleft())
                    continue
                hit = self._find_cache_hit(request) if prof.enable_prefix_caching else []
                num_computed = len(hit) * cfg.block_size
                num_new = min(request.num_tokens - num_computed, budget)
                if not self._allocate(request, num_new, hit,
                                      full_sequence_must_fit=prof.reserve_full_isl):
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                request.deferred = False
                request.num_computed_tokens = num_computed
                request.num_cached_blocks = len(hit)
                if prof.enable_prefix_caching:
                    request.num_cached_tokens = num_computed
                    if request.num_preemptions > 0:
                        step.preempted_prefix_cache_queries += request.num_tokens
                        step.preempted_prefix_cache_hits += num_computed
                    else:
                        step.prefix_cache_queries += request.num_tokens
                        step.prefix_cache_hits += num_computed
                if request.first_scheduled_time is None:
                    # vLLM ignores re-scheduling after a preemption for queue/prefill times.
                    request.first_scheduled_time = now
                admitted.append(request.request_id)
                scheduled[request.request_id] = num_new
                budget -= num_new
            self.waiting.extendleft(reversed(skipped))

        for request_id, num_new in scheduled.items():
            request = self._requests[request_id]
            before = request.num_computed_tokens
            step.kv_tokens_read += before + num_new
            step.attention_pairs += num_new * before + num_new * (num_new + 1) // 2
            again = max(0, min(before + num_new, request.max_computed_tokens) - before)
            if again:
                step.recomputed_tokens[request_id] = again
                request.num_recomputed_tokens += again
                self.num_recomputed_tokens += again
            request.max_computed_tokens = max(request.max_computed_tokens, before + num_new)
            request.num_computed_tokens += num_new
            request.num_in_flight_tokens += num_new
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                step.samples.append(request_id)
                if prof.async_scheduling:
                    request.num_output_placeholders += 1
            if prof.enable_prefix_caching:
                self._cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))

        step.prefill_tokens = sum(n for rid, n in scheduled.items() if rid not in decoding)
        step.decode_seqs = len(decoding)
        step.preempted = [r.request_id for r in preempted]
        if scheduled:
            step.duration = cfg.cost.duration(BatchShape(
                step.prefill_tokens, step.decode_seqs, step.kv_tokens_read, step.attention_pairs))
        return step

    def complete(self, step: ScheduledStep, end_time: float | None = None) -> StepOutput:
        """Apply the model's outputs for ``step``: sample tokens, finish, free blocks.

        0.33 (Scheduler.update_from_output): a request preempted while this step was in
        flight still receives the token the step sampled for it ("stale" output: delivered,
        counted, but it does not touch the reset counters), and may finish with it while
        waiting.
        """
        end = step.end_time if end_time is None else end_time
        prof = self.profile
        output = StepOutput(end_time=end)
        self.num_preemptions += len(step.preempted)
        if not prof.count_preemption_on_next_output:
            output.num_preemptions = len(step.preempted)
        samples = set(step.samples)
        for request_id, num_new in step.num_scheduled_tokens.items():
            request = self._requests.get(request_id)
            if request is None:
                continue  # aborted (or finished) while the step ran
            request.num_in_flight_tokens -= num_new
            stale = request.num_stale_output_tokens > 0
            if stale:
                request.num_stale_output_tokens -= num_new
            if request_id not in samples:
                continue  # a partial prefill chunk: nothing is sampled yet
            if not stale and request.status is not RequestStatus.RUNNING:
                continue  # preempted by a later schedule (synchronous scheduling)
            request.num_output_tokens += 1
            if not stale and request.num_output_placeholders > 0:
                request.num_output_placeholders -= 1
            output.num_generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = end
                output.num_prompt_tokens += request.prompt_tokens
                output.time_to_first_tokens.append(end - request.arrival_time)
            else:
                assert request.last_token_time is not None
                output.inter_token_latencies.append(end - request.last_token_time)
            request.last_token_time = end
            if prof.count_preemption_on_next_output and request.unreported_preemptions:
                output.num_preemptions += request.unreported_preemptions
                request.unreported_preemptions = 0
            finished = request.num_output_tokens >= request.end_tokens
            output.tokens.append(TokenOutput(request_id, request.num_output_tokens - 1, finished))
            if finished:
                output.finished.append(self._finish(request, end))
            elif prof.enable_prefix_caching and request.status is RequestStatus.RUNNING:
                self._cache_blocks(request, min(
                    request.num_computed_tokens - request.num_in_flight_tokens,
                    request.num_tokens))
        return output

    def step(self, now: float) -> tuple[ScheduledStep, StepOutput]:
        """Schedule and complete one step at once (for tests and offline runs).

        Nothing is in flight when the next step is scheduled, so this is synchronous
        scheduling whatever the profile; ``enginesim.engine`` runs the async pipeline.
        """
        scheduled = self.schedule(now)
        return scheduled, self.complete(scheduled)

    # -- internals ------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(min(num_tokens, self.config.max_model_len) / self.config.block_size)

    def _find_cache_hit(self, request: SimRequest) -> list[int]:
        """KVCacheManager.get_computed_blocks: the longest run of cached FULL blocks from the
        start of the request's tokens, at most ``num_tokens - 1`` tokens (the last token is
        always recomputed to get its logits)."""
        hit: list[int] = []
        for index in range((request.num_tokens - 1) // self.config.block_size):
            block = self.pool.get_cached_block(request.block_hash(index, self.config.block_size))
            if block is None:
                break
            hit.append(block)
        return hit

    def _num_blocks_to_allocate(self, request: SimRequest, num_tokens: int,
                                hit: list[int]) -> int:
        """SingleTypeKVCacheManager.get_num_blocks_to_allocate: new blocks, plus cache hits
        that are free (touching them takes them out of the free queue)."""
        new = max(self._blocks_for(num_tokens) - len(hit) - request.num_blocks, 0)
        return new + sum(1 for block in hit if self.pool.ref_cnt[block] == 0)

    def _allocate(self, request: SimRequest, num_new_tokens: int, hit: list[int] | None = None,
                  full_sequence_must_fit: bool = False) -> bool:
        """KVCacheManager.allocate_slots: False (allocating nothing) if the blocks do not fit.

        ``full_sequence_must_fit`` (0.33, waiting requests): first fail unless the blocks for
        the request's whole ``num_tokens`` fit in the free blocks.
        """
        hit = hit or []
        if full_sequence_must_fit:
            full = self._num_blocks_to_allocate(request, request.num_tokens, hit)
            if full > self.pool.num_free:
                return False
        total = request.num_computed_tokens + len(hit) * self.config.block_size + num_new_tokens
        if self._num_blocks_to_allocate(request, total, hit) > self.pool.num_free:
            return False
        if hit:
            self.pool.touch(hit)
            request.block_ids.extend(hit)
        new = self._blocks_for(total) - request.num_blocks
        if new > 0:
            request.block_ids.extend(self.pool.get_new_blocks(new))
        return True

    def _cache_blocks(self, request: SimRequest, num_tokens: int) -> None:
        """KVCacheManager.cache_blocks: hash the request's blocks that are now full of
        known, computed tokens."""
        full = min(num_tokens // self.config.block_size, request.num_blocks)
        for index in range(request.num_cached_blocks, full):
            self.pool.cache_block(request.block_ids[index],
                                  request.block_hash(index, self.config.block_size))
        request.num_cached_blocks = max(request.num_cached_blocks, full)

    def _free(self, request: SimRequest) -> None:
        # KVCacheManager.free: in reverse order, so the tail blocks are evicted first.
        self.pool.free_blocks(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    def _preempt(self, request: SimRequest) -> None:
        """Scheduler._preempt_request: free, reset to zero, front of the waiting queue.

        0.33: tokens still in flight become stale output (delivered when their step
        completes), the placeholders are dropped, and the PREEMPTED event waits for the
        request's next output. The freed blocks keep their hashes (prefix caching), so a
        resumed request recomputes only what was evicted meanwhile.
        """
        self._free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if self.profile.async_scheduling:
            request.num_stale_output_tokens = request.num_in_flight_tokens
            request.num_output_placeholders = 0
        if self.profile.count_preemption_on_next_output:
            request.unreported_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _finish(self, request: SimRequest, now: float) -> FinishedRequestStats:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:  # finished by a stale output while waiting (0.33)
            self.waiting.remove(request)
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
            finish_reason="length" if generated >= request.max_tokens else "stop",
            e2e_latency=now - request.arrival_time,
            num_prompt_tokens=request.prompt_tokens,
            num_generation_tokens=generated,
            max_tokens_param=request.max_tokens,
            queued_time=request.first_scheduled_time - request.arrival_time,
            prefill_time=request.first_token_time - request.first_scheduled_time,
            inference_time=request.last_token_time - request.first_scheduled_time,
            decode_time=decode_time,
            mean_time_per_output_token=decode_time / (generated - 1) if generated > 1 else 0.0,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_tokens,
        )
