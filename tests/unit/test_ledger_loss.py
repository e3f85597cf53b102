"""How a replica tells, from the committed state Redis answers, that the state it knew was lost.

The ledger's commit script starts a state's versions at the server's time in microseconds and
calls that first version the state's epoch; each commit adds one. A reply follows from the known
state only if it is the same lifetime (epoch) at the same or a later version.
"""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from extproc.ledger import state_loss

EPOCH = "1719533211068153"


@pytest.mark.parametrize(("known", "seen", "loss"), [
    (("0", ""), ("0", ""), None),  # nothing known yet: whatever Redis holds is the first view
    (("0", ""), (EPOCH, EPOCH), None),
    ((EPOCH, EPOCH), (EPOCH, EPOCH), None),
    ((str(int(EPOCH) + 3), EPOCH), (str(int(EPOCH) + 9), EPOCH), None),  # others committed meanwhile
    ((str(int(EPOCH) + 3), EPOCH), ("0", ""), "vanished"),  # FLUSHALL, or a restart without persistence
    ((str(int(EPOCH) + 3), EPOCH), ("1719533299000000", "1719533299000000"), "recreated"),  # another replica began anew
    ((str(int(EPOCH) + 9), EPOCH), (str(int(EPOCH) + 3), EPOCH), "regressed"),  # restored from an older snapshot
])
def test_a_reply_shows_a_lost_state_only_when_it_cannot_follow_from_the_known_one(
        known: tuple[str, str], seen: tuple[str, str], loss: str | None) -> None:
    assert state_loss(*known, *seen) == loss


VERSIONS = st.integers(1, 2**62).map(str)


@given(epoch=VERSIONS, known=st.integers(0, 10_000), later=st.integers(0, 10_000))
def test_any_later_version_of_the_same_lifetime_is_no_loss(epoch: str, known: int, later: int) -> None:
    base = int(epoch)
    assert state_loss(str(base + known), epoch, str(base + known + later), epoch) is None


@given(epoch=VERSIONS, other=VERSIONS, known=st.integers(0, 10_000), seen=st.integers(0, 10_000))
def test_a_state_of_another_lifetime_or_none_at_all_is_always_a_loss(epoch: str, other: str, known: int,
                                                                      seen: int) -> None:
    known_version = str(int(epoch) + known)
    assert state_loss(known_version, epoch, "0", "") == "vanished"
    if other != epoch:
        assert state_loss(known_version, epoch, str(int(other) + seen), other) == "recreated"
