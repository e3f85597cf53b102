"""Simulator settings: one frozen dataclass, built once from the command line.

Engine profile (``--profile``, ``SimConfig.profile``): ``vllm-0.33`` (the default) or
``vllm-0.11``; what each does is in ``scheduler.PROFILES`` and enginesim/README.md.

Four presets (geometry and step cost):

- ``small`` (the default): a tiny, fast engine for tests. 512 blocks x 16 tokens,
  max_num_seqs 4, token budget 2048, max_model_len 4096; a step costs 1 ms plus 10 us per
  prefill token plus 1 ms per decoding sequence, so a lone 16-token completion takes
  about 16 x 2 ms = 32 ms of engine time.
- ``reference``: the engine of the reference incident: 9527 blocks x 16 tokens
  (152,432 tokens of KV), max_num_seqs 4, max_model_len 131072 and a token budget of
  2048, which is vLLM 0.11's ``--max-num-batched-tokens`` default for the OpenAI server
  on GPUs with < 70 GiB (arg_utils.py; 8192 on >= 70 GiB non-A100 GPUs). The linear cost
  model gives ~525 tok/s uncontended prefill and 30 tok/s for a lone decoding sequence
  (see scheduler.CostModel).
- ``h100-llama8b``: Llama-3.1-8B-Instruct in BF16 on one H100 SXM5 80GB, with the
  memory-bound cost model (scheduler.MemoryBoundCostModel). Calibration, from published
  figures (Meta's model card and config.json; NVIDIA's H100 datasheet; vLLM 0.33.0 source):

  * weights: 8.03e9 parameters x 2 bytes = 16.06e9 bytes; 2 x 8.03e9 = 1.606e10 FLOPs per
    token for the matmuls;
  * KV per token: 2 (K, V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes = 131,072 bytes
    (128 KiB); attention FLOPs per query-key pair: 4 x 32 layers x 4096 query width = 524,288;
  * H100 SXM5: 3.35 TB/s HBM3 and 989 TFLOPS dense BF16; the model assumes 80 % of the
    bandwidth (2.68e12 B/s) and 50 % of the FLOPs (4.95e14 FLOP/s) are achieved, plus 1 ms
    of per-step overhead. A lone decoding sequence: 1 ms + 16.06e9 / 2.68e12 = 7.0 ms, 143
    tok/s; 64 sequences at 2k context: 1 ms + (16.06e9 + 64 x 2048 x 131072) / 2.68e12 =
    13.4 ms, 4,770 tok/s (33x); a full 8192-token prefill chunk at the start of a prompt:
    1 ms + (8192 x 1.606e10 + 8192 x 8193 / 2 x 524,288) / 4.95e14 = 0.30 s (compute-bound,
    27k tok/s), slower further into a long prompt (attention grows with the context);
  * KV blocks: 80 GB is 79.65 GiB as the driver reports it; vLLM 0.33's default
    gpu_memory_utilization 0.92 (vllm/config/cache.py) gives 73.3 GiB, minus 14.96 GiB of
    weights and ~4 GiB of activations, CUDA graphs and non-torch memory (assumed), leaves
    ~54.3 GiB = 444,800 tokens = 27,800 blocks of 16;
  * max_num_seqs 1024 and max_num_batched_tokens 8192: vLLM 0.33's OpenAI-server defaults
    for a >= 70 GiB non-A100 GPU (vllm/engine/arg_utils.py get_batch_defaults; 2048/256
    below 70 GiB, 16384/1024 at >= 160 GiB); max_model_len 131072 (the model's context).
- ``cpu-tiny``: the real vLLM of ``realengine`` (vLLM 0.32 CPU build, a random-weight 2-layer
  Llama, hidden 128, vocabulary 4,096) on this project's 2-core machines. Geometry as
  realengine starts it: 640 blocks x 32 tokens (20,448 usable: one is vLLM's null block),
  max_num_seqs 4, token budget 2048, max_model_len 16384. Linear cost with an attention term
  (scheduler.CostModel), fitted by ``python -m bench.calibrate_real --engine-url URL --repeats 3
  --decode-tokens 512 --eos 12`` (2026-12-02, load average 19-25 on 2 cores: another vLLM and
  four engineers' tests beside it, so every figure is stretched and noisy; medians over 3):

  * decode step (engine ``vllm:inter_token_latency_seconds``, 512 tokens per sequence, contexts
    32 and 1,500 pooled): B=1 3.9 ms (runs 3.7-10.0), B=2 5.6 ms (3.5-37.7), B=3 5.1 ms
    (3.8-10.1), B=4 6.5 ms (4.3-15.7); least squares over the medians: ``step_overhead_s``
    3.44 ms + ``per_decode_seq_s`` 0.73 ms per sequence (~240 tok/s alone, ~620 with four; the
    fastest runs, 3.7 and 4.3 ms, are the ~290 and ~930 tok/s of an idle machine);
  * prefill (engine ``vllm:request_prefill_time_seconds``, one prompt at a time, median of 3):
    256 tokens 8.8 ms, 512 15.3 ms, 1,024 26 ms, 2,048 65 ms, 4,096 0.23 s, 8,192 1.04 s
    (runs 0.85-5.8 s): superlinear, so beside ``per_prefill_token_s`` 18.4 us the model
    counts ``per_attention_pair_s`` 17.1 ns per causal query-key pair (a model this small
    spends most of a long prompt in attention). Fitted on relative error: within 20 % of the
    medians from 256 to 4,096 tokens, 29 % under at 8,192 (0.74 s);
  * output length (``CPU_TINY_OUTPUT_LEN``, real-decode-eos's ``--output-len``): 12 chats of
    1,500 prompt tokens, max_tokens 8,000, natural end, gave 271, 556, 1,423, 1,464, 1,628,
    3,030, 3,434, 4,146, 5,983, 7,993 and two at the 8,000 limit (the engine's
    ``vllm:request_generation_tokens`` histogram: the same 12, mean 3,827). A random-weight
    model samples nearly uniformly over its 4,096-token vocabulary, so its end token comes with
    probability ~1/4,096 per token: a geometric length of mean 4,096 (the censored sample's
    maximum-likelihood mean is 45,928 / 10 = 4,593, within its spread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.tokenizer import DEFAULT_TOKENIZER, TOKENIZERS

from .metrics import DIALECTS
from .outputs import OutputLenModel
from .scheduler import PROFILES, CostModel, SchedulerConfig

__all__ = ["CPU_TINY_OUTPUT_LEN", "PRESETS", "SimConfig", "DP_ROUTING"]

#: Where the cpu-tiny model ends a generation on its own (--output-len), measured (see above).
CPU_TINY_OUTPUT_LEN = "geometric:4096"

DP_ROUTING = ("round-robin", "least-loaded")


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator process needs; validated in ``__post_init__``."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "sim-model"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    bytes_per_token: float = 4.0  # the bytes4 tokenizer's divisor
    # None: a request without max_tokens may generate up to the context left (vLLM)
    default_max_tokens: int | None = None
    tokenizer: str = DEFAULT_TOKENIZER  # extproc.tokenizer.TOKENIZERS
    output_len: str = "max"  # enginesim.outputs.OutputLenModel
    # under output_len "max": where the model ends (EOS) a request that sets no max_tokens;
    # 0: never, it runs to the context left
    no_limit_len: int = 16
    seed: int = 0  # the stream that output lengths and texts are drawn from
    time_scale: float = 1.0
    data_parallel_size: int = 1
    dp_routing: str = "round-robin"
    # vLLM 0.33's API-server queue limits (--max-num-queued-reqs / --max-num-queued-tokens,
    # vllm/config/scheduler.py; None = no limit, >= 0); see server.QueueLimits.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    profile: str = "vllm-0.33"
    dialect: str = "vllm"  # the metrics names /metrics speaks: vllm, sglang or trtllm (enginesim.metrics)

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be > 0, got {self.bytes_per_token}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        OutputLenModel.parse(self.output_len)
        if self.no_limit_len < 0:
            raise ValueError(f"no_limit_len must be >= 0, got {self.no_limit_len}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
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
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {tuple(PROFILES)}, got {self.profile!r}")
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {self.dialect!r}")
        if self.dialect == "trtllm" and self.data_parallel_size != 1:
            raise ValueError("dialect trtllm has no rank label: --data-parallel-size must be 1")
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
        return (
            f"profile={self.profile} "
            + (f"dialect={self.dialect} " if self.dialect != "vllm" else "") +
            f"model={self.model} num_gpu_blocks={s.num_gpu_blocks} block_size={s.block_size} "
            f"max_num_seqs={s.max_num_seqs} max_num_batched_tokens={s.max_num_batched_tokens} "
            f"max_model_len={s.max_model_len} data_parallel_size={self.data_parallel_size} "
            f"dp_routing={self.dp_routing} time_scale={self.time_scale:g} "
            f"tokenizer={self.tokenizer}"
            + (f" bytes_per_token={self.bytes_per_token:g}" if self.tokenizer == "bytes4" else "")
            + f" output_len={self.output_len} no_limit_len={self.no_limit_len} seed={self.seed} "
            f"default_max_tokens={self.default_max_tokens or 'context'} "
            f"{s.cost.describe()}")


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
    "cpu-tiny": {
        "num_gpu_blocks": 640,
        "block_size": 32,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 2048,
        "max_model_len": 16384,
        "step_overhead_s": 0.003438,
        "per_prefill_token_s": 1.84e-05,
        "per_decode_seq_s": 0.00073,
        "per_attention_pair_s": 1.71e-08,
    },
    "h100-llama8b": {
        "num_gpu_blocks": 27800,
        "block_size": 16,
        "max_num_seqs": 1024,
        "max_num_batched_tokens": 8192,
        "max_model_len": 131072,
        "step_overhead_s": 0.001,
        "memory_bound": {
            "weight_bytes": 16.06e9,
            "kv_bytes_per_token": 131072,
            "memory_bandwidth": 0.80 * 3.35e12,
            "flops_per_token": 2 * 8.03e9,
            "flops_per_attention_pair": 4 * 32 * 4096,
            "compute_flops": 0.50 * 989e12,
        },
    },
}
