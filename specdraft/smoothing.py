"""The exponential moving average every running estimate here uses (a forward's time in the runtime's
thread governor, acceptance and costs in the engine's adaptation).

A leaf module that every layer may import (it imports nothing of specdraft), as errors.py is: the runtime
cannot import the engine, and one formula should not live in two places.
"""

from __future__ import annotations


def ema(old: float | None, new: float, weight: float) -> float:
    """An exponential moving average's next value: `new` itself when there is no `old` yet."""
    return new if old is None else old + weight * (new - old)
