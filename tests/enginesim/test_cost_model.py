"""The memory-bound step cost: batching multiplies decode throughput until KV reads dominate."""

from __future__ import annotations

import pytest

from enginesim.cli import build_parser, config_from_args
from enginesim.scheduler import (
    BatchShape,
    CostModel,
    MemoryBoundCostModel,
    Scheduler,
    SchedulerConfig,
)

# 1000 bytes of weights, 1 byte of KV per token, 1000 B/s; 1 FLOP per token at 100 FLOP/s.
TOY = MemoryBoundCostModel(weight_bytes=1000, kv_bytes_per_token=1, memory_bandwidth=1000,
                           flops_per_token=1, flops_per_attention_pair=0, compute_flops=100)


def decode(seqs: int, context: int) -> BatchShape:
    """``seqs`` sequences decoding one token each after ``context`` computed tokens."""
    return BatchShape(prefill_tokens=0, decode_seqs=seqs, kv_tokens_read=seqs * (context + 1))


def tokens_per_s(model: MemoryBoundCostModel, seqs: int, context: int) -> float:
    return seqs / model.duration(decode(seqs, context))


def test_short_context_decoding_is_weight_bound_so_batching_multiplies_throughput():
    # 1 sequence: (1000 + 10) / 1000 = 1.01 s per token; 10: (1000 + 100) / 1000 = 1.1 s
    # for 10 tokens.
    assert TOY.duration(decode(1, 9)) == pytest.approx(1.01)
    assert TOY.duration(decode(10, 9)) == pytest.approx(1.1)
    gain = tokens_per_s(TOY, 10, 9) / tokens_per_s(TOY, 1, 9)
    assert gain == pytest.approx(10 * 1.01 / 1.1)  # 9.2x


def test_long_context_decoding_is_kv_bound_so_batching_gains_little():
    # Context 999: 1 sequence (1000 + 1000) / 1000 = 2 s; 10 sequences (1000 + 10000) / 1000
    # = 11 s: 10 tokens in 11 s, only 1.8x. The KV every sequence reads is the limit.
    assert TOY.duration(decode(1, 999)) == pytest.approx(2.0)
    assert TOY.duration(decode(10, 999)) == pytest.approx(11.0)
    assert tokens_per_s(TOY, 10, 999) / tokens_per_s(TOY, 1, 999) == pytest.approx(20 / 11)


def test_prefill_is_compute_bound():
    # 500 prompt tokens: compute 500 / 100 = 5 s; memory (1000 + 500) / 1000 = 1.5 s.
    shape = BatchShape(prefill_tokens=500, decode_seqs=0, kv_tokens_read=500)
    assert TOY.compute_s(shape) == pytest.approx(5.0)
    assert TOY.memory_s(shape) == pytest.approx(1.5)
    assert TOY.duration(shape) == pytest.approx(5.0)


def test_the_linear_model_prices_every_decoding_sequence_the_same():
    linear = CostModel(step_overhead_s=1.0, per_prefill_token_s=0.1, per_decode_seq_s=0.5)
    assert linear.duration(decode(10, 9)) == pytest.approx(1.0 + 10 * 0.5)
    assert linear.duration(decode(10, 999)) == pytest.approx(1.0 + 10 * 0.5)


def test_scheduler_feeds_the_cost_model_the_kv_each_request_reads():
    # Blocks of 4. "a" decodes its 2nd token after a 6-token prompt (reads 7 positions);
    # "b" prefills 5 tokens (reads 5; 15 causal query-key pairs).
    cost = MemoryBoundCostModel(weight_bytes=1000, kv_bytes_per_token=10, memory_bandwidth=1000,
                                flops_per_token=0, flops_per_attention_pair=1, compute_flops=1)
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=41, block_size=4, max_num_seqs=4,
                                      max_num_batched_tokens=64, max_model_len=64, cost=cost),
                      "vllm-0.11")
    sched.add_request("a", prompt_tokens=6, max_tokens=4, arrival_time=0.0)
    sched.step(0.0)
    sched.add_request("b", prompt_tokens=5, max_tokens=1, arrival_time=0.0)

    step, _ = sched.step(1.0)

    assert (step.decode_seqs, step.prefill_tokens) == (1, 5)
    assert step.kv_tokens_read == 7 + 5
    assert step.attention_pairs == 7 + (1 + 2 + 3 + 4 + 5)
    # memory (1000 + 12 * 10) / 1000 = 1.12 s; compute 22 pairs / 1 = 22 s
    assert step.duration == pytest.approx(22.0)


def test_h100_llama8b_preset_numbers():
    config = config_from_args(build_parser().parse_args(["--preset", "h100-llama8b"]))
    sched = config.scheduler
    assert (sched.num_gpu_blocks, sched.block_size, sched.max_num_seqs) == (27800, 16, 1024)
    assert (sched.max_num_batched_tokens, sched.max_model_len) == (8192, 131072)
    cost = sched.cost
    assert isinstance(cost, MemoryBoundCostModel)
    # A lone decoding sequence: 1 ms + 16.06e9 / 2.68e12 = 6.99 ms, ~143 tok/s.
    lone = cost.duration(decode(1, 0))
    assert lone == pytest.approx(0.001 + 16.06e9 / 2.68e12, rel=1e-3)
    assert 1 / lone == pytest.approx(143, rel=0.01)
    # 64 sequences at 2k context: 1 ms + (16.06e9 + 64 * 2049 * 131072) / 2.68e12 = 13.4 ms.
    batch = cost.duration(decode(64, 2048))
    assert batch == pytest.approx(0.0134, rel=0.01)
    assert 64 / batch / (1 / lone) > 30
    # The whole cache (444,784 tokens) read by one step costs more than the weights.
    full = BatchShape(0, 1024, kv_tokens_read=27799 * 16)
    assert cost.memory_s(full) > 2 * 16.06e9 / 2.68e12
