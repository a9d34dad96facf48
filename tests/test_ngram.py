"""NgramDrafter: lookup semantics, and that the incremental index agrees with a brute-force rescan."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from specdraft.drafters.base import DraftRequest, Proposal, Verified
from specdraft.drafters.ngram import NgramDrafter
from specdraft.verify.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.0)


def fresh(context: Sequence[int], max_n: int = 3, min_n: int = 1) -> NgramDrafter:
    drafter = NgramDrafter(max_n=max_n, min_n=min_n)
    start(drafter, context)
    return drafter


def start(drafter: NgramDrafter, prompt: Sequence[int], request_id: int = 0) -> None:
    drafter.add_request(DraftRequest(request_id, list(prompt), PARAMS, None))


def told(context: Sequence[int]) -> Verified:
    """What the engine tells a drafter after a round (only the context matters to lookup)."""
    return Verified(scored=[], positions=[], accepted=[], emitted=[], context=context)


def reference(context: Sequence[int], max_k: int, max_n: int, min_n: int) -> list[int]:
    """Obviously-correct O(L * n) rescan: longest suffix first, latest strictly-earlier occurrence."""
    ctx = list(context)
    length = len(ctx)
    if max_k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > length:
            continue
        suffix = ctx[length - n :]
        for end in range(length - 2, n - 2, -1):  # end of an earlier occurrence, never the suffix itself
            if ctx[end - n + 1 : end + 1] == suffix:
                return ctx[end + 1 : min(end + 1 + max_k, length)]
    return []


def test_proposes_continuation_of_repeated_phrase() -> None:
    ctx = [7, 1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    prop = fresh(ctx).propose([0], [ctx], [3])[0]
    assert isinstance(prop, Proposal)
    assert prop.tokens == [4, 5, 9]
    assert prop.draft_probs is None


def test_prefers_longer_ngram_match() -> None:
    # Suffix (1, 2): the 1-gram "2" last occurred at position 5 (followed by 8), but the 2-gram (1, 2) only
    # at positions 0-1 (followed by 3). The longer match must win.
    ctx = [1, 2, 3, 4, 0, 2, 8, 1, 2]
    assert fresh(ctx, max_n=2).propose([0], [ctx], [1])[0].tokens == [3]
    assert fresh(ctx, max_n=1).propose([0], [ctx], [1])[0].tokens == [8]


def test_prefers_most_recent_occurrence() -> None:
    ctx = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert fresh(ctx).propose([0], [ctx], [2])[0].tokens == [20, 21]


def test_empty_when_no_match() -> None:
    ctx = [1, 2, 3, 4]
    assert fresh(ctx).propose([0], [ctx], [4])[0].tokens == []


def test_empty_for_max_k_zero_or_negative() -> None:
    ctx = [1, 2, 1, 2]
    drafter = fresh(ctx)
    assert drafter.propose([0], [ctx], [0])[0].tokens == []
    assert drafter.propose([0], [ctx], [-3])[0].tokens == []


def test_empty_for_short_contexts() -> None:
    assert fresh([5]).propose([0], [[5]], [4])[0].tokens == []
    assert fresh([]).propose([0], [[]], [4])[0].tokens == []


def test_respects_max_k() -> None:
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]
    drafter = fresh(ctx)
    for k in range(1, 7):
        assert drafter.propose([0], [ctx], [k])[0].tokens == [3, 4, 5, 6, 7, 8][:k]


def test_continuation_stops_at_end_of_context() -> None:
    # (1, 2) last occurred at 2-3; only positions 4-5 follow it, which is the suffix itself.
    ctx = [1, 2, 1, 2, 1, 2]
    assert fresh(ctx, max_n=2).propose([0], [ctx], [10])[0].tokens == [1, 2]


def test_suffix_never_matches_itself() -> None:
    # Every token is new, so the only occurrence of any suffix n-gram is the suffix itself.
    drafter = NgramDrafter()
    start(drafter, [])
    ctx: list[int] = []
    for tok in range(10):
        ctx.append(tok)
        assert drafter.propose([0], [ctx], [4])[0].tokens == []
        drafter.observe(0, told(ctx))
    # The one repeat in a 2-token context is found, with the continuation that exists.
    assert fresh([5, 5]).propose([0], [[5, 5]], [4])[0].tokens == [5]


def test_proposals_come_from_an_earlier_occurrence() -> None:
    rng = random.Random(1)
    for _ in range(100):
        ctx = [rng.randrange(3) for _ in range(rng.randrange(1, 25))]
        drafter = fresh(ctx)
        prop = drafter.propose([0], [ctx], [5])[0].tokens
        if not prop:
            continue
        length = len(ctx)
        # Some suffix n-gram must recur ending strictly before the context's end, followed by exactly `prop`.
        ok = any(
            ctx[end - n + 1 : end + 1] == ctx[length - n :]
            and end + 1 + len(prop) <= length
            and ctx[end + 1 : end + 1 + len(prop)] == prop
            for n in range(1, min(3, length) + 1)
            for end in range(n - 1, length - 1)
        )
        assert ok, (ctx, prop)


@pytest.mark.parametrize(("max_n", "min_n"), [(3, 1), (4, 2), (1, 1), (2, 2)])
def test_incremental_matches_fresh_and_reference(max_n: int, min_n: int) -> None:
    rng = random.Random(1000 * max_n + min_n)
    for _ in range(60):
        vocab = rng.randrange(2, 5)
        full = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        prompt_len = rng.randrange(0, len(full) + 1)
        drafter = NgramDrafter(max_n=max_n, min_n=min_n)
        start(drafter, full[:prompt_len])
        cut = prompt_len
        while True:
            ctx = full[:cut]
            max_k = rng.randrange(0, 6)
            got = drafter.propose([0], [ctx], [max_k])[0].tokens
            assert got == reference(ctx, max_k, max_n, min_n), (ctx, max_k)
            assert got == fresh(ctx, max_n, min_n).propose([0], [ctx], [max_k])[0].tokens
            if cut == len(full):
                break
            step = rng.randrange(1, 5)
            cut = min(cut + step, len(full))
            drafter.observe(0, told(full[:cut]))


def test_lazy_indexing_without_accepted_calls() -> None:
    rng = random.Random(7)
    full = [rng.randrange(3) for _ in range(60)]
    drafter = fresh(full[:5])
    for cut in range(5, 61, 3):
        ctx = full[:cut]
        assert drafter.propose([0], [ctx], [4])[0].tokens == reference(ctx, 4, 3, 1)


def test_requests_have_their_own_index_and_accept_other_sequence_types() -> None:
    drafter = fresh([1, 2, 3, 1, 2])
    assert drafter.propose([0], [[1, 2, 3, 1, 2]], [2])[0].tokens == [3, 1]
    start(drafter, torch.tensor([4, 5, 6]).tolist(), request_id=1)
    assert drafter.propose([1], [torch.tensor([4, 5, 6])], [2])[0].tokens == []
    ctx = (4, 5, 6, 4, 5)
    assert drafter.propose([1], [ctx], [2])[0].tokens == [6, 4]
    assert all(type(t) is int for t in drafter.propose([1], [torch.tensor(ctx)], [2])[0].tokens)
    # Request 0 is untouched by request 1's text, and is gone once removed.
    assert drafter.propose([0], [[1, 2, 3, 1, 2]], [2])[0].tokens == [3, 1]
    drafter.remove_request(0)
    with pytest.raises(KeyError):
        drafter.propose([0], [[1, 2, 3, 1, 2]], [2])[0]


def test_shorter_context_rebuilds_instead_of_using_stale_index() -> None:
    drafter = fresh([1, 2, 3, 1, 2])
    assert drafter.propose([0], [[9, 8, 9]], [2])[0].tokens == [8, 9]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_n": 0}, "min_n must be >= 1"),
        ({"max_n": 0, "min_n": 0}, "min_n must be >= 1"),
        ({"max_n": 2, "min_n": 3}, "max_n must be >= min_n"),
        ({"max_n": 2.5}, "max_n must be an integer"),
        ({"min_n": True}, "min_n must be an integer"),
    ],
)
def test_invalid_constructor_args(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NgramDrafter(**kwargs)


def test_name_and_defaults() -> None:
    assert NgramDrafter().name == "ngram"
    assert NgramDrafter(name="pld").name == "pld"
