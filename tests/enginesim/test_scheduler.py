"""The pure vLLM V1 scheduler model, on small hand-checkable cases."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from enginesim.scheduler import (
    DEFAULT_PROFILE,
    CostModel,
    RequestRejected,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)

UNIT_COST = CostModel(step_overhead_s=1.0, per_prefill_token_s=0.1, per_decode_seq_s=0.5)


def make(num_gpu_blocks: int = 101, block_size: int = 4, max_num_seqs: int = 4,
         budget: int = 8, max_model_len: int = 64, profile: str = DEFAULT_PROFILE) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, cost=UNIT_COST), profile)


def run_to_completion(sched: Scheduler, now: float = 0.0, max_steps: int = 10_000) -> float:
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return now
        step, _ = sched.step(now)
        now = step.end_time
    raise AssertionError("scheduler did not drain")


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    sched = make(budget=8)
    req = sched.add_request("a", prompt_tokens=20, max_tokens=2, arrival_time=0.0)

    step1, out1 = sched.step(0.0)
    assert step1.num_scheduled_tokens == {"a": 8}
    assert (req.num_computed_tokens, req.num_blocks, out1.tokens) == (8, 2, [])

    step2, out2 = sched.step(step1.end_time)
    assert step2.num_scheduled_tokens == {"a": 8}
    assert (req.num_computed_tokens, req.num_blocks, out2.tokens) == (16, 4, [])

    step3, out3 = sched.step(step2.end_time)
    assert step3.num_scheduled_tokens == {"a": 4}
    assert req.num_blocks == 5
    assert [t.index for t in out3.tokens] == [0]  # the first token comes with the last chunk


def test_decoding_request_takes_one_token_and_leaves_the_rest_of_the_budget():
    sched = make(budget=8)
    sched.add_request("a", prompt_tokens=4, max_tokens=5, arrival_time=0.0)
    sched.step(0.0)
    sched.add_request("b", prompt_tokens=20, max_tokens=1, arrival_time=0.0)

    step, _ = sched.step(1.0)

    assert step.num_scheduled_tokens == {"a": 1, "b": 7}
    assert (step.decode_seqs, step.prefill_tokens) == (1, 7)


def test_waiting_requests_are_admitted_only_up_to_max_num_seqs():
    sched = make(max_num_seqs=2, budget=64)
    for rid in "abc":
        sched.add_request(rid, prompt_tokens=4, max_tokens=3, arrival_time=0.0)

    step, _ = sched.step(0.0)

    assert step.admitted == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.stats().num_running_reqs == 2


def test_admission_stops_when_the_token_budget_is_spent():
    sched = make(budget=8)
    sched.add_request("a", prompt_tokens=8, max_tokens=2, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=2, max_tokens=2, arrival_time=0.0)

    step, _ = sched.step(0.0)

    assert step.num_scheduled_tokens == {"a": 8}
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_waiting_queue_is_fifo_even_when_a_later_request_would_fit():
    # 4 usable blocks of 4 tokens; "a" holds 3, "b" needs 2, "c" would need 1.
    sched = make(num_gpu_blocks=5, budget=64, max_model_len=16)
    sched.add_request("a", prompt_tokens=12, max_tokens=4, arrival_time=0.0)
    sched.step(0.0)
    sched.add_request("b", prompt_tokens=8, max_tokens=1, arrival_time=0.0)
    sched.add_request("c", prompt_tokens=4, max_tokens=1, arrival_time=0.0)

    step, _ = sched.step(1.0)

    assert step.admitted == []
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_blocks_follow_computed_tokens():
    sched = make(block_size=4, budget=64)
    req = sched.add_request("a", prompt_tokens=5, max_tokens=6, arrival_time=0.0)
    now = 0.0
    seen = []
    while req.status is not RequestStatus.FINISHED:
        step, _ = sched.step(now)
        now = step.end_time
        if req.status is RequestStatus.RUNNING:
            assert req.num_blocks == math.ceil(req.num_computed_tokens / 4)
            assert sched.used_blocks == req.num_blocks
            seen.append(req.num_blocks)
    # computed: 5, 6, 7, 8, 9, 10 tokens -> 2, 2, 2, 2, 3, finished (freed)
    assert seen == [2, 2, 2, 2, 3]
    assert sched.used_blocks == 0


def two_full_requests(profile: str = DEFAULT_PROFILE) -> Scheduler:
    """4 usable blocks of 4 tokens, filled by two 6-token prompts (2 blocks each)."""
    sched = make(num_gpu_blocks=5, block_size=4, budget=16, max_model_len=16, profile=profile)
    sched.add_request("a", prompt_tokens=6, max_tokens=10, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=6, max_tokens=10, arrival_time=0.0)
    return sched


def test_running_request_that_cannot_grow_preempts_the_most_recently_admitted():
    # 0.11: the step that preempts counts the preemption (0.33 counts it at the victim's next
    # token: test_profile_033.py).
    sched = two_full_requests("vllm-0.11")
    now = 0.0
    for _ in range(3):  # prefill, then two decodes fill the 8 slots of each request
        step, _ = sched.step(now)
        now = step.end_time
    a, b = sched.get("a"), sched.get("b")
    assert (a.num_computed_tokens, b.num_computed_tokens, sched.used_blocks) == (8, 8, 4)

    step, out = sched.step(now)  # "a" needs a 3rd block: "b" is evicted

    assert step.preempted == ["b"]
    assert step.num_scheduled_tokens == {"a": 1}
    assert out.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_blocks, b.num_output_tokens) == (0, 0, 3)
    assert sched.waiting[0] is b
    assert (a.num_blocks, sched.used_blocks) == (3, 3)


def test_preempted_request_recomputes_prompt_and_generated_tokens_from_zero():
    # 0.11 has no prefix cache (0.33 recomputes only what was evicted: test_profile_033.py).
    sched = two_full_requests("vllm-0.11")
    now = 0.0
    b = sched.get("b")
    while b.status is not RequestStatus.RUNNING or b.num_preemptions == 0:
        step, _ = sched.step(now)
        now = step.end_time
    # "b" came back only after "a" finished and freed its blocks.
    assert sched.get("a") is None
    assert step.admitted == ["b"]
    assert step.num_scheduled_tokens == {"b": 6 + 3}  # prompt + 3 generated tokens, again
    assert step.prefill_tokens == 9 and step.decode_seqs == 0
    assert b.num_output_tokens == 4  # the recompute step samples the 4th token


def test_recompute_after_a_preemption_is_counted_exactly_as_the_context_computed_again():
    # 0.11: no prefix cache. "b" held 8 computed tokens (6 prompt + 2 generated; its 3rd
    # generated token had no KV yet) when it was preempted; resuming computes 9, of which the
    # first 8 are recompute and the 9th is new work.
    sched = two_full_requests("vllm-0.11")
    run_to_completion(sched)
    assert sched.num_preemptions == 1
    assert sched.num_recomputed_tokens == 8


def test_no_preemption_no_recompute():
    sched = make(num_gpu_blocks=101, budget=16)
    sched.add_request("a", prompt_tokens=20, max_tokens=5, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=30, max_tokens=5, arrival_time=0.0)
    run_to_completion(sched)
    assert sched.num_preemptions == 0 and sched.num_recomputed_tokens == 0


def test_a_prefix_cache_hit_on_resuming_is_not_recompute():
    # 0.33: "b"'s freed blocks keep their hashes; where none was evicted, resuming computes
    # only what the cache lacks, and only that counts.
    sched = two_full_requests("vllm-0.33")
    recomputed_by_step = 0
    now = 0.0
    for _ in range(10_000):
        if not sched.has_unfinished:
            break
        step, _ = sched.step(now)
        recomputed_by_step += sum(step.recomputed_tokens.values())
        now = step.end_time
    assert sched.num_preemptions >= 1
    assert recomputed_by_step == sched.num_recomputed_tokens
    b = sched.get("b")
    assert b is None  # finished
    # never more than the context it held when preempted (6 prompt + up to 10 generated)
    assert 0 <= sched.num_recomputed_tokens <= 16 * sched.num_preemptions


def test_request_that_is_the_last_admitted_preempts_itself():
    sched = make(num_gpu_blocks=5, block_size=4, budget=16, max_model_len=16)
    sched.add_request("a", prompt_tokens=5, max_tokens=4, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=8, max_tokens=4, arrival_time=0.0)
    sched.step(0.0)  # a: 2 blocks, b: 2 blocks; the cache is full

    step, out = sched.step(10.0)  # a fits its 6th token; b needs a 3rd block: none is free

    assert step.preempted == ["b"]
    assert step.num_scheduled_tokens == {"a": 1}
    assert [t.request_id for t in out.tokens] == ["a"]
    assert sched.get("b").status is RequestStatus.PREEMPTED


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched = make(num_gpu_blocks=5, block_size=4, budget=16, max_model_len=16, max_num_seqs=4)
    sched.add_request("a", prompt_tokens=5, max_tokens=4, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=8, max_tokens=4, arrival_time=0.0)
    sched.step(0.0)
    sched.add_request("c", prompt_tokens=1, max_tokens=1, arrival_time=0.0)

    step, _ = sched.step(1.0)  # b is preempted, which frees 2 blocks: c still waits

    assert step.preempted == ["b"]
    assert step.admitted == []
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_finishing_after_max_tokens_frees_all_blocks():
    sched = make(budget=64)
    sched.add_request("a", prompt_tokens=10, max_tokens=3, arrival_time=0.0)
    outs = []
    now = 0.0
    while sched.has_unfinished:
        step, out = sched.step(now)
        now = step.end_time
        outs.extend(out.tokens)

    assert [(t.index, t.finished) for t in outs] == [(0, False), (1, False), (2, True)]
    assert sched.used_blocks == 0 and sched.num_finished == 1
    assert sched.stats().kv_cache_usage == 0.0


@pytest.mark.parametrize("where", ["running", "waiting"])
def test_abort_frees_blocks_and_forgets_the_request(where):
    sched = make(max_num_seqs=1, budget=64)
    sched.add_request("a", prompt_tokens=10, max_tokens=5, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=10, max_tokens=5, arrival_time=0.0)
    sched.step(0.0)
    victim = "a" if where == "running" else "b"

    assert sched.abort(victim)

    assert sched.get(victim) is None
    assert sched.used_blocks == (0 if victim == "a" else 3)
    assert not sched.abort(victim)
    run_to_completion(sched, 1.0)
    assert sched.num_finished == 1 and sched.num_aborted == 1


def test_abort_during_a_step_drops_that_requests_output():
    sched = make(budget=64)
    sched.add_request("a", prompt_tokens=4, max_tokens=5, arrival_time=0.0)
    step = sched.schedule(0.0)
    sched.abort("a")

    out = sched.complete(step)

    assert out.tokens == [] and sched.used_blocks == 0


def test_requests_longer_than_max_model_len_are_rejected_at_arrival():
    sched = make(max_model_len=32)
    with pytest.raises(RequestRejected, match="maximum context length is 32 tokens"):
        sched.add_request("a", prompt_tokens=32, max_tokens=1, arrival_time=0.0)
    with pytest.raises(RequestRejected, match=r"too large: 8\. .* \(8 > 32 - 25\)"):
        sched.add_request("b", prompt_tokens=25, max_tokens=8, arrival_time=0.0)
    sched.add_request("c", prompt_tokens=25, max_tokens=7, arrival_time=0.0)
    assert not sched.running and len(sched.waiting) == 1


def test_step_duration_comes_from_the_cost_model():
    sched = make(budget=64)
    sched.add_request("a", prompt_tokens=4, max_tokens=3, arrival_time=0.0)
    step1, _ = sched.step(0.0)
    sched.add_request("b", prompt_tokens=10, max_tokens=3, arrival_time=0.0)
    step2, _ = sched.step(step1.end_time)

    assert step1.duration == pytest.approx(1.0 + 4 * 0.1)
    assert step2.duration == pytest.approx(1.0 + 10 * 0.1 + 1 * 0.5)


def test_kv_usage_is_a_fraction_of_the_blocks_left_after_the_null_block():
    sched = make(num_gpu_blocks=11, block_size=4, budget=64, max_model_len=40)
    sched.add_request("a", prompt_tokens=20, max_tokens=1, arrival_time=0.0)
    sched.schedule(0.0)

    stats = sched.stats()

    assert stats.used_blocks == 5
    assert stats.kv_cache_usage == pytest.approx(5 / 10)


def test_finished_request_intervals_follow_vllm_definitions():
    # One slot: "b" waits for "a". Costs: 1 s per step, 0.1 s per prefill token, 0.5 per decode.
    sched = make(max_num_seqs=1, budget=64)
    sched.add_request("a", prompt_tokens=6, max_tokens=3, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=4, max_tokens=1, arrival_time=0.0)
    finished, ttfts, itls = [], [], []
    now = 0.0
    while sched.has_unfinished:
        step, out = sched.step(now)
        now = step.end_time
        finished.extend(out.finished)
        ttfts.extend(out.time_to_first_tokens)
        itls.extend(out.inter_token_latencies)

    a, b = finished
    # a: prefill 0 -> 1.6, decode 1.6 -> 3.1 -> 4.6
    assert a.queued_time == 0.0
    assert a.prefill_time == pytest.approx(1.6)
    assert a.decode_time == pytest.approx(3.0)
    assert a.e2e_latency == pytest.approx(4.6)
    assert a.inference_time == pytest.approx(4.6)
    assert a.mean_time_per_output_token == pytest.approx(1.5)
    # b: admitted at 4.6, one prefill step of 1.4 s
    assert b.queued_time == pytest.approx(4.6)
    assert b.prefill_time == pytest.approx(1.4)
    assert b.e2e_latency == pytest.approx(6.0)
    assert ttfts == pytest.approx([1.6, 6.0])
    assert itls == pytest.approx([1.5, 1.5])


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="null block"):
        SchedulerConfig(num_gpu_blocks=1)


# -- property test ----------------------------------------------------------------------

operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
)


@pytest.mark.parametrize("profile", ["vllm-0.11", "vllm-0.33"])
@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(operation, max_size=80),
    num_gpu_blocks=st.integers(14, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 48),
)
def test_random_workloads_respect_limits_and_drain(profile, ops, num_gpu_blocks, block_size,
                                                   max_num_seqs, budget):
    max_model_len = min(52, (num_gpu_blocks - 1) * block_size)
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                      max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=budget,
                                      max_model_len=max_model_len, cost=UNIT_COST), profile)
    added: list[str] = []
    now = 0.0

    def check() -> None:
        active = list(sched.running) + list(sched.waiting)
        assert sched.used_blocks == sum(r.num_blocks for r in active)
        assert sched.used_blocks <= num_gpu_blocks - 1
        assert len(sched.running) <= max_num_seqs
        for r in sched.running:
            assert r.num_blocks == math.ceil(r.num_computed_tokens / block_size)
            assert r.num_output_tokens < r.max_tokens
        for r in sched.waiting:
            assert r.num_blocks == 0 and r.num_computed_tokens == 0

    for kind, a, b in ops:
        if kind == "add":
            prompt = min(a, max_model_len - 1)
            max_tokens = min(b, max_model_len - prompt)
            rid = f"r{len(added)}"
            sched.add_request(rid, prompt, max_tokens, now)
            added.append(rid)
        elif kind == "step" and sched.has_unfinished:
            step, _ = sched.step(now)
            assert sum(step.num_scheduled_tokens.values()) <= budget
            now = step.end_time
        elif kind == "abort" and added:
            sched.abort(added[a % len(added)])
        check()

    total = sched.num_finished + sched.num_aborted + len(sched.running) + len(sched.waiting)
    assert total == len(added)
    for _ in range(5000):
        if not sched.has_unfinished:
            break
        step, _ = sched.step(now)
        assert not step.is_empty  # the engine always makes progress
        now = step.end_time
        check()
    assert not sched.has_unfinished
    assert sched.num_finished + sched.num_aborted == len(added)
    assert sched.used_blocks == 0
    if sched.num_preemptions == 0:  # recompute happens only because of a preemption
        assert sched.num_recomputed_tokens == 0
