"""The exponential moving average every running estimate here uses (a forward's time in the runtime's
thread governor, acceptance and costs in the engine's adaptation).

A leaf module that every layer may import (it imports nothing of specdraft), as errors.py is: the runtime
cannot import the engine, and one formula should not live in two places.
"""

from __future__ import annotations


def ema(old: float | None, new: float, weight: float) -> float:
    """An exponential moving average's next value: `new` itself when there is no `old` yet."""
    return new if old is None else old + weight * (new - old)


# A measured time more than this many times what is expected of it enters an estimate as this many times it.
STALL_FACTOR = 4.0


def timing_ema(old: float | None, new: float, weight: float, expected: float | None = None) -> float:
    """`ema` of a measured duration, robust to one stall of the machine: `new` counts at most STALL_FACTOR
    times `expected` (the estimate itself by default; no cap without one).

    A shared machine now and then stalls a round tens of times over (a page fault, another process, a
    collector pause). Taken whole, one such round moved an estimate far enough to switch speculation off for
    dozens of rounds (a request's fallback, a planner's table entry no plan measured again). Capped, one
    stall moves an estimate no more than a few rounds of a real slowdown do, and a real one is still followed
    within a few rounds (each may grow the estimate by `weight * (STALL_FACTOR - 1)` of itself)."""
    limit = old if expected is None else expected
    if limit is not None and limit > 0:
        new = min(new, STALL_FACTOR * limit)
    return ema(old, new, weight)
