"""The suffix cache drafter: lookup across requests, bounds and eviction, thread safety, and losslessness
through the engine (greedy identity for chains, trees and batches; the target's distribution when sampling)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from test_engine import BATCH, FIXED, NUM_SAMPLES, VOCAB, exact_joint, matches, sample_joint
from tiny_models import ToyTokenizer, tiny_model

from specdraft.drafters import make_drafter
from specdraft.drafters.base import DraftRequest, Verified
from specdraft.drafters.suffix import SEPARATOR, SuffixCache, SuffixDrafter
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.verify.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.0)


def told(context) -> Verified:
    return Verified(scored=[], positions=[], accepted=[], emitted=[], context=context)


def run_request(drafter: SuffixDrafter, request_id: int, tokens: list[int]) -> None:
    """A request that saw `tokens` and finished: its text enters the cache."""
    drafter.add_request(DraftRequest(request_id, tokens[:2], PARAMS, None))
    drafter.observe(request_id, told(tokens))
    drafter.remove_request(request_id)


def test_drafts_from_an_earlier_request_that_the_own_context_cannot_see():
    drafter = SuffixDrafter()
    run_request(drafter, 0, [5, 6, 7, 8, 9, 10, 11])
    drafter.add_request(DraftRequest(1, [1, 6, 7], PARAMS, None))
    assert drafter.propose([1], [[1, 6, 7]], [3])[0].tokens == [8, 9, 10]
    # The request's own earlier text wins where it matches as long.
    ctx = [1, 6, 7, 3, 3, 6, 7]
    assert drafter.propose([1], [ctx], [2])[0].tokens == [3, 3]


def test_longer_match_in_the_cache_beats_a_shorter_one_in_the_context():
    drafter = SuffixDrafter()
    run_request(drafter, 0, [1, 2, 3, 4, 50, 51])
    ctx = [3, 4, 90, 9, 2, 3, 4]  # own context: "3 4" -> 90; cache: "2 3 4" -> 50
    drafter.add_request(DraftRequest(1, ctx, PARAMS, None))
    assert drafter.propose([1], [ctx], [2])[0].tokens == [50, 51]


def test_continuations_stop_at_the_end_of_their_request():
    cache = SuffixCache()
    cache.add([1, 2, 3, 4])
    cache.add([9, 9, 9, 9])
    assert cache.continuations([7, 3, 4], 5) == []  # "3 4" ends its request: nothing follows it there
    assert cache.continuations([7, 2, 3], 5) == [([4], 4.0)]  # not [4, SEPARATOR, 9, ...]
    assert cache.continuations([1, 2], 10)[0][0] == [3, 4]


def test_trees_merge_candidates_from_both_sources():
    drafter = SuffixDrafter()
    run_request(drafter, 0, [1, 2, 3, 40, 41])
    ctx = [2, 3, 30, 31, 5, 2, 3]
    drafter.add_request(DraftRequest(1, ctx, PARAMS, None))
    tree = drafter.propose([1], [ctx], [2], [4])[0]
    assert not tree.is_chain and {30, 40} <= set(tree.tokens) and len(tree) <= 4


def test_the_cache_stays_within_its_budget_and_evicts_the_oldest_requests():
    cache = SuffixCache(max_tokens=100, min_n=2, max_n=3)
    rng = random.Random(0)
    requests = [[1000 + i] + [rng.randrange(50) for _ in range(rng.randrange(3, 30))] for i in range(40)]
    assert cache.continuations(requests[0][:2], 1) == []
    cache.add(requests[0])
    assert cache.continuations(requests[0][:2], 1) == [(requests[0][2:3], 4.0)]
    for r in requests[1:]:
        cache.add(r)
        assert cache.num_tokens <= 100
    assert cache.num_requests < 40
    assert cache.continuations(requests[0][:2], 1) == []  # token 1000 exists only in the first request: evicted
    assert cache.continuations(requests[-1][:2], 1)[0][0] == requests[-1][2:3]  # the newest is kept
    latest = [2000, 2001, 2002, 2003]
    cache.add(latest)
    assert cache.continuations([2000, 2001], 2)[0][0] == [2002, 2003]
    cache.add(list(range(3000, 3500)))  # longer than the whole budget: its tail is kept
    assert cache.num_tokens <= 100 and cache.continuations([3497, 3498], 1)[0][0] == [3499]


def test_rebuilt_index_matches_a_fresh_cache_of_the_same_requests():
    rng = random.Random(1)
    requests = [[rng.randrange(6) for _ in range(rng.randrange(3, 20))] for _ in range(60)]
    cache = SuffixCache(max_tokens=120, min_n=2, max_n=4)
    for r in requests:
        cache.add(r)
    fresh = SuffixCache(max_tokens=120, min_n=2, max_n=4)
    for r in list(cache._requests):
        fresh.add(r)
    contexts = [[rng.randrange(6) for _ in range(5)] for _ in range(50)]
    for ctx in contexts:
        assert cache.continuations(ctx, 4) == fresh.continuations(ctx, 4)
    # snapshot / restore (what a benchmark does between repeats of a prompt) gives back the same index
    saved = cache.snapshot()
    for r in requests[:10]:
        cache.add(r)
    cache.restore(saved)
    assert [cache.continuations(c, 4) for c in contexts] == [fresh.continuations(c, 4) for c in contexts]


def test_concurrent_adds_and_lookups_keep_the_cache_consistent():
    cache = SuffixCache(max_tokens=500, min_n=2, max_n=3)
    errors = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                if rng.random() < 0.5:
                    cache.add([rng.randrange(20) for _ in range(rng.randrange(3, 25))])
                else:
                    for continuation, _ in cache.continuations([rng.randrange(20) for _ in range(4)], 4):
                        assert continuation and SEPARATOR not in continuation
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and cache.num_tokens <= 500


@pytest.mark.parametrize("kwargs, match", [({"max_tokens": 0}, "max_tokens"), ({"cache_max_n": 1, "cache_min_n": 2},
                                           "max_n"), ({"max_n": 0}, "max_n"), ({"colour": 1}, "unknown option")])
def test_bad_options_are_clear_errors(kwargs, match):
    target = tiny_model(seed=0, vocab=VOCAB)
    with pytest.raises(SpecdraftError, match=match):
        make_drafter("suffix", target, ToyTokenizer(VOCAB), options=kwargs)


def repeating_prompts() -> list[list[int]]:
    """A template with new inputs: requests share a long prefix and differ in a few tokens."""
    g = torch.Generator().manual_seed(3)
    template = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    return [template + torch.randint(0, VOCAB, (3,), generator=g).tolist() for _ in range(6)]


@pytest.mark.parametrize("tree", [0, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_identity_through_the_engine_and_the_cache_pays_on_repeats(tree, dtype):
    """Alone and three at a time, chains and trees: plain greedy tokens. A repeated prompt is drafted from the
    cache of its first run, so the second pass accepts more than the first."""
    target = tiny_model(seed=0, vocab=VOCAB, dtype=dtype)
    plain = Engine(target, ToyTokenizer(VOCAB), None, 0, FIXED, max_model_len=256)
    spec = Engine(target, ToyTokenizer(VOCAB), make_drafter("suffix", target, ToyTokenizer(VOCAB)), 4, FIXED,
                  max_model_len=256, max_batch=3, tree=tree)
    params = SamplingParams(temperature=0, max_tokens=30)
    prompts = repeating_prompts()
    expected = [plain.generate(ids, params).token_ids for ids in prompts]
    first = spec.generate_many(prompts, [params] * len(prompts))
    accepted_first = spec.totals.accepted
    second = [spec.generate(ids, params) for ids in prompts]
    assert [r.token_ids for r in first] == expected == [r.token_ids for r in second]
    assert spec.totals.accepted - accepted_first > accepted_first
    assert sum(r.metrics.accepted for r in second) >= 0.5 * sum(len(r.token_ids) - 1 for r in second)


def test_sampling_keeps_the_target_distribution():
    """Requests sampled one after another draft from what earlier ones produced (the same prompt, so the
    cache proposes their continuations): the first two tokens must still follow the target's law."""
    target = tiny_model(seed=0, vocab=VOCAB, layers=1)
    spec = Engine(target, ToyTokenizer(VOCAB), SuffixDrafter(min_n=1, cache_min_n=1), 1, FIXED, max_model_len=64,
                  max_batch=BATCH)
    params = SamplingParams(temperature=1.0)
    counts = sample_joint(spec, params, NUM_SAMPLES // 2)
    ok, p_value, tv = matches(counts, exact_joint(target, params))
    assert spec.totals.drafted > 0 and 0 < spec.totals.accepted < spec.totals.drafted
    assert ok, f"suffix speculative sampling differs from the target (p={p_value:.2e}, TV={tv:.4f})"
