"""`hybrid:ngram,B`: the n-gram lookup drafts after a long enough match, the model drafter B elsewhere. Lossless
like every drafter (greedy: plain's tokens, chains and trees; sampling: the target's law at 20,000 samples,
with a planted broken verifier caught), both sides actually draft, and B's state keeps up through the rounds
the lookup drafted."""

from __future__ import annotations

import pytest
import torch
from test_eagle import PROMPTS, random_head
from test_engine import BATCH, FIXED, NUM_SAMPLES, PROMPT, VOCAB, broken_verify_any_draft, exact_joint, matches
from test_engine import sample_joint as sample_joint_of
from tiny_models import ToyTokenizer, tiny_model

import specdraft.verify.batch as verify_batch_module
from specdraft.drafters import make_drafter, split_drafter_list
from specdraft.drafters.base import DraftRequest
from specdraft.drafters.draft_model import ModelDrafter
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.hybrid import HybridDrafter
from specdraft.drafters.ngram import NgramDrafter, NgramIndex
from specdraft.engine.adaptive import AdaptiveConfig, BatchPlanner
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.verify.sampling import SamplingParams

# Prompts that repeat themselves, so the lookup finds matches of 2+ tokens, and ones that do not.
REPEATING = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5, 6], *PROMPTS]


def engine(target, drafter=None, k=4, tree=0, max_batch=1, adaptive=FIXED, max_len=256):
    return Engine(target, ToyTokenizer(VOCAB), drafter, k, adaptive, max_model_len=max_len, max_batch=max_batch,
                  tree=tree)


def test_longest_match_is_what_lookup_continues():
    index = NgramIndex(1, 3)
    index.sync([1, 2, 3, 9, 1, 2])
    assert index.longest_match() == (2, 1)  # [1, 2] ended at position 1 before
    assert index.lookup(3) == [3, 9, 1]
    index.sync([1, 2, 3, 9, 1, 2, 8])
    assert index.longest_match() == (0, -1) and index.lookup(3) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [0, 8])
def test_greedy_identity_with_both_sides_drafting(dtype, tree):
    target = tiny_model(seed=0, vocab=VOCAB, layers=4, dtype=dtype)
    model = EagleDrafter(random_head(target), target, max_len=256, max_batch=len(REPEATING))
    hybrid = HybridDrafter(NgramDrafter(), model)
    spec = engine(target, hybrid, k=4, tree=tree, max_batch=len(REPEATING))
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [engine(target).generate(p, params).token_ids for p in REPEATING]
    assert [r.token_ids for r in spec.generate_many(REPEATING, [params] * len(REPEATING))] == expected
    assert hybrid.rounds["lookup"] > 0 and hybrid.rounds["model"] > 0
    assert spec.totals.accepted > 0


def test_the_model_side_keeps_up_through_rounds_the_lookup_drafted(monkeypatch):
    """EAGLE checks every proposal against a fresh head fed the whole context (test_eagle's check): features
    of tokens the lookup's drafts brought in must be the ones it sees. (Every request drafts what its
    controller wants: the batch's plan would leave a random head's drafts out.)"""
    from test_eagle import CheckedEagleDrafter
    monkeypatch.setattr(BatchPlanner, "plan", lambda self, alphas, depths, context=0: list(depths))

    target = tiny_model(seed=0, vocab=VOCAB, layers=4)
    model = CheckedEagleDrafter(random_head(target), target, max_len=256, max_batch=len(REPEATING))
    hybrid = HybridDrafter(NgramDrafter(), model)
    spec = engine(target, hybrid, k=3, max_batch=len(REPEATING), adaptive=AdaptiveConfig(reprobe_after=2))
    CheckedEagleDrafter.checked = 0
    spec.generate_many(REPEATING, [SamplingParams(temperature=0, max_tokens=40)] * len(REPEATING))
    assert CheckedEagleDrafter.checked > 5 and hybrid.rounds["lookup"] > 0


