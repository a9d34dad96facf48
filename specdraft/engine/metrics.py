"""Acceptance metrics, per request and cumulative.

Conventions (as in Spec-Bench): `mean_accepted_length` is the number of tokens each target decode forward
produced, *counting* the target's own correction/bonus token, so plain decoding scores exactly 1.00. The
prefill forward (which yields the first token) is not a decode forward and is not counted in it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields


# The acceptance math, as pure functions shared by the engine's metrics and the benchmark report
# (None where the denominator is 0).
def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def mean_accepted_length(produced_tokens: int, target_forwards: int) -> float | None:
    return ratio(produced_tokens, target_forwards)


def acceptance_rate(accepted: int, drafted: int) -> float | None:
    return ratio(accepted, drafted)


def add_positions(lists: Iterable[Sequence[int] | None]) -> list[int]:
    """Element-wise sum of per-position counts of different lengths (missing positions count 0)."""
    out: list[int] = []
    for xs in lists:
        if not xs:
            continue
        if len(xs) > len(out):
            out.extend([0] * (len(xs) - len(out)))
        for i, x in enumerate(xs):
            out[i] += x
    return out


def per_position_rates(accepted_per_position: Sequence[int],
                       drafted_per_position: Sequence[int]) -> list[float]:
    """accepted / drafted at each draft position (0.0 where nothing was drafted)."""
    accepted = list(accepted_per_position) + [0] * (len(drafted_per_position) - len(accepted_per_position))
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted_per_position, strict=False)]


@dataclass
class SpecMetrics:
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # prompt tokens whose cache entries were copied from an earlier prompt
    generated_tokens: int = 0
    target_forwards: int = 0  # decode/verify forwards of the target (prefill excluded)
    produced_tokens: int = 0  # tokens those forwards produced (accepted + 1 each), before stop truncation
    drafted: int = 0  # draft positions offered: tokens of a chain, the depth of a tree
    accepted: int = 0
    draft_nodes: int = 0  # draft tokens the target verified (a tree's every node)
    tree_rounds: int = 0  # rounds that verified a tree rather than a chain
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    speculative_rounds: int = 0
    prediction_drafted: int = 0  # draft tokens the request's prediction proposed (Predicted Outputs)
    prediction_accepted: int = 0  # of those, the ones verification accepted
    fallback_rounds: int = 0  # decode forwards run without drafting because speculation did not pay
    fallback_events: int = 0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    def record_round(self, num_drafted: int, num_accepted: int, num_nodes: int | None = None) -> None:
        """num_drafted: the draft's depth (a chain's length); num_nodes: a tree's size (None: a chain)."""
        self.target_forwards += 1
        self.produced_tokens += num_accepted + 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.draft_nodes += num_drafted if num_nodes is None else num_nodes
        self.tree_rounds += num_nodes is not None
        if num_drafted:
            self.speculative_rounds += 1
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted, self.drafted) or 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target decode forward, bonus/correction included (plain decoding = 1.00)."""
        return mean_accepted_length(self.produced_tokens, self.target_forwards) or 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return per_position_rates(self.accepted_per_position, self.drafted_per_position)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode_time = self.total_time - self.prefill_time
        tokens = self.generated_tokens - 1
        return tokens / decode_time if decode_time > 0 and tokens > 0 else 0.0

    def merge(self, other: SpecMetrics) -> SpecMetrics:
        """Cumulative metrics over several requests."""
        out = copy.copy(self)  # field by field: asdict's deep copy cost more than the rest of a short request
        for name in _SUMMED:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.drafted_per_position = add_positions([self.drafted_per_position, other.drafted_per_position])
        out.accepted_per_position = add_positions([self.accepted_per_position, other.accepted_per_position])
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 per_position_acceptance=self.per_position_acceptance, tokens_per_second=self.tokens_per_second,
                 decode_tokens_per_second=self.decode_tokens_per_second)
        return d

    def summary(self) -> str:
        line = (f"{self.generated_tokens} tokens in {self.total_time:.2f}s ({self.tokens_per_second:.1f} tok/s, "
                f"prefill {self.prefill_time * 1000:.0f} ms)")
        if self.drafted:
            line += (f" | acceptance {self.acceptance_rate:.1%}, mean accepted length "
                     f"{self.mean_accepted_length:.2f} (incl. bonus), draft {self.draft_time:.2f}s / verify "
                     f"{self.verify_time:.2f}s")
            if self.fallback_events:
                line += f", fell back to plain {self.fallback_events}x"
        return line


# The counters and times `SpecMetrics.merge` adds up: every int or float field (the per-position lists apart).
_SUMMED = tuple(f.name for f in fields(SpecMetrics) if f.type in ("int", "float"))
