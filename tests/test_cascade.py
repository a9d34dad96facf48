"""Cascades (`cascade:A,B`): the draft model B checks guesses of its own continuation several per forward, from
n-gram lookup or from a cheaper draft model A. Its chains must be exactly what it drafts alone (greedy: the
same tokens; sampling: the same law, tested statistically, with a planted bug the test must catch), for
fewer draft forwards."""

from __future__ import annotations

import pytest
import torch
from test_engine import FIXED, NUM_SAMPLES, VOCAB, matches
from tiny_models import ToyTokenizer, tiny_model

import specdraft.drafters.draft_model as draft_model_module
from specdraft.drafters import make_drafter, split_drafter_list
from specdraft.drafters.base import DraftRequest
from specdraft.drafters.draft_model import ModelDrafter, ModelGuesser
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.verify.sampling import SamplingParams, logits_to_probs

BATCH = 64


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(seed=1, vocab=VOCAB)


def count_forwards(model) -> list[int]:
    """Counts the model's forwards (instance attribute: nn.Module's __call__ finds it first)."""
    calls = [0]
    forward = type(model).forward.__get__(model)

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    model.forward = counted
    return calls


@pytest.mark.parametrize("first", ["ngram", "model"])
def test_greedy_cascade_drafts_the_same_chains_in_fewer_forwards(target, first):
    params = SamplingParams(temperature=0, max_tokens=60)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 9, 5, 9, 5], [14, 3, 3, 7, 11, 2]]
    expected = [Engine(target, ToyTokenizer(VOCAB), None, 0).generate(p, params).token_ids for p in prompts]
    # A model first stage: a copy of the same weights, so its greedy guesses are the draft's own choices.
    first_stage = (NgramDrafter() if first == "ngram"
                   else ModelGuesser(ModelDrafter(tiny_model(seed=0, vocab=VOCAB), max_len=256)))
    runs = {}
    for name, guesser in (("alone", None), ("cascade", first_stage)):
        # The target's own weights (their own copy: the forward counter is per model): greedy drafts then
        # follow the target's output, which falls into the loops the n-gram guesses catch.
        draft = tiny_model(seed=0, vocab=VOCAB)
        forwards = count_forwards(draft)
        spec = Engine(target, ToyTokenizer(VOCAB), ModelDrafter(draft, max_len=256, guesser=guesser), 5, FIXED,
                      max_model_len=256)
        assert [spec.generate(p, params).token_ids for p in prompts] == expected
        runs[name] = (spec.totals.drafted, spec.totals.accepted, forwards[0])
    # The same proposals (so the same acceptance), for fewer draft forwards.
    assert runs["cascade"][:2] == runs["alone"][:2] and runs["alone"][1] > 0.9 * runs["alone"][0] > 50
    assert runs["cascade"][2] < 0.8 * runs["alone"][2], runs


def exact_chain_law(model, context: list[int], params: SamplingParams) -> torch.Tensor:
    """P(d1, d2 | context) under the draft's own autoregressive sampling: [VOCAB * VOCAB]."""
    cache = model.new_cache(len(context) + 2, num_slots=VOCAB)
    logits = model(torch.tensor([context + [t] for t in range(VOCAB)]), cache)
    first = logits_to_probs(logits[0, len(context) - 1], params)
    second = logits_to_probs(logits[:, -1], params)
    return (first[:, None] * second).flatten()


def guessed_context(model, params: SamplingParams) -> list[int]:
    """A context whose n-gram guess for the next token has a draft probability near 1/2, so that chains go
    through both a confirmed guess and a refuted one about equally often."""
    g = torch.Generator().manual_seed(7)
    best, best_score = None, -1.0
    for _ in range(300):
        a, b, c = torch.randint(0, VOCAB, (3,), generator=g).tolist()
        context = [a, b, c, a]  # the guess after 'a' is 'b'
        if len({a, b, c}) < 3:
            continue
        p = float(exact_chain_law(model, context, params).reshape(VOCAB, VOCAB)[b].sum())
        if min(p, 1 - p) > best_score:
            best, best_score = context, min(p, 1 - p)
    assert best_score > 0.2
    return best


def sample_chains(drafter: ModelDrafter, context: list[int], params: SamplingParams, n: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB * VOCAB)
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(99)).tolist()
    for start in range(0, n, BATCH):
        ids = list(range(start, min(n, start + BATCH)))
        for i in ids:
            drafter.add_request(DraftRequest(i, context, params, torch.Generator().manual_seed(seeds[i])))
        for proposal in drafter.propose(ids, [context] * len(ids), [2] * len(ids)):
            a, b = proposal.tokens
            counts[a * VOCAB + b] += 1
            assert proposal.draft_probs.shape == (2, VOCAB)
        for i in ids:
            drafter.remove_request(i)
    return counts


