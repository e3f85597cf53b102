"""vLLM 0.33 scheduler behaviours (``--profile vllm-0.33``) against 0.11, on hand-checkable cases.

Geometry unless a test says otherwise: blocks of 4 tokens, the null block excluded from the
usable count, unit costs (1 s per step, 0.1 s per prefill token, 0.5 s per decoding sequence).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from enginesim.scheduler import (
    PROFILES,
    CostModel,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)

UNIT_COST = CostModel(step_overhead_s=1.0, per_prefill_token_s=0.1, per_decode_seq_s=0.5)
V033 = PROFILES["vllm-0.33"]
V011 = PROFILES["vllm-0.11"]


def make(profile, num_gpu_blocks: int = 11, block_size: int = 4, max_num_seqs: int = 4,
         budget: int = 64, max_model_len: int = 40) -> Scheduler:
    return Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, cost=UNIT_COST), profile)


def run(sched: Scheduler, steps: int, now: float = 0.0) -> float:
    for _ in range(steps):
        step, _ = sched.step(now)
        now = step.end_time
    return now


# -- full-prompt admission check ----------------------------------------------------------


@pytest.mark.parametrize("profile, admitted", [("vllm-0.11", ["b"]), ("vllm-0.33", [])])
def test_prompt_that_does_not_fit_the_free_blocks_waits_on_033_only(profile, admitted):
    # 10 usable blocks of 4 tokens, budget 8. "a" (16 tokens) holds 4 blocks; 6 are free.
    # "b" has a 28-token prompt: 7 blocks. Its first 8-token chunk needs 2: 0.11 admits it;
    # 0.33 checks the whole prompt (7 > 6 free) and keeps it waiting.
    sched = make(profile, budget=8)
    sched.add_request("a", prompt_tokens=16, max_tokens=20, arrival_time=0.0)
    now = run(sched, 2)  # "a" prefilled in two chunks of 8
    assert sched.used_blocks == 4
    sched.add_request("b", prompt_tokens=28, max_tokens=1, arrival_time=now)

    step, _ = sched.step(now)

    assert step.admitted == admitted
    if profile == "vllm-0.11":
        assert step.num_scheduled_tokens == {"a": 1, "b": 7}
    else:
        assert step.num_scheduled_tokens == {"a": 1}
        assert [r.request_id for r in sched.waiting] == ["b"]


def test_full_prompt_check_is_a_check_not_a_reservation():
    # "b" (20 tokens = 5 blocks) fits the 6 free blocks: it is admitted and given only the
    # blocks of its first chunk (2); nothing is set aside for the rest of its prompt.
    sched = make("vllm-0.33", budget=8)
    sched.add_request("a", prompt_tokens=16, max_tokens=20, arrival_time=0.0)
    now = run(sched, 2)
    sched.add_request("b", prompt_tokens=20, max_tokens=1, arrival_time=now)

    step, _ = sched.step(now)

    assert step.admitted == ["b"]
    assert step.num_scheduled_tokens == {"a": 1, "b": 7}
    assert sched.get("b").num_blocks == 2  # 7 tokens
    assert sched.used_blocks == 4 + 1 + 2  # "a" grew into a 5th block with its 17th token


# -- prefix caching -----------------------------------------------------------------------


def preempted_then_resumed(profile):
    """9 usable blocks of 4. "a": 12-token prompt, "b": 16-token prompt, 12 outputs each.
    Step 1 prefills both (3 + 4 blocks); step 2 grows them to 4 + 5 blocks: full. In step 6
    "a" needs a 5th block for its 17th token and "b" (20 tokens computed, 5 outputs) is
    preempted."""
    sched = make(profile, num_gpu_blocks=10, max_model_len=36)
    sched.add_request("a", prompt_tokens=12, max_tokens=12, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=16, max_tokens=12, arrival_time=0.0)
    now = 0.0
    b = sched.get("b")
    steps = 0
    while b.num_preemptions == 0:
        step, _ = sched.step(now)
        now = step.end_time
        steps += 1
    assert steps == 6
    return sched, step, now


def test_preempted_request_keeps_its_blocks_cached_and_they_count_as_free():
    sched, step, _ = preempted_then_resumed("vllm-0.33")
    a, b = sched.get("a"), sched.get("b")
    assert step.preempted == ["b"]
    assert (b.num_output_tokens, b.num_blocks) == (5, 0)
    # b's 5 blocks were all full (20 tokens) and hashed; freed tail first, they joined the
    # back of the free queue in the order b5, b4, .., b1. "a" took one: b5 is evicted.
    assert a.num_blocks == 5
    assert (sched.pool.num_free, sched.used_blocks) == (4, 5)
    assert sched.stats().kv_cache_usage == pytest.approx(5 / 9)  # cached blocks are free
    assert len(sched._find_cache_hit(b)) == 4
    assert sched.stats().cached_blocks == 4 + 4  # a's 4 full blocks (16 of 17 tokens), b's 4


def test_resumed_request_recomputes_only_the_evicted_blocks():
    sched, _, now = preempted_then_resumed("vllm-0.33")
    b = sched.get("b")
    # "a" grows to 6 blocks (23 tokens computed) before it finishes: b4 is evicted too.
    while b.status is not RequestStatus.RUNNING:
        step, _ = sched.step(now)
        now = step.end_time
    assert step.admitted == ["b"]
    assert len(b.block_ids) == 6 and b.num_cached_tokens == 12
    # b has 16 + 5 = 21 tokens: its first 3 blocks come from the cache, 9 tokens are
    # prefilled again (vs 21 on 0.11).
    assert step.num_scheduled_tokens == {"b": 21 - 12}
    assert (step.preempted_prefix_cache_queries, step.preempted_prefix_cache_hits) == (21, 12)
    assert (step.prefix_cache_queries, step.prefix_cache_hits) == (0, 0)


def test_011_resumed_request_recomputes_everything():
    sched, _, now = preempted_then_resumed("vllm-0.11")
    b = sched.get("b")
    while b.status is not RequestStatus.RUNNING:
        step, _ = sched.step(now)
        now = step.end_time
    assert step.num_scheduled_tokens == {"b": 21}


def test_cache_hit_needs_free_blocks_for_the_rest_and_the_evictable_hits():
    # A hit on a FREE cached block takes it out of the free queue: it counts against the
    # free blocks like a new one (get_num_blocks_to_allocate's evictable blocks).
    sched = make("vllm-0.33", num_gpu_blocks=11)
    sched.add_request("a", prompt_tokens=12, max_tokens=1, arrival_time=0.0, prefix=("sys", 12))
    run(sched, 1)  # a finishes at once: its 3 hashed blocks are free and cached
    assert sched.pool.num_free == 10 and sched.stats().cached_blocks == 3
    b = sched.add_request("b", prompt_tokens=16, max_tokens=1, arrival_time=1.0,
                          prefix=("sys", 12))
    hit = sched._find_cache_hit(b)
    assert len(hit) == 3
    assert sched._num_blocks_to_allocate(b, 16, hit) == 1 + 3


def test_shared_prefix_hits_at_block_granularity():
    # "a" and "b" share a 10-token system prompt: blocks of 4 -> 2 full shared blocks.
    sched = make("vllm-0.33", num_gpu_blocks=21, max_model_len=40)
    sched.add_request("a", prompt_tokens=14, max_tokens=4, arrival_time=0.0, prefix=("sys", 10))
    step, _ = sched.step(0.0)
    assert step.prefix_cache_hits == 0 and step.prefix_cache_queries == 14
    sched.add_request("b", prompt_tokens=18, max_tokens=4, arrival_time=0.0, prefix=("sys", 10))

    step, _ = sched.step(step.end_time)

    a, b = sched.get("a"), sched.get("b")
    assert step.num_scheduled_tokens == {"a": 1, "b": 18 - 8}
    assert (step.prefix_cache_queries, step.prefix_cache_hits) == (18, 8)
    assert a.block_ids[:2] == b.block_ids[:2]  # the same physical blocks, shared
    assert a.block_ids[2] != b.block_ids[2]
    assert sched.pool.ref_cnt[a.block_ids[0]] == 2
    assert sched.used_blocks == 4 + 5 - 2  # a: 4 blocks (15 tokens), b: 5 (18), 2 shared


def test_last_prompt_token_is_always_recomputed():
    # A whole prompt in the cache still recomputes its last token (to get its logits), and
    # the hit is whole blocks only: a 12-token prompt hits 2 blocks, recomputes 4 tokens.
    sched = make("vllm-0.33")
    sched.add_request("a", prompt_tokens=12, max_tokens=1, arrival_time=0.0, prefix=("p", 12))
    now = run(sched, 1)
    sched.add_request("b", prompt_tokens=12, max_tokens=1, arrival_time=now, prefix=("p", 12))
    step, _ = sched.step(now)
    assert step.num_scheduled_tokens == {"b": 4}


def test_cached_blocks_are_evicted_lru_only_when_their_space_is_needed():
    # 10 usable blocks. "a" (12 tokens, 3 hashed blocks) finishes; then "c" needs 8 blocks:
    # the 7 never-used blocks come first, then one of a's (its tail block, freed first).
    sched = make("vllm-0.33", num_gpu_blocks=11)
    a = sched.add_request("a", prompt_tokens=12, max_tokens=1, arrival_time=0.0,
                          prefix=("p", 12))
    step, _ = sched.step(0.0)
    a_blocks = list(step.num_scheduled_tokens) and [b for b in range(1, 11)
                                                     if sched.pool.block_hash[b] is not None]
    assert len(a_blocks) == 3 and a.status is RequestStatus.FINISHED
    sched.add_request("c", prompt_tokens=32, max_tokens=1, arrival_time=0.0)
    sched.step(step.end_time)
    assert sched.pool.num_evicted == 1
    probe = sched.add_request("p", prompt_tokens=13, max_tokens=1, arrival_time=0.0,
                              prefix=("p", 12))
    assert len(sched._find_cache_hit(probe)) == 2  # the first two blocks of "a" survive


# -- async scheduling (pure part: placeholders) ------------------------------------------


def test_async_schedules_the_next_decode_before_the_previous_output_is_known():
    sched = make("vllm-0.33")
    req = sched.add_request("a", prompt_tokens=6, max_tokens=3, arrival_time=0.0)
    s1 = sched.schedule(0.0)  # prefill; its token is in flight
    s2 = sched.schedule(s1.end_time)  # decodes that token, before s1 completed
    assert s1.num_scheduled_tokens == {"a": 6} and s1.samples == ["a"]
    assert s2.num_scheduled_tokens == {"a": 1} and s2.samples == ["a"]
    assert (req.num_output_placeholders, req.num_computed_tokens) == (2, 7)
    out1 = sched.complete(s1)
    assert [t.index for t in out1.tokens] == [0]
    s3 = sched.schedule(s2.end_time)  # the 3rd (last) token: 2 outputs + 1 placeholder
    out2 = sched.complete(s2)
    s4 = sched.schedule(s3.end_time)  # the last token is in flight: nothing to schedule
    assert s3.num_scheduled_tokens == {"a": 1}
    assert s4.is_empty and sched.stats().num_running_reqs == 1  # still holds its slot
    out3 = sched.complete(s3)
    assert [t.index for t in out2.tokens + out3.tokens] == [1, 2]
    assert out3.tokens[0].finished and sched.used_blocks == 0


def test_011_cannot_schedule_ahead():
    sched = make("vllm-0.11")
    sched.add_request("a", prompt_tokens=6, max_tokens=3, arrival_time=0.0)
    s1 = sched.schedule(0.0)
    s2 = sched.schedule(s1.end_time)
    assert s2.is_empty  # synchronous: the next token needs s1's output


# -- preemption counter timing ------------------------------------------------------------


def test_033_counts_a_preemption_when_its_victim_next_emits_a_token():
    sched, step, now = preempted_then_resumed("vllm-0.33")
    assert sched.num_preemptions == 1
    # The step that preempted "b" reports nothing; the count rides on b's next token,
    # after "a" finished and b was recomputed.
    counted = []
    b = sched.get("b")
    while b.status is not RequestStatus.FINISHED:
        step, out = sched.step(now)
        now = step.end_time
        counted.append((out.num_preemptions, [t.request_id for t in out.tokens]))
    reported = [(n, ids) for n, ids in counted if n]
    assert reported == [(1, ["b"])]
    first_b = next(i for i, (_, ids) in enumerate(counted) if "b" in ids)
    assert counted[first_b][0] == 1


def test_011_counts_a_preemption_in_the_step_that_preempted():
    sched = make("vllm-0.11", num_gpu_blocks=10, max_model_len=36)
    sched.add_request("a", prompt_tokens=12, max_tokens=12, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=16, max_tokens=12, arrival_time=0.0)
    now = 0.0
    while True:
        step, out = sched.step(now)
        now = step.end_time
        if step.preempted:
            break
    assert out.num_preemptions == 1 and "b" not in [t.request_id for t in out.tokens]


def test_033_preempted_request_with_output_in_flight_gets_it_and_counts_then():
    # Async: "b"'s token from the in-flight step s1 is stale when s2 preempts it, but it is
    # delivered with s1's outputs, carrying the PREEMPTED event.
    sched = make("vllm-0.33", num_gpu_blocks=5, max_model_len=16, budget=16)
    sched.add_request("a", prompt_tokens=5, max_tokens=4, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=8, max_tokens=4, arrival_time=0.0)
    s1 = sched.schedule(0.0)  # a: 2 blocks, b: 2 blocks; full
    s2 = sched.schedule(s1.end_time)  # a's 6th token fits; b's 9th needs a 3rd block
    assert s2.preempted == ["b"]
    b = sched.get("b")
    assert (b.num_stale_output_tokens, b.status) == (8, RequestStatus.PREEMPTED)

    out1 = sched.complete(s1)

    assert [t.request_id for t in out1.tokens] == ["a", "b"]
    assert out1.num_preemptions == 1
    assert b.num_output_tokens == 1 and b.num_stale_output_tokens == 0


def test_033_waiting_request_with_output_in_flight_is_deferred():
    sched = make("vllm-0.33", num_gpu_blocks=5, max_model_len=16, budget=16)
    sched.add_request("a", prompt_tokens=5, max_tokens=2, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=8, max_tokens=4, arrival_time=0.0)
    s1 = sched.schedule(0.0)
    sched.add_request("c", prompt_tokens=3, max_tokens=1, arrival_time=0.0)
    s2 = sched.schedule(s1.end_time)  # preempts b: nothing is admitted in this step
    assert s2.preempted == ["b"] and s2.admitted == []
    sched.complete(s1)  # a has its last token in flight (s2); b's stale output arrived
    s3 = sched.schedule(s2.end_time)
    assert sched.stats().num_deferred_waiting_reqs == 0
    assert set(s3.admitted) <= {"b", "c"}


# -- property: the block pool stays consistent with prefixes, async and preemption --------


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("schedule"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("complete"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(operation, max_size=80), num_gpu_blocks=st.integers(14, 40),
       block_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 5),
       budget=st.integers(1, 48))
def test_random_async_workloads_keep_the_pool_consistent_and_drain(
        ops, num_gpu_blocks, block_size, max_num_seqs, budget):
    max_model_len = min(52, (num_gpu_blocks - 1) * block_size)
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      max_model_len=max_model_len, cost=UNIT_COST), V033)
    pool = sched.pool
    in_flight = []  # at most 2 steps, as vLLM's batch queue
    added: list[str] = []
    now = 0.0

    def check() -> None:
        live = list(sched.running) + list(sched.waiting)
        refs = [0] * num_gpu_blocks
        for r in live:
            for block in r.block_ids:
                refs[block] += 1
        assert refs[1:] == pool.ref_cnt[1:] and refs[0] == 0
        assert set(pool.free_queue) == {b for b in range(1, num_gpu_blocks) if refs[b] == 0}
        assert len(sched.running) <= max_num_seqs
        for r in sched.running:
            assert r.num_blocks == math.ceil(r.num_computed_tokens / block_size)
            assert r.num_output_tokens < r.max_tokens
            assert r.num_output_placeholders <= 2
        for r in sched.waiting:
            assert r.num_blocks == 0 and r.num_computed_tokens == 0

    for kind, a, b, c in ops:
        if kind == "add":
            prompt = min(a, max_model_len - 1)
            max_tokens = min(b, max_model_len - prompt)
            prefix = (f"p{c}", min(prompt, 8)) if c else None
            rid = f"r{len(added)}"
            sched.add_request(rid, prompt, max_tokens, now, prefix=prefix)
            added.append(rid)
        elif kind == "schedule" and len(in_flight) < 2 and sched.has_unfinished:
            step = sched.schedule(now)
            assert sum(step.num_scheduled_tokens.values()) <= budget
            now = step.end_time
            if not step.is_empty:
                in_flight.append(step)
        elif kind == "complete" and in_flight:
            sched.complete(in_flight.pop(0))
        elif kind == "abort" and added:
            sched.abort(added[a % len(added)])
        check()

    for _ in range(5000):
        if not (sched.has_unfinished or in_flight):
            break
        if len(in_flight) < 2 and sched.has_unfinished:
            step = sched.schedule(now)
            now = step.end_time
            if not step.is_empty:
                in_flight.append(step)
                continue
        assert in_flight  # the engine always makes progress
        sched.complete(in_flight.pop(0))
        check()
    assert not sched.has_unfinished
    assert sched.num_finished + sched.num_aborted == len(added)
    assert sched.used_blocks == 0


def test_profiles_differ_only_in_the_documented_switches():
    assert dataclasses.replace(V011, name="vllm-0.33", reserve_full_isl=True,
                               enable_prefix_caching=True, async_scheduling=True,
                               count_preemption_on_next_output=True) == V033


def pipeline_admission_batch(profile: str) -> tuple[int, int]:
    """Drive the scheduler as enginesim.engine does: synchronous, each batch completes
    before the next is scheduled; async, batch k+1 is scheduled while batch k is in flight,
    and batch k's outputs are applied after that.

    Two slots. "c" decodes throughout; "a" (prompt 4, 2 tokens) finishes early; "b" waits
    for a slot. Returns (batch in which a's last token is sampled, batch that admits b)."""
    sched = make(profile, num_gpu_blocks=41, max_num_seqs=2, max_model_len=40)
    sched.add_request("c", prompt_tokens=4, max_tokens=30, arrival_time=0.0)
    sched.add_request("a", prompt_tokens=4, max_tokens=2, arrival_time=0.0)
    sched.add_request("b", prompt_tokens=4, max_tokens=1, arrival_time=0.0)
    async_ = sched.profile.async_scheduling
    in_flight = None
    now = 0.0
    a_last = b_admitted = None
    for batch in range(1, 20):
        step = sched.schedule(now)
        now = step.end_time
        if "b" in step.admitted:
            b_admitted = batch
            break
        if async_:
            done, in_flight = in_flight, step
        else:
            done = step
        if done is not None:
            out = sched.complete(done)
            if any(t.request_id == "a" and t.finished for t in out.tokens):
                a_last = batch if not async_ else batch - 1
    return a_last, b_admitted


def test_async_a_freed_slot_joins_one_batch_later():
    assert pipeline_admission_batch("vllm-0.11") == (2, 3)
    assert pipeline_admission_batch("vllm-0.33") == (2, 4)
