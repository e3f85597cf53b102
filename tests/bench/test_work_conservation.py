"""`bench.admission.work_conservation`: time held before the engine, and the part with room there."""

from __future__ import annotations

import pytest

from bench.admission import RequestRecord, work_conservation
from bench.scenarios import CLASSES, RequestSpec

OCCUPANCY = {"max_num_seqs": 2, "capacity_tokens": 1_024, "block_size": 16}


def record(index: int, sent: float, finished: float | None = None, cls: str = "short") -> RequestRecord:
    return RequestRecord(RequestSpec(index, CLASSES[cls], 0.0), replica=0, sent=sent, finished=finished)


def arrival(index: int, wall: float) -> dict:
    return {"id": f"bench-{index}", "wall_time": wall}


def test_time_held_while_the_engine_had_a_free_slot_and_kv_counts_as_parked_while_free() -> None:
    # Two slots. Full from 0 to 5, one slot free from 5 on.
    timeline = [(0.0, 2, 96), (5.0, 1, 48)]
    fast = record(0, sent=0.0)  # its trip took 0.1 s: the class's transit
    parked = record(1, sent=1.0)  # held from 1.0 to 7.0 (arrived 7.1): free from 5.0 to 7.0
    held, free = work_conservation([fast, parked], [arrival(0, 0.1), arrival(1, 7.1)],
                                   {**OCCUPANCY, "timeline": timeline})
    assert held == pytest.approx(6.0)
    assert free == pytest.approx(2.0)


def test_a_free_slot_without_room_for_the_whole_kv_need_is_not_room() -> None:
    timeline = [(0.0, 2, 96), (5.0, 1, 1_000)]  # a slot frees at 5.0, but the KV is committed
    held, free = work_conservation([record(0, sent=0.0), record(1, sent=1.0)], [arrival(0, 0.1), arrival(1, 7.1)],
                                   {**OCCUPANCY, "timeline": timeline})
    assert (held, free) == (pytest.approx(6.0), 0.0)


def test_a_rejected_request_is_held_until_its_answer() -> None:
    timeline = [(0.0, 1, 48)]  # a slot was free the whole time
    ok, rejected = record(0, sent=0.0), record(1, sent=1.0, finished=4.1)
    held, free = work_conservation([ok, rejected], [arrival(0, 0.1)], {**OCCUPANCY, "timeline": timeline})
    assert held == pytest.approx(3.0) and free == pytest.approx(3.0)
