"""Event rates over a window that ends now, for the operator's views (the status page).

A rate measured between the first and the last event of a window (the gate's
`completion_rate`, which sizes Retry-After) keeps its last value when traffic stops. What an
operator reads must fall to 0 instead: the window here ends at `now`, so once the events stop
the rate decays and is 0 one window after the last of them.
"""

from __future__ import annotations

from collections.abc import Sequence


def rate_until_now(times: Sequence[float], now: float, window: float, kept: int | None = None) -> float:
    """Events per second in the `window` seconds up to `now`, from their times (oldest first).

    `kept`: the most times the caller keeps (a bounded deque). When it is full and its oldest
    time is inside the window, what came before is unknown, so the window starts at that oldest
    event and counts the ones after it.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    start = now - window
    count = sum(1 for t in times if start < t <= now)
    if kept is not None and len(times) >= kept and times and times[0] > start:
        start, count = times[0], count - 1
    span = now - start
    return count / span if span > 0 and count > 0 else 0.0
