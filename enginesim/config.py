"""Simulator settings: one frozen dataclass, built once from the command line.

Two presets:

- ``small`` (the default): a tiny, fast engine for tests. 512 blocks x 16 tokens,
  max_num_seqs 4, token budget 2048, max_model_len 4096; a step costs 1 ms plus 10 us per
  prefill token plus 1 ms per decoding sequence, so a lone 16-token completion takes
  about 16 x 2 ms = 32 ms of engine time.
- ``reference``: the engine of the reference incident: 9527 blocks x 16 tokens
  (152,432 tokens of KV), max_num_seqs 4, max_model_len 131072 and a token budget of
  2048, which is vLLM 0.11's ``--max-num-batched-tokens`` default for the OpenAI server
  on GPUs with < 70 GiB (arg_utils.py; 8192 on >= 70 GiB non-A100 GPUs). The cost model
  gives ~525 tok/s uncontended prefill and 30 tok/s for a lone decoding sequence
  (see scheduler.CostModel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .scheduler import CostModel, SchedulerConfig

__all__ = ["PRESETS", "SimConfig", "DP_ROUTING"]

DP_ROUTING = ("round-robin", "least-loaded")


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator process needs; validated in ``__post_init__``."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    bytes_per_token: float = 4.0
    default_max_tokens: int = 16
    time_scale: float = 1.0
    data_parallel_size: int = 1
    dp_routing: str = "round-robin"
    # vLLM 0.33's API-server queue limits (--max-num-queued-reqs / --max-num-queued-tokens,
    # vllm/config/scheduler.py; None = no limit, >= 0); see server.QueueLimits.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    profile: str = "vllm-0.33"

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be > 0, got {self.bytes_per_token}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.dp_routing not in DP_ROUTING:
            raise ValueError(f"dp_routing must be one of {DP_ROUTING}, got {self.dp_routing!r}")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            limit = getattr(self, name)
            if limit is None:
                continue
            if limit < 0:
                raise ValueError(f"{name} must be >= 0, got {limit}")
            if getattr(self, "profile", "vllm-0.33") == "vllm-0.11":
                raise ValueError(f"{name} needs --profile vllm-0.33: vLLM 0.11 has no queue limits")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        sched = self.scheduler
        capacity = sched.usable_blocks * sched.block_size
        if sched.max_model_len > capacity:
            # vLLM refuses to start when one max-length request cannot fit in the KV cache.
            raise ValueError(
                f"max_model_len {sched.max_model_len} needs more KV cache than "
                f"{sched.num_gpu_blocks} blocks x {sched.block_size} tokens provide "
                f"({capacity} usable tokens); lower --max-model-len or raise --num-gpu-blocks")

    def describe(self) -> str:
        """One log line with the effective settings."""
        s = self.scheduler
        c = s.cost
        return (
            f"model={self.model} num_gpu_blocks={s.num_gpu_blocks} block_size={s.block_size} "
            f"max_num_seqs={s.max_num_seqs} max_num_batched_tokens={s.max_num_batched_tokens} "
            f"max_model_len={s.max_model_len} data_parallel_size={self.data_parallel_size} "
            f"dp_routing={self.dp_routing} time_scale={self.time_scale:g} "
            f"bytes_per_token={self.bytes_per_token:g} default_max_tokens={self.default_max_tokens} "
            f"step_overhead_s={c.step_overhead_s:g} per_prefill_token_s={c.per_prefill_token_s:g} "
            f"per_decode_seq_s={c.per_decode_seq_s:g}")


PRESETS: dict[str, dict[str, object]] = {
    "small": {
        "num_gpu_blocks": 512,
        "block_size": 16,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 2048,
        "max_model_len": 4096,
        "step_overhead_s": 0.001,
        "per_prefill_token_s": 0.00001,
        "per_decode_seq_s": 0.001,
    },
    "reference": {
        "num_gpu_blocks": 9527,
        "block_size": 16,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 2048,
        "max_model_len": 131072,
        "step_overhead_s": CostModel.step_overhead_s,
        "per_prefill_token_s": CostModel.per_prefill_token_s,
        "per_decode_seq_s": CostModel.per_decode_seq_s,
    },
}
