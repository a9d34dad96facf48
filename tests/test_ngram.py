"""NgramDrafter: lookup semantics, token trees, and that the incremental index agrees with a brute-force rescan."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified
from specdraft.drafters.ngram import NgramDrafter, NgramIndex
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
        ({"max_occurrences": 0}, "max_occurrences must be >= 1"),
        ({"max_occurrences": 2.0}, "max_occurrences must be an integer"),
    ],
)
def test_invalid_constructor_args(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NgramDrafter(**kwargs)


def test_name_and_defaults() -> None:
    assert NgramDrafter().name == "ngram"
    assert NgramDrafter(name="pld").name == "pld"


# ---- Token trees ----------------------------------------------------------------------------------------------


def index_of(context: Sequence[int], max_n: int = 3, min_n: int = 1, max_occurrences: int = 8) -> NgramIndex:
    index = NgramIndex(min_n, max_n, max_occurrences)
    index.sync(context)
    return index


def tree(context: Sequence[int], max_depth: int, max_nodes: int, max_n: int = 3, min_n: int = 1) -> Proposal:
    return fresh(context, max_n, min_n).propose([0], [context], [max_depth], [max_nodes])[0]


def children_of(prop: Proposal, node: int) -> list[int]:
    return [i for i, p in enumerate(prop.parents) if p == node]


def first_path(prop: Proposal) -> list[int]:
    """The tokens met by following the first child from the root."""
    path: list[int] = []
    kids = children_of(prop, ROOT)
    while kids:
        path.append(prop.tokens[kids[0]])
        kids = children_of(prop, kids[0])
    return path


def path_to(prop: Proposal, node: int) -> list[int]:
    path: list[int] = []
    while node != ROOT:
        path.append(prop.tokens[node])
        node = prop.parents[node]
    return path[::-1]


def reference_occurrences(context: Sequence[int], gram: Sequence[int]) -> list[int]:
    """Brute force: ends of every occurrence of `gram` that has a continuation, most recent first."""
    ctx, n = list(context), len(gram)
    return [end for end in range(len(ctx) - 2, n - 2, -1) if ctx[end - n + 1 : end + 1] == list(gram)]


def follows_an_occurrence(context: Sequence[int], path: list[int], max_n: int, min_n: int) -> bool:
    """Whether `path` is exactly what followed some earlier occurrence of a suffix n-gram of the context."""
    ctx, length = list(context), len(context)
    return any(
        ctx[end + 1 : end + 1 + len(path)] == path and end + 1 + len(path) <= length
        for n in range(min_n, min(max_n, length) + 1)
        for end in reference_occurrences(ctx, ctx[length - n :])
    )


def test_tree_branches_between_two_continuations() -> None:
    # The suffix (1, 2) was followed by 5 6 (most recent) and by 3 4: both become paths, the chain first.
    ctx = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    prop = tree(ctx, 2, 4, max_n=2)
    assert (prop.tokens, prop.parents, prop.draft_probs) == ([5, 6, 3, 4], [ROOT, 0, ROOT, 2], None)
    # A budget of 3 keeps the better-supported first token of the other branch.
    prop = tree(ctx, 2, 3, max_n=2)
    assert (prop.tokens, prop.parents) == ([5, 6, 3], [ROOT, 0, ROOT])


def test_tree_merges_shared_prefixes() -> None:
    # (1, 2) was followed by 3 5 9 (most recent) and 3 4 0: one node for the shared 3, branching below it.
    ctx = [0, 1, 2, 3, 4, 0, 1, 2, 3, 5, 9, 1, 2]
    prop = tree(ctx, 3, 5, max_n=2)
    assert (prop.tokens, prop.parents) == ([3, 5, 9, 4, 0], [ROOT, 0, 1, 0, 3])


def test_tree_orders_siblings_by_evidence_after_the_chain() -> None:
    # After 2 came 9 (latest, the chain), 8, then 7 twice: 7's two older occurrences outweigh 8's one newer.
    ctx = [2, 7, 2, 7, 2, 8, 2, 9, 2]
    prop = tree(ctx, 1, 3, max_n=1)
    assert (prop.tokens, prop.parents) == ([9, 7, 8], [ROOT, ROOT, ROOT])


def test_tree_first_path_is_exactly_the_chain_even_when_cut_short() -> None:
    # The chain stops at the context's end (1 2); an older occurrence continues 1 2 1 2, but the chain's tip
    # stays a leaf so the first path is exactly the chain, and the other occurrences add nothing else.
    ctx = [1, 2, 1, 2, 1, 2]
    assert fresh(ctx, max_n=2).propose([0], [ctx], [4])[0].tokens == [1, 2]
    prop = tree(ctx, 4, 8, max_n=2)
    assert (prop.tokens, prop.parents) == ([1, 2], [ROOT, 0])


def test_tree_is_the_chain_when_budget_within_depth_or_single_continuation() -> None:
    ctx = [1, 2, 3, 4, 1, 2, 5, 6, 7, 1, 2]
    drafter = fresh(ctx, max_n=2)
    for depth in range(1, 5):
        chain = reference(ctx, depth, 2, 1)
        for budget in range(1, depth + 1):
            prop = drafter.propose([0], [ctx], [depth], [budget])[0]
            assert prop.is_chain and prop.tokens == chain[:budget]
    # Only one earlier occurrence of any suffix n-gram: the tree cannot branch.
    ctx = [7, 1, 2, 3, 4, 5, 9, 8, 1, 2, 3]
    prop = tree(ctx, 3, 10)
    assert prop.is_chain and prop.tokens == [4, 5, 9]


def test_tree_empty_cases() -> None:
    assert tree([1, 2, 3, 4], 4, 8).tokens == []
    assert tree([5], 4, 8).tokens == []
    assert tree([1, 2, 1, 2], 0, 8).tokens == []
    assert tree([1, 2, 1, 2], 3, 0).tokens == []


@pytest.mark.parametrize(("max_n", "min_n"), [(3, 1), (2, 2), (1, 1)])
def test_tree_properties_on_random_contexts(max_n: int, min_n: int) -> None:
    rng = random.Random(500 + 10 * max_n + min_n)
    branched = 0
    for _ in range(150):
        ctx = [rng.randrange(rng.randrange(2, 5)) for _ in range(rng.randrange(0, 30))]
        index = index_of(ctx, max_n, min_n)
        depth, budget = rng.randrange(1, 6), rng.randrange(1, 14)
        prop = index.lookup_tree(depth, budget)
        assert isinstance(prop, Proposal) and prop.draft_probs is None
        assert len(prop) <= budget
        assert all(d <= depth for d in prop.depths)
        assert all(ROOT <= p < i for i, p in enumerate(prop.parents))
        # The chain is the first path (up to the budget); a budget within the depth gives nothing else.
        chain = reference(ctx, min(depth, budget), max_n, min_n)
        assert first_path(prop) == chain, (ctx, depth, budget)
        if budget <= depth:
            assert prop.tokens == chain
        # Siblings are distinct tokens and every path copies what followed an occurrence of the suffix.
        for node in [ROOT, *range(len(prop))]:
            tokens = [prop.tokens[c] for c in children_of(prop, node)]
            assert len(tokens) == len(set(tokens)), (ctx, prop)
        for node in range(len(prop)):
            assert follows_an_occurrence(ctx, path_to(prop, node), max_n, min_n), (ctx, prop, node)
        # After the chain child, siblings come by descending evidence (weight of continuations through them).
        found = index.continuations(depth)
        for node in [ROOT, *range(len(prop))]:
            kids = children_of(prop, node)[1:]
            evidence = [sum(w for cont, w in found if cont[: len(path_to(prop, k))] == path_to(prop, k)) for k in kids]
            assert evidence == sorted(evidence, reverse=True), (ctx, prop)
        # Best-first selection: a smaller budget beyond the depth gives a prefix of the bigger tree.
        for smaller in range(depth + 1, budget):
            small = index.lookup_tree(depth, smaller)
            assert (small.tokens, small.parents) == (prop.tokens[:smaller], prop.parents[:smaller])
        branched += not prop.is_chain
    assert branched > 10


def test_tree_looks_at_no_more_than_max_occurrences() -> None:
    ctx = [2, 7, 2, 7, 2, 8, 2, 9, 2]
    assert index_of(ctx, 1, 1, max_occurrences=1).lookup_tree(1, 3).tokens == [9]
    assert index_of(ctx, 1, 1, max_occurrences=2).lookup_tree(1, 3).tokens == [9, 8]


def test_occurrences_most_recent_first_and_limited() -> None:
    ctx = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    index = index_of(ctx, max_n=2, max_occurrences=2)
    assert index.occurrences([1, 2]) == [7, 4]
    assert index.occurrences([1, 2], limit=8) == [7, 4, 1]
    assert index.occurrences([2]) == [7, 4]
    assert index.occurrences([9, 9]) == []
    with pytest.raises(ValueError, match="length 1..2"):
        index.occurrences([1, 2, 3])


@pytest.mark.parametrize(("max_n", "min_n"), [(3, 1), (4, 2), (1, 1)])
def test_incremental_tree_index_matches_fresh(max_n: int, min_n: int) -> None:
    rng = random.Random(77 + 1000 * max_n + min_n)
    for _ in range(40):
        full = [rng.randrange(rng.randrange(2, 4)) for _ in range(rng.randrange(0, 40))]
        cut = rng.randrange(0, len(full) + 1)
        index = index_of(full[:cut], max_n, min_n)
        drafter = fresh(full[:cut], max_n, min_n)
        while True:
            ctx = full[:cut]
            index.sync(ctx)
            built = index_of(ctx, max_n, min_n)
            assert index.tables == built.tables and index.prev == built.prev
            assert index.indexed_upto == built.indexed_upto
            for n in range(min_n, min(max_n, len(ctx)) + 1):
                gram = ctx[len(ctx) - n :]
                assert index.occurrences(gram, limit=100) == reference_occurrences(ctx, gram)
            depth, budget = rng.randrange(1, 5), rng.randrange(1, 12)
            got = index.lookup_tree(depth, budget)
            want = built.lookup_tree(depth, budget)
            assert (got.tokens, got.parents) == (want.tokens, want.parents)
            prop = drafter.propose([0], [ctx], [depth], [budget])[0]
            assert (prop.tokens, prop.parents) == (want.tokens, want.parents)
            if cut == len(full):
                break
            cut = min(cut + rng.randrange(1, 5), len(full))
            drafter.observe(0, told(full[:cut]))


def test_chain_mode_unchanged_with_node_budget_none_or_max_k() -> None:
    rng = random.Random(3)
    for _ in range(60):
        ctx = [rng.randrange(3) for _ in range(rng.randrange(0, 25))]
        drafter = fresh(ctx)
        for max_k in range(0, 5):
            want = reference(ctx, max_k, 3, 1)
            for budgets in (None, [None], [max_k]):
                prop = drafter.propose([0], [ctx], [max_k], budgets)[0]
                assert prop.is_chain and prop.tokens == want and prop.draft_probs is None


def test_propose_takes_a_node_budget_per_request() -> None:
    drafter = fresh([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], max_n=2)
    start(drafter, [2, 7, 2, 8, 2], request_id=1)
    trees = drafter.propose([0, 1], [[1, 2, 3, 4, 1, 2, 5, 6, 1, 2], [2, 7, 2, 8, 2]], [2, 1], [2, 2])
    assert (trees[0].tokens, trees[0].parents) == ([5, 6], [ROOT, 0])  # a budget of max_k: the chain
    assert (trees[1].tokens, trees[1].parents) == ([8, 7], [ROOT, ROOT])
    with pytest.raises(ValueError, match="2 node budgets for 1 requests"):
        drafter.propose([0], [[1, 2]], [2], [4, 4])


def test_continuations_count_each_occurrence_once_with_its_longest_match() -> None:
    # Ends 5 and 1 match the 2-suffix (1, 2) and so also the 1-suffix (2,): each counts once, weighted as a
    # 2-gram match (MATCH_BASE ** 2) decayed by its recency rank.
    index = index_of([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], max_n=2)
    base, decay = NgramIndex.MATCH_BASE, NgramIndex.RECENCY_DECAY
    assert index.continuations(2) == [([5, 6], base**2), ([3, 4], base**2 * decay)]
    assert index.continuations(5) == [([5, 6, 1, 2], base**2), ([3, 4, 1, 2, 5], base**2 * decay)]


# ---------------------------------------------------------------------------------------- predicted outputs


def predicted(prompt: Sequence[int], prediction: Sequence[int], max_n: int = 3) -> NgramDrafter:
    drafter = NgramDrafter(max_n=max_n)
    drafter.add_request(DraftRequest(0, list(prompt), SamplingParams(temperature=0.0, prediction=prediction), None))
    return drafter


def test_a_prediction_is_drafted_from_its_start_then_wherever_the_output_matches_it() -> None:
    prompt, prediction = [1, 2, 3], [7, 8, 9, 10, 11]
    drafter = predicted(prompt, prediction)
    assert drafter.propose([0], [prompt], [3])[0].tokens == [7, 8, 9]  # the output's start: the prediction's
    # the output replaced 8 by 5, then went on as predicted: the match on 9 resumes the prediction
    assert drafter.propose([0], [prompt + [7, 5, 9]], [3])[0].tokens == [10, 11]
    assert drafter.match_length(0, prompt + [7, 5, 9]) == 1
    drafter.remove_request(0)
    assert not drafter._predictions
    # (a request's context only grows: another output, another request)
    # nothing of the prediction matches: the context's own lookup, as without one
    context = prompt + [4, 5, 4]
    drafter = predicted(prompt, prediction)
    assert drafter.propose([0], [context], [3])[0].tokens == [5, 4]
    drafter.remove_request(0)
    assert not drafter._predictions


def test_the_longer_match_wins_between_the_context_and_the_prediction() -> None:
    prompt = [5, 6, 7, 8, 1, 2]
    drafter = predicted(prompt, [6, 20, 21])
    # the prompt's suffix "1 2" occurred nowhere before; the prediction index holds the prompt's last tokens
    # then the prediction, so the output's first tokens are the prediction's
    assert drafter.propose([0], [prompt], [3])[0].tokens == [6, 20, 21]
    # after "5 6": a 2-token match in the context (followed by 7 8), a 1-token one in the prediction (6 20)
    context = prompt + [5, 6]
    drafter = predicted(prompt, [6, 20, 21])
    assert drafter.propose([0], [context], [2])[0].tokens == [7, 8]
    assert drafter.match_length(0, context) == 2


def test_a_tree_with_a_prediction_holds_both_continuations() -> None:
    prompt = [5, 6, 7, 8, 1, 2]
    drafter = predicted(prompt, [6, 20, 21])
    proposal = drafter.propose([0], [prompt + [5, 6]], [2], [4])[0]
    assert first_path(proposal) == [7, 8] and 20 in proposal.tokens
    # the prediction's nodes are marked (the usage's accepted / rejected prediction tokens count them)
    assert [t for t, mark in zip(proposal.tokens, proposal.predicted) if mark] == [20, 21][:sum(proposal.predicted)]
    assert proposal.predicted[proposal.tokens.index(20)] and not any(
        mark for t, mark in zip(proposal.tokens, proposal.predicted) if t in (7, 8))


def test_drafts_from_the_prediction_are_marked_and_the_marks_survive_truncation() -> None:
    prompt = [1, 2, 3]
    drafter = predicted(prompt, [7, 8, 9, 10, 11])
    chain = drafter.propose([0], [prompt], [4])[0]
    assert chain.tokens == [7, 8, 9, 10] and chain.predicted == [True] * 4
    assert chain.truncated(2).predicted == [True, True]
    from_context = drafter.propose([0], [prompt + [4, 5, 4]], [3])[0]  # nothing of the prediction matches
    assert from_context.tokens == [5, 4] and from_context.predicted is None
    tree = Proposal([7, 4, 8], None, [ROOT, ROOT, 0], [True, False, True])
    assert tree.truncated(1).predicted == [True, False]
    with pytest.raises(ValueError, match="prediction marks"):
        Proposal([1, 2], predicted=[True])
