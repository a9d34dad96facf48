"""The report math, as small pure functions over plain numbers and dicts (unit tested on synthetic data).

Conventions (Spec-Bench's):
- throughput = generated tokens / wall time, prefill included. Per sample (one turn of one prompt) the time is
  the median over repeats; a group aggregates as total tokens / total time (so long answers weigh more).
- speedup = a method's throughput / `plain`'s throughput on the same samples of the same run.
- mean accepted length = tokens produced per target decode forward, correction/bonus token included
  (plain = 1.00), summed over samples before dividing.
- acceptance rate = accepted draft tokens / drafted tokens; per position i: accepted at i / drafted at i.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from specdraft.engine.metrics import (  # noqa: F401  (the acceptance math is the engine's; re-exported here)
    acceptance_rate,
    add_positions,
    mean_accepted_length,
    per_position_rates,
    ratio,
)


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def throughput(tokens: float, seconds: float) -> float | None:
    return ratio(tokens, seconds)


def speedup(tokens_per_s: float | None, base_tokens_per_s: float | None) -> float | None:
    return ratio(tokens_per_s, base_tokens_per_s)


# Counters a sample carries when the method reports them (ours); peers leave them None.
COUNTERS = ("target_forwards", "produced_tokens", "drafted", "accepted")


def summarize_repeats(runs: Sequence[dict]) -> dict:
    """One sample's repeats -> medians of time, tokens and TTFT, and counters summed over repeats.

    Each run is a dict with `tokens`, `time_s`, `ttft_s` and, for our methods, the COUNTERS and
    `drafted_per_position` / `accepted_per_position`.
    """
    if not runs:
        raise ValueError("no runs to summarize")
    out = {
        "tokens": median(r["tokens"] for r in runs),
        "time_s": median(r["time_s"] for r in runs),
        "ttft_s": median(r.get("ttft_s") for r in runs),
        "times_s": [r["time_s"] for r in runs],
    }
    has_counters = all(r.get("target_forwards") is not None for r in runs)
    for name in COUNTERS:
        out[name] = sum(r[name] for r in runs) if has_counters else None
    for name in ("drafted_per_position", "accepted_per_position"):
        out[name] = add_positions(r.get(name) for r in runs) if has_counters else None
    return out


def aggregate(samples: Sequence[dict]) -> dict:
    """Per-sample summaries (from `summarize_repeats`) of one method over a group -> the group's numbers."""
    tokens = sum(s["tokens"] for s in samples)
    seconds = sum(s["time_s"] for s in samples)
    out = {
        "samples": len(samples),
        "tokens": tokens,
        "time_s": seconds,
        "tokens_per_s": throughput(tokens, seconds),
        "ttft_s": median(s.get("ttft_s") for s in samples),
        "mean_accepted_length": None,
        "acceptance_rate": None,
        "drafted": None,
        "accepted": None,
        "per_position_acceptance": None,
        "drafted_per_position": None,
        "accepted_per_position": None,
    }
    if samples and all(s.get("target_forwards") is not None for s in samples):
        forwards = sum(s["target_forwards"] for s in samples)
        produced = sum(s["produced_tokens"] for s in samples)
        drafted = sum(s["drafted"] for s in samples)
        accepted = sum(s["accepted"] for s in samples)
        dpp = add_positions(s["drafted_per_position"] for s in samples)
        app = add_positions(s["accepted_per_position"] for s in samples)
        app += [0] * (len(dpp) - len(app))
        out.update(mean_accepted_length=mean_accepted_length(produced, forwards),
                   acceptance_rate=acceptance_rate(accepted, drafted), drafted=drafted, accepted=accepted,
                   per_position_acceptance=per_position_rates(app, dpp), drafted_per_position=dpp,
                   accepted_per_position=app)
    return out


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter length); None if
    equal."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    if len(reference) != len(other):
        return min(len(reference), len(other))
    return None
