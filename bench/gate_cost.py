"""What one admission decision costs the pure gate with N requests already open (bench/README.md,
"bench.gate_cost"): the gate sits on every request's path, so its cost must not grow with N.

    .venv/bin/python -m bench.gate_cost [--open 10,100,1000,4000] [--reps 2000] [--rounds 5] [--per-scrape 200]

Builds an `EngineGate` with the service's default limits (the KV budget on, max in-flight raised
past N), admits N requests after a scrape, then times `arrive` + `finish` of one more request
(admitted at once, then finished: the hot path's pair of gate events) with a scrape after every
`--per-scrape` pairs (200: 1,000 requests/s at the default 0.2 s poll; the gate forgets finished
requests at each scrape), the scrapes' cost included; median of `--rounds` rounds, microseconds
per pair. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

from extproc.admission import gate_limits
from extproc.config import load_settings
from extproc.gate import EngineGate, EngineSnapshot, Ticket
from extproc.outcomes import Outcome

CAPACITY = 10**9  # tokens: the budget never binds, so every request is admitted


def gate_with_open(n: int) -> EngineGate:
    """A gate holding `n` open admitted requests, some seen by its last scrape and some not."""
    settings = load_settings({"ADMISSION_OBSERVE_MODELS": "m"})
    limits = replace(gate_limits(settings, settings.engines[0]), max_inflight=n + 16)
    gate = EngineGate(limits)
    gate.observe(EngineSnapshot(0, 0, 0.0, 0.0, capacity_tokens=CAPACITY, block_size=16), 0.0)
    for i in range(n):  # admitted over 10 s, so the next scrape saw some, maybe some, not others
        now = 1.0 + 10.0 * i / max(1, n)
        decision = gate.arrive(Ticket("m", now, tokens=1000, generation=200), now)
        assert decision.outcome is Outcome.ADMITTED, decision
    gate.observe(EngineSnapshot(n // 2, 0, 0.1, 8.0, capacity_tokens=CAPACITY, block_size=16), 12.0)
    return gate


def time_pairs(gate: EngineGate, reps: int, per_scrape: int) -> float:
    """Microseconds per arrive + finish of one request on `gate`, a scrape every `per_scrape`."""
    snap = gate.snapshot
    assert snap is not None
    now = snap.scrape_started + 4.0
    started = time.perf_counter()
    for i in range(reps):
        now += 1e-4
        ticket = gate.arrive(Ticket("m", now, tokens=1000, generation=200), now).ticket
        gate.finish(ticket, now)
        if (i + 1) % per_scrape == 0:
            gate.observe(replace(snap, scrape_started=now), now)
    return (time.perf_counter() - started) / reps * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gate_cost", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--open", default="10,100,1000,4000", help="open requests before the timed pairs")
    parser.add_argument("--reps", type=int, default=2000, help="arrive + finish pairs per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported")
    parser.add_argument("--per-scrape", type=int, default=200, help="arrive + finish pairs between two scrapes")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.open.split(",") if x.strip()]
    if not counts or min(counts) < 0 or min(args.reps, args.rounds, args.per_scrape) < 1:
        parser.error("--open takes counts >= 0; --reps, --rounds and --per-scrape must be >= 1")
    result = {}
    print(f"{'open requests':>14}  {'us per arrive + finish':>22}")
    for n in counts:
        gate = gate_with_open(n)
        us = statistics.median(time_pairs(gate, args.reps, args.per_scrape) for _ in range(args.rounds))
        assert gate.inflight == n, "every timed request was finished"
        result[str(n)] = round(us, 2)
        print(f"{n:>14}  {us:>22.2f}")
    print(json.dumps({"us_per_arrive_finish": result, "reps": args.reps, "rounds": args.rounds,
                      "per_scrape": args.per_scrape}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
