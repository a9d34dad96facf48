"""Logprobs of generated tokens: the target's raw distribution at each emitted position, the same with
speculation (chains, trees, batches, rejections) as without it."""

from __future__ import annotations

import math

import pytest
import torch
from test_cpu_kernels import kernel_model, needs_kernels
from test_engine import FIXED, OracleDrafter, engine, prompts
from tiny_models import ToyTokenizer, tiny_model

from specdraft.drafters.base import Proposal
from specdraft.drafters.draft_model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine import core
from specdraft.engine.core import Engine
from specdraft.runtime import cpu_kernels
from specdraft.verify.logprobs import MAX_LOGPROBS, TokenLogprobs, position_logprobs
from specdraft.verify.sampling import InvalidParameterError, SamplingParams

VOCAB = 16


def test_position_logprobs_are_log_softmax_with_ranks_and_the_most_likely_first():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g) * 3
    tokens = [3, 0, 39, 7, 7]
    got = position_logprobs(logits.to(torch.bfloat16), tokens, 4)
    reference = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
    for row, (token, entry) in enumerate(zip(tokens, got, strict=True)):
        assert entry.token_id == token and entry.logprob == pytest.approx(reference[row, token].item(), abs=1e-6)
        assert entry.rank == 1 + int((reference[row] > reference[row, token]).sum())
        order = reference[row].argsort(descending=True)[:4].tolist()
        assert [t for t, _ in entry.top] == order
        assert [v for _, v in entry.top] == pytest.approx(reference[row, order].tolist(), abs=1e-6)
    assert all(entry.top == () for entry in position_logprobs(logits, tokens, 0))
    assert position_logprobs(logits[:0], [], 3) == []
    with pytest.raises(ValueError, match="one row per token"):
        position_logprobs(logits, tokens[:2], 1)
    with pytest.raises(ValueError, match="top"):
        position_logprobs(logits, tokens, MAX_LOGPROBS + 1)


def test_a_positions_alternatives_list_the_chosen_token_first_and_each_token_once():
    chosen_in_top = TokenLogprobs(7, -1.5, 2, ((3, -0.5), (7, -1.5), (9, -2.0)))
    assert chosen_in_top.ranked() == [(7, -1.5, 2), (3, -0.5, 1), (9, -2.0, 3)]
    unlikely = TokenLogprobs(5, -9.0, 40, ((3, -0.5),))
    assert unlikely.ranked() == [(5, -9.0, 40), (3, -0.5, 1)]
    assert TokenLogprobs(5, -9.0, 40).ranked() == [(5, -9.0, 40)]


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.5, "2"])
def test_nonsense_logprobs_are_refused(value):
    with pytest.raises(InvalidParameterError, match="logprobs"):
        SamplingParams(logprobs=value)


def prefix_reference(model, prompt: list[int], tokens: list[int], top: int) -> list[TokenLogprobs]:
    """The tokens' logprobs from one forward over the whole sequence in a fresh cache (a different code path
    from the decode rounds that produced them)."""
    sequence = prompt + tokens
    logits = model(torch.tensor([sequence[:-1]]), model.new_cache(len(sequence), 1), slots=[0],
                   logits_from=len(prompt) - 1)
    return position_logprobs(logits[0], tokens, top)