def test_sampled_cascade_chains_with_a_model_first_stage_follow_the_drafts_own_law(draft):
    """As below, the guesses coming from a draft model (a copy of the draft's weights, guessing greedily: the
    draft's sampled token confirms the guess with the probability of its most likely token)."""
    params = SamplingParams(temperature=1.0)
    context = guessed_context(draft, params)
    guesser = ModelGuesser(ModelDrafter(tiny_model(seed=1, vocab=VOCAB), max_len=64, max_batch=BATCH))
    guesses = []
    guess = guesser.guess
    guesser.guess = lambda *args: guesses.append(guess(*args)) or guesses[-1]
    drafter = ModelDrafter(draft, max_len=64, max_batch=BATCH, guesser=guesser)
    samples = NUM_SAMPLES // 2
    ok, p_value, tv = matches(sample_chains(drafter, context, params, samples), exact_chain_law(draft, context, params))
    assert sum(1 for g in guesses if g) >= samples  # every chain's first step checked a guess
    assert ok, f"cascade chains with a model guesser differ from the draft's law (p={p_value:.2e}, TV={tv:.4f})"


@pytest.mark.parametrize("broken", [False, True])
def test_sampled_cascade_chains_follow_the_drafts_own_law(draft, monkeypatch, broken):
    """20,000 two-token chains from one context: the joint law is the draft's own. The planted bug keeps
    drafting from the position after a guess that the draft's token refuted."""
    if broken:
        monkeypatch.setattr(draft_model_module, "guess_holds", lambda guess, position, token: position < len(guess))
    params = SamplingParams(temperature=1.0)
    context = guessed_context(draft, params)
    guesser = NgramDrafter()
    guesses = []
    guess = guesser.guess
    guesser.guess = lambda *args: guesses.append(guess(*args)) or guesses[-1]
    drafter = ModelDrafter(draft, max_len=64, max_batch=BATCH, guesser=guesser)
    samples = NUM_SAMPLES // 4 if broken else NUM_SAMPLES
    ok, p_value, tv = matches(sample_chains(drafter, context, params, samples), exact_chain_law(draft, context, params))
    assert sum(1 for g in guesses if g == [context[1]]) >= samples // BATCH  # every first step checked a guess
    if broken:
        assert not ok and p_value < 1e-6, f"planted bug not caught (p={p_value:.2e}, TV={tv:.4f})"
    else:
        assert ok, f"cascade chains differ from the draft's law (p={p_value:.2e}, TV={tv:.4f})"


def test_guess_continues_uncommitted_tokens_from_the_committed_index():
    ngram = NgramDrafter(max_n=2)
    ngram.add_request(DraftRequest(0, [1, 2, 3, 4, 1, 2], SamplingParams(temperature=0), None))
    assert ngram.guess(0, [1, 2, 3, 4, 1, 2], [], 3) == [3, 4, 1]
    # After drafted tokens [3, 4] (not in the index): the suffix (4) is looked up, continuing with 1, 2.
    assert ngram.guess(0, [1, 2, 3, 4, 1, 2], [3, 4], 2) == [1, 2]
    assert ngram.guess(0, [1, 2, 3, 4, 1, 2], [9], 2) == []
    assert ngram._indexes[0].tokens == [1, 2, 3, 4, 1, 2]  # nothing uncommitted was indexed


def test_cascade_specs():
    assert split_drafter_list("plain,cascade:ngram,quant:int8, ngram") == ["plain", "cascade:ngram,quant:int8", "ngram"]
    assert split_drafter_list("cascade:ngram,self:4+tree8@gguf") == ["cascade:ngram,self:4+tree8@gguf"]
    target = tiny_model(seed=0, vocab=VOCAB)
    drafter = make_drafter("cascade:ngram:4,self:1", target, ToyTokenizer(VOCAB), max_len=64)
    assert isinstance(drafter, ModelDrafter) and drafter.guesser.max_n == 4
    assert drafter.name == "cascade:ngram:4,self:1"
    drafter = make_drafter("cascade:quant:int4,quant:int8", target, ToyTokenizer(VOCAB), max_len=64)
    assert isinstance(drafter.guesser, ModelGuesser) and drafter.guesser.model.name != drafter.name
    for bad, match in (("cascade:self:1", "a cascade is"), ("cascade:suffix,self:1", "first stage"),
                       ("cascade:ngram,ngram", "second stage"), ("cascade:ngram,", "a cascade is"),
                       ("cascade:recycle,quant:int8", "first stage")):
        with pytest.raises(SpecdraftError, match=match):
            make_drafter(bad, target, ToyTokenizer(VOCAB), max_len=64)