def hybrid_sampling_engine(target, draft):
    """min_match 1: the round after the prompt [3, 7, 1] goes to the lookup when the first sampled token
    occurred in the prompt and to the draft model otherwise, so one distribution test covers both."""
    hybrid = HybridDrafter(NgramDrafter(), ModelDrafter(draft, max_len=64, max_batch=BATCH), min_match=1)
    return engine(target, hybrid, k=1, max_len=64, max_batch=BATCH), hybrid


@pytest.fixture(scope="module")
def small_pair():
    return tiny_model(seed=0, vocab=VOCAB, layers=1), tiny_model(seed=1, vocab=VOCAB, layers=1)


def test_sampled_distribution_matches_the_target(small_pair):
    target, draft = small_pair
    params = SamplingParams(temperature=1.0)
    spec, hybrid = hybrid_sampling_engine(target, draft)
    ok, p_value, tv = matches(sample_joint_of(spec, params, NUM_SAMPLES), exact_joint(target, params))
    assert hybrid.rounds["lookup"] > 1000 and hybrid.rounds["model"] > 1000
    assert 0 < spec.totals.accepted < spec.totals.drafted
    assert ok, f"hybrid speculative sampling differs from the target (p={p_value:.2e}, TV={tv:.4f})"
    assert PROMPT == [3, 7, 1]


def test_distribution_test_catches_a_broken_verifier(small_pair, monkeypatch):
    target, draft = small_pair
    monkeypatch.setattr(verify_batch_module, "rejection_verify", broken_verify_any_draft)
    params = SamplingParams(temperature=1.0)
    spec, _ = hybrid_sampling_engine(target, draft)
    ok, p_value, tv = matches(sample_joint_of(spec, params, NUM_SAMPLES // 4), exact_joint(target, params))
    assert not ok and p_value < 1e-6, f"broken verifier not caught (p={p_value:.2e}, TV={tv:.4f})"


def test_hybrid_specs_and_bad_ones():
    target = tiny_model(seed=0, vocab=VOCAB, layers=4)
    tok = ToyTokenizer(VOCAB)
    drafter = make_drafter("hybrid:ngram,self:2", target, tok, options={"min_match": 3})
    assert isinstance(drafter, HybridDrafter) and drafter.min_match == 3 and drafter.name == "hybrid:ngram,self:2"
    assert make_drafter("hybrid:ngram:4,self:2", target, tok).lookup.max_n == 4
    assert split_drafter_list("plain,hybrid:ngram,eagle+tree8,ngram") == ["plain", "hybrid:ngram,eagle+tree8",
                                                                          "ngram"]
    for bad in ("hybrid:ngram", "hybrid:eagle,ngram", "hybrid:ngram,ngram", "hybrid:ngram,suffix"):
        with pytest.raises(SpecdraftError, match="hybrid"):
            make_drafter(bad, target, tok)
    with pytest.raises(SpecdraftError, match="min_match"):
        make_drafter("hybrid:ngram,self:2", target, tok, options={"min_match": 0})
    with pytest.raises(SpecdraftError, match="min_match"):
        make_drafter("hybrid:ngram,self:2", target, tok, options={"min_match": 5})  # beyond max_n 3


def test_every_request_is_observed_by_both_sides():
    target = tiny_model(seed=0, vocab=VOCAB, layers=4)
    hybrid = HybridDrafter(NgramDrafter(), ModelDrafter(tiny_model(seed=1, vocab=VOCAB, layers=1), max_len=64))
    hybrid.add_request(DraftRequest(7, [1, 2, 1, 2], SamplingParams(temperature=0), None))
    assert hybrid.lookup.match_length(7, [1, 2, 1, 2]) == 2
    (proposal,) = hybrid.propose([7], [[1, 2, 1, 2]], [3])
    assert proposal.tokens == [1, 2] and hybrid.rounds == {"lookup": 1, "model": 0}
    hybrid.remove_request(7)
    with pytest.raises(KeyError):
        hybrid.lookup.match_length(7, [1])
    assert target is not None