def assert_same_logprobs(got: list[TokenLogprobs], expected: list[TokenLogprobs], tokens: list[int],
                         exact: bool) -> None:
    """Entry for entry; bit for bit where the rows are row-invariant (the fused kernels in bf16), else to fp32
    rounding (the torch path may sum a block's rows in another order)."""
    assert [e.token_id for e in got] == tokens == [e.token_id for e in expected]
    if exact:
        assert got == expected
        return
    for a, b in zip(got, expected, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def drafters(target, draft):
    return {"ngram": (lambda: NgramDrafter(), 0), "draft": (lambda: ModelDrafter(draft, max_len=256), 0),
            "draft tree": (lambda: ModelDrafter(draft, max_len=256), 6)}


@pytest.mark.parametrize("name", ["ngram", "draft", "draft tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_logprobs_with_speculation_equal_plain_decoding(name, dtype):
    target, draft = tiny_model(seed=0, vocab=VOCAB, dtype=dtype), tiny_model(seed=1, vocab=VOCAB, dtype=dtype)
    make, tree = drafters(target, draft)[name]
    spec = Engine(target, ToyTokenizer(VOCAB), make(), 4, FIXED, max_model_len=256, tree=tree)
    plain = engine(target)
    exact = dtype == torch.bfloat16 and cpu_kernels.available()
    for ids in prompts(4):
        params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
        expected = plain.generate(ids, params)
        got = spec.generate(ids, params)
        assert_same_logprobs(got.logprobs, expected.logprobs, expected.token_ids, exact)
        assert all(e.rank == 1 and e.top[0] == (e.token_id, e.logprob) for e in got.logprobs)  # greedy: the top
    assert spec.totals.accepted > 0, "nothing was accepted: the test would not see a draft token's row"
    if dtype == torch.float32:  # and against another code path: the prompt forward's last row
        ids = prompts(1)[0]
        got = spec.generate(ids, SamplingParams(temperature=0, max_tokens=12, logprobs=2))
        assert_same_logprobs(got.logprobs, prefix_reference(target, ids, got.token_ids, 2), got.token_ids, False)


@pytest.mark.parametrize("tree", [0, 6])
def test_sampled_tokens_get_the_logprobs_of_the_row_they_were_chosen_from(tree):
    """With rejections, corrections and (tree) accepted side branches, each token's logprobs are the target's
    at the position it was emitted at, whichever row of the block verified it."""
    target, draft = tiny_model(seed=0, vocab=VOCAB), tiny_model(seed=1, vocab=VOCAB)
    spec = Engine(target, ToyTokenizer(VOCAB), ModelDrafter(draft, max_len=256), 4, FIXED, max_model_len=256,
                  tree=tree)
    for seed, ids in enumerate(prompts(3, seed=1)):
        got = spec.generate(ids, SamplingParams(temperature=1.0, seed=seed, max_tokens=20, logprobs=2))
        assert len(got.logprobs) == len(got.token_ids) == 20
        assert_same_logprobs(got.logprobs, prefix_reference(target, ids, got.token_ids, 2), got.token_ids, False)
    m = spec.totals
    assert 0 < m.accepted < m.drafted, "the drafts were all accepted or all rejected: a wrong row could pass"


def test_logprobs_stop_with_the_tokens_and_batched_requests_get_their_own():
    target = tiny_model(seed=0, vocab=VOCAB)
    ids = [3, 1, 4]
    plain = engine(target).generate(ids, SamplingParams(temperature=0, max_tokens=30, logprobs=1))
    # A stop string and max_tokens inside an accepted block: one logprob per token kept, none past them.
    oracle = engine(target, OracleDrafter(3, plain.token_ids), k=5)
    stop = plain.text[5:7]
    cut = oracle.generate(ids, SamplingParams(temperature=0, max_tokens=30, stop=[stop], logprobs=1))
    assert cut.finish_reason == "stop" and len(cut.token_ids) < 30
    assert_same_logprobs(cut.logprobs, plain.logprobs[:len(cut.token_ids)], cut.token_ids, False)
    short = oracle.generate(ids, SamplingParams(temperature=0, max_tokens=7, logprobs=1))
    assert_same_logprobs(short.logprobs, plain.logprobs[:7], short.token_ids, False)
    # A batch mixing requests with and without logprobs, and with different counts.
    batched = engine(target, NgramDrafter(), k=3, max_batch=4)
    all_params = [SamplingParams(temperature=0, max_tokens=16, logprobs=n) for n in (None, 0, 2, 5)]
    batch_prompts = prompts(4, seed=2)
    results = batched.generate_many(batch_prompts, all_params)
    assert results[0].logprobs is None
    for prompt, params, result in zip(batch_prompts[1:], all_params[1:], results[1:], strict=True):
        alone = engine(target).generate(prompt, params)
        assert_same_logprobs(result.logprobs, alone.logprobs, alone.token_ids, False)
        assert all(len(e.top) == params.logprobs for e in result.logprobs)
    assert all(math.isfinite(e.logprob) and e.logprob <= 0 for r in results[1:] for e in r.logprobs)


def test_streamed_chunks_carry_the_logprobs_of_their_tokens():
    target = tiny_model(seed=0, vocab=VOCAB)
    spec = engine(target, NgramDrafter(), k=3)
    params = SamplingParams(temperature=0, max_tokens=25, logprobs=1)
    chunks = list(spec.stream([1, 2, 1, 2, 1, 2], params))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [e for c in chunks for e in c.logprobs] == chunks[-1].result.logprobs
    assert [e.token_id for e in chunks[-1].result.logprobs] == chunks[-1].result.token_ids
    assert all(c.logprobs is None for c in engine(target).stream([1, 2], SamplingParams(max_tokens=3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_logprobs_are_every_prompt_rows(dtype):
    """`prompt_logprobs`: None for the first prompt token, then each one's from the prompt's own forward, the
    same asked again, and whether the prompt ran alone or beside another of its length in one forward."""
    target = tiny_model(seed=0, vocab=VOCAB, dtype=dtype)
    spec = engine(target, NgramDrafter(), k=3, max_batch=2)
    exact = dtype == torch.bfloat16 and cpu_kernels.available()
    g = torch.Generator().manual_seed(3)
    for length in (9, 200):  # one forward; chunked prefill (blocks of 128)
        prompt = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=2)
        first = spec.generate(prompt, params)
        reference = prefix_reference(target, prompt[:1], prompt[1:] + first.token_ids, 2)
        assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == length
        assert_same_logprobs(first.prompt_logprobs[1:], reference[:length - 1], prompt[1:], exact)
        again = spec.generate(prompt, params)  # the slot still holds the prompt's entries
        assert again.prompt_logprobs == first.prompt_logprobs and again.metrics.prompt_tokens_cached == 0
        assert spec.generate(prompt, SamplingParams(temperature=0, max_tokens=4)).prompt_logprobs is None
    twin = [(t + 1) % VOCAB for t in prompt[:9]]
    together = spec.generate_many([prompt[:9], twin], [SamplingParams(temperature=0, max_tokens=2),
                                                       SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)])
    assert together[0].prompt_logprobs is None
    alone = engine(target).generate(twin, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert_same_logprobs(together[1].prompt_logprobs[1:], alone.prompt_logprobs[1:], twin[1:], exact)


@needs_kernels
def test_a_scored_prompt_reuses_no_cached_prefix():
    """Where a prompt's start could be copied from a slot (the fused kernels), a prompt asking for its logprobs
    is computed whole: the copied rows would have no logits."""
    target = kernel_model("llama")
    vocab = target.config.vocab_size
    eng = Engine(target, ToyTokenizer(vocab), None, 0, FIXED, max_model_len=256)
    prompt = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=3)
    eng.generate(prompt, params)
    assert eng.generate(prompt, params).metrics.prompt_tokens_cached == 19  # reuse is on here
    scored = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    fresh = Engine(target, ToyTokenizer(vocab), None, 0, FIXED, max_model_len=256).generate(
        prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    assert scored.metrics.prompt_tokens_cached == 0 and len(scored.prompt_logprobs) == 20
    assert scored.prompt_logprobs == fresh.prompt_logprobs


class HiddenSpy(OracleDrafter):
    """Proposes nothing; keeps the target's prompt hidden states it is given (final-normed and layer 1)."""

    hidden_layers = (-1, 1)

    def __init__(self) -> None:
        super().__init__(0, [])
        self.prompt_hidden: dict[int, torch.Tensor] = {}

    def add_request(self, request) -> None:
        self.prompt_hidden = request.prompt_hidden

    def propose(self, request_ids, contexts, max_ks, max_nodes=None):
        return [Proposal([]) for _ in request_ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_scored_prompt_goes_through_the_output_layer_in_blocks(dtype, monkeypatch):
    """With PROMPT_LOGITS_BYTES this small a block is one prefill chunk (128 rows): a 200-token prompt's
    logprobs, first tokens and the drafter's hidden states are those of one forward (bit for bit on the fused
    kernels, which run a prompt in those chunks anyway), and no forward computes more than 128 rows' logits."""
    target = tiny_model(seed=0, vocab=VOCAB, dtype=dtype)
    exact = dtype == torch.bfloat16 and cpu_kernels.available()
    prompt = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, logprobs=1)
    whole_spy = HiddenSpy()
    whole = engine(target, whole_spy, k=2, max_len=256).generate(prompt, params)
    monkeypatch.setattr(core, "PROMPT_LOGITS_BYTES", 1)
    spy = HiddenSpy()
    blocked = engine(target, spy, k=2, max_len=256)
    widths = []
    score = blocked._score
    blocked._score = lambda rows, *args, **kwargs: widths.append(len(rows[0])) or score(rows, *args, **kwargs)
    got = blocked.generate(prompt, params)
    assert widths[:2] == [128, 72] and max(widths) == 128
    assert got.token_ids == whole.token_ids and len(got.prompt_logprobs) == 200
    assert got.prompt_logprobs[0] is None
    assert_same_logprobs(got.prompt_logprobs[1:], whole.prompt_logprobs[1:], prompt[1:], exact)
    assert_same_logprobs(got.logprobs, whole.logprobs, got.token_ids, exact)
    assert set(spy.prompt_hidden) == {-1, 1}
    for layer, states in whole_spy.prompt_hidden.items():
        assert spy.prompt_hidden[layer].shape == (200, states.shape[-1])
        assert torch.equal(spy.prompt_hidden[layer], states) if exact else torch.allclose(
            spy.prompt_hidden[layer], states, atol=1e-4)


def test_asking_for_logprobs_changes_no_token():
    """Scoring draws nothing from a request's generator and moves no row: the same seeded tokens with logprobs
    as without, plain and speculative."""
    target, draft = tiny_model(seed=0, vocab=VOCAB), tiny_model(seed=1, vocab=VOCAB)
    for make in (lambda: engine(target), lambda: engine(target, ModelDrafter(draft, max_len=256), k=4)):
        for ids in prompts(3, seed=5):
            params = SamplingParams(temperature=0.8, seed=11, max_tokens=20)
            bare = make().generate(ids, params)
            scored = make().generate(ids, SamplingParams(temperature=0.8, seed=11, max_tokens=20, logprobs=3,
                                                         prompt_logprobs=1))
            assert scored.token_ids == bare.token_ids and bare.logprobs is None and len(scored.logprobs) == 20
