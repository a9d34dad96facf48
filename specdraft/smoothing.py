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


def geometric_ema(old: float | None, new: float, weight: float) -> float:
    """An exponential moving average of logarithms (`new` itself when there is no `old` yet), for positive
    quantities estimated by dividing one by another. The arithmetic average of noisy ratios is biased up
    (Jensen's inequality: E[x / y] > E[x] / E[y]), and two such estimates that divide each other compound the
    bias round after round; the average of their logarithms is not biased."""
    if old is None or old <= 0 or new <= 0:
        return ema(old, new, weight)
    return old * (new / old) ** weight


def timing_ema(old: float | None, new: float, weight: float, expected: float | None = None,
               geometric: bool = False) -> float:
    """`ema` of a measured duration, robust to one stall of the machine: `new` counts at most STALL_FACTOR
    times `expected` (the estimate itself by default; no cap without one).

    A shared machine now and then stalls a round tens of times over (a page fault, another process, a
    collector pause). Taken whole, one such round moved an estimate far enough to switch speculation off for
    dozens of rounds (a request's fallback, a planner's table entry no plan measured again). Capped, one
    stall moves an estimate no more than a few rounds of a real slowdown do, and a real one is still followed
    within a few rounds (each may grow the estimate by `weight * (STALL_FACTOR - 1)` of itself; `geometric`:
    by STALL_FACTOR ** weight)."""
    limit = old if expected is None else expected
    if limit is not None and limit > 0:
        new = min(new, STALL_FACTOR * limit)
    return geometric_ema(old, new, weight) if geometric else ema(old, new, weight)
