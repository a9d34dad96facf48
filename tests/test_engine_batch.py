"""The engine core: many requests per `step`, each with its own parameters, generator and slot; what drafters
observe (tokens, accepted path, the target's hidden states); the cache-free forward for training."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import kernel_model, needs_kernels
from tiny_models import ToyTokenizer, tiny_model

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified
from specdraft.drafters.draft_model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine.adaptive import AdaptiveConfig, BatchDepthChooser
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.verify.greedy import common_prefix
from specdraft.verify.sampling import SamplingParams

FIXED = AdaptiveConfig(enabled=False)
KERNEL_VOCAB = 101

MIXED_PARAMS = [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=1.0, max_tokens=20, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=17, seed=2),
    SamplingParams(temperature=1.0, top_k=5, max_tokens=20, seed=3),
    SamplingParams(temperature=0, max_tokens=9),
    SamplingParams(temperature=1.3, max_tokens=20, seed=4),
    SamplingParams(temperature=0.8, min_p=0.1, max_tokens=20, seed=5),
    SamplingParams(temperature=0, max_tokens=20),
]


def kernel_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 7, 7, 12, 40, 7, 3, 25][:n]
    return [torch.randint(0, KERNEL_VOCAB, (length,), generator=g).tolist() for length in lengths]


@needs_kernels
@pytest.mark.parametrize("drafter", ["none", "ngram", "draft"])
def test_requests_give_the_same_tokens_alone_and_in_one_batch(drafter):
    """Eight requests with their own sampling parameters and seeds, advanced together by `step` (ragged
    drafts padded in one target forward, shared prefills, batched drafting), give each exactly the tokens
    it gets alone: bf16 rows do not depend on the batch on the fused kernels, and each request draws only
    from its own generator, in the same order."""
    target = kernel_model("llama")
    draft = kernel_model("llama", seed=1)
    tokenizer = ToyTokenizer(KERNEL_VOCAB)

    def make(batch: int) -> Engine:
        d = {"none": None, "ngram": NgramDrafter(), "draft": ModelDrafter(draft, max_len=256, max_batch=batch)}
        return Engine(target, tokenizer, d[drafter], 4 if drafter != "none" else 0, FIXED, max_model_len=256,
                      max_batch=batch)

    prompts = kernel_prompts(8)
    alone = make(1)
    expected = [alone.generate(ids, p).token_ids for ids, p in zip(prompts, MIXED_PARAMS)]
    together = make(8)
    got = [r.token_ids for r in together.generate_many(prompts, MIXED_PARAMS)]
    assert got == expected
    if drafter == "draft":
        assert together.totals.drafted > 0 and together.totals.accepted > 0
    assert together.free_slots == 8


@needs_kernels
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_prompts_reuse_the_cache_entries_of_a_shared_start_and_decode_the_same_tokens(drafter):
    """A prompt that starts like an earlier one (a system prompt, the previous turn of a conversation) copies
    those cache entries, from another request's slot or from its own slot's last request, instead of
    computing them again. Each request still gets exactly its tokens on a fresh engine, greedy or sampled
    from its seed, and its slot then holds the very cache entries (keys and values of every layer) that a
    fresh engine's prefill and decoding write."""
    target = kernel_model("gemma3", seed=8)  # sliding-window layers too
    tokenizer = ToyTokenizer(KERNEL_VOCAB)
    g = torch.Generator().manual_seed(9)
    system = torch.randint(0, KERNEL_VOCAB, (20,), generator=g).tolist()
    prompts = [system + torch.randint(0, KERNEL_VOCAB, (n,), generator=g).tolist() for n in (5, 40, 3)]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=1.0, max_tokens=10, seed=1),
              SamplingParams(temperature=0.8, top_k=5, max_tokens=9, seed=2)]

    def fresh() -> Engine:
        return Engine(target, tokenizer, NgramDrafter() if drafter == "ngram" else None, 3 if drafter == "ngram"
                      else 0, FIXED, max_model_len=256, max_batch=2)

    def entries(engine: Engine, slot: int, n: int) -> list[torch.Tensor]:
        return [c[slot, :, :n].clone() for c in (*engine.cache.k, *engine.cache.v)]

    def alone(prompt: list[int], p: SamplingParams):
        engine = fresh()
        request = engine.add_request(prompt, p)
        while not request.finished:
            engine.step([request])
        n = len(prompt) + len(request.result.token_ids) - 1  # the cache holds all but the last token
        return request.result, entries(engine, request.slot, n)

    engine = fresh()
    first = engine.add_request(prompts[0], params[0])
    engine.step([first])  # its prompt is in slot 0 now
    second = engine.add_request(prompts[1], params[1])  # slot 1: copies the system prompt from slot 0
    running = [first, second]
    while running:
        engine.step(running)
        done = [r for r in running if r.finished]
        for r in done:
            expected, expected_entries = alone(r.prompt_ids, r.params)
            assert r.result.token_ids == expected.token_ids
            n = len(r.prompt_ids) + len(r.result.token_ids) - 1
            assert all(torch.equal(a, b) for a, b in zip(entries(engine, r.slot, n), expected_entries))
        running = [r for r in running if not r.finished]
    third = engine.add_request(prompts[2], params[2])  # a freed slot: its last request's entries start alike
    while not third.finished:
        engine.step([third])
    expected, expected_entries = alone(prompts[2], params[2])
    assert third.result.token_ids == expected.token_ids
    n = len(prompts[2]) + len(third.result.token_ids) - 1
    assert all(torch.equal(a, b) for a, b in zip(entries(engine, third.slot, n), expected_entries))
    cached = [r.metrics.prompt_tokens_cached for r in (first, second, third)]
    assert cached[0] == 0 and min(cached[1:]) >= len(system), cached  # the first one had nothing to copy
    # A conversation's next turn: its prompt starts with the last turn's prompt and answer, all of it reused.
    turn = prompts[2] + third.result.token_ids + prompts[1][-6:]
    result = engine.generate(turn, params[0])
    assert result.token_ids == alone(turn, params[0])[0].token_ids
    assert result.metrics.prompt_tokens_cached == len(prompts[2]) + len(third.result.token_ids) - 1
    again = engine.generate(turn, params[0])  # all of it cached: its last token is still computed, for its logits
    assert again.token_ids == result.token_ids and again.metrics.prompt_tokens_cached == len(turn) - 1
    # What a benchmark does between repeats: back to what an earlier snapshot offered, or to nothing.
    snapshot = engine.prefix_snapshot()
    other = system + torch.randint(0, KERNEL_VOCAB, (10,), generator=g).tolist()
    offered = max(common_prefix(tokens, other) for tokens in snapshot.values())
    assert offered >= len(system)
    first_run = engine.generate(other, params[0])
    assert first_run.metrics.prompt_tokens_cached == offered
    assert engine.generate(other, params[0]).metrics.prompt_tokens_cached == len(other) - 1  # its own entries
    engine.restore_prefixes(snapshot)
    repeat = engine.generate(other, params[0])
    assert repeat.metrics.prompt_tokens_cached == offered and repeat.token_ids == first_run.token_ids
    assert repeat.token_ids == alone(other, params[0])[0].token_ids
    engine.restore_prefixes({})
    assert engine.prefix_snapshot() == {}
    assert engine.generate(turn, params[0]).metrics.prompt_tokens_cached == 0


@needs_kernels
def test_a_conversation_keeps_its_cache_entries_while_other_requests_come_and_go():
    """A new request takes a free slot whose entries all start its prompt (the longest), else the slot
    released longest ago: a conversation's next turn reuses all of its last turn although other clients'
    requests, sharing its system prompt, ran in between (taking the slot released last, or the one sharing
    the longest start, would have overwritten it), and decodes the tokens a fresh engine gives."""
    target = kernel_model("llama")
    tokenizer = ToyTokenizer(KERNEL_VOCAB)
    engine = Engine(target, tokenizer, None, 0, FIXED, max_model_len=256, max_batch=3)
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = kernel_prompts(6, seed=5)
    system = prompts[3]  # 12 tokens
    first, *others = [system + part for part in prompts[:3]]
    follow_up = prompts[5]
    turn = engine.add_request(first, params)
    while not turn.finished:
        engine.step([turn])
    for other in others:  # other clients, each on a slot of its own while the conversation waits
        assert engine.generate(other, params).metrics.prompt_tokens_cached == len(system)
    next_turn = first + turn.result.token_ids + follow_up
    request = engine.add_request(next_turn, params)
    assert request.slot == turn.slot  # its own entries, where they are: nothing to copy
    while not request.finished:
        engine.step([request])
    assert request.metrics.prompt_tokens_cached == len(first) + len(turn.result.token_ids) - 1
    assert request.result.token_ids == Engine(target, tokenizer, None, 0).generate(next_turn, params).token_ids
    assert engine.free_slots == 3


@needs_kernels
def test_continuous_batching_admits_requests_as_slots_free():
    """Three slots, eight requests: they all finish, in input order, identical to running alone."""
    target = kernel_model("qwen")
    tokenizer = ToyTokenizer(KERNEL_VOCAB)
    prompts = kernel_prompts(8, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 11, 5, 8, 1, 14, 6, 9)]
    expected = [Engine(target, tokenizer, None, 0).generate(ids, p).token_ids for ids, p in zip(prompts, params)]
    engine = Engine(target, tokenizer, NgramDrafter(), 3, max_batch=3)
    results = engine.generate_many(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert [len(r.token_ids) for r in results] == [3, 11, 5, 8, 1, 14, 6, 9]
    assert engine.free_slots == 3


def test_step_advances_each_request_and_release_frees_its_slot():
    target = tiny_model(seed=0, vocab=16)
    engine = Engine(target, ToyTokenizer(16), NgramDrafter(), 3, max_batch=2)
    a = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=30))
    b = engine.add_request([4, 5], SamplingParams(temperature=0, max_tokens=30))
    with pytest.raises(SpecdraftError, match="all 2 slots are busy"):
        engine.add_request([6], SamplingParams(temperature=0, max_tokens=4))
    chunks = engine.step([a, b])  # a's prefill: its first token at once; b's prompt waits for the next step
    assert [len(c.token_ids) for c in chunks] == [1, 0] and a.prefilled and not b.prefilled
    chunks = engine.step([a, b])  # b's prefill (the last waiting), then a's decode round
    assert len(chunks[0].token_ids) >= 1 and len(chunks[1].token_ids) == 1 and b.prefilled
    chunks = engine.step([a, b])
    assert all(len(c.token_ids) >= 1 for c in chunks)
    assert engine.cache.length(a.slot) == len(a.context) - 1  # everything but the pending token
    engine.release(b)  # a client went away: its slot serves the next request at once
    assert engine.free_slots == 1
    c = engine.add_request([6, 7], SamplingParams(temperature=0, max_tokens=4))
    engine.release(b)  # releasing twice must not free the slot c now holds
    assert engine.free_slots == 0 and c.slot == b.slot
    while not a.finished or not c.finished:
        engine.step([a, c])
    assert engine.free_slots == 2


class RecordingDrafter:
    """Proposes nothing useful; records what the engine tells it, with the target's hidden states."""

    name = "recording"

    def __init__(self, hidden_layers: tuple[int, ...]) -> None:
        self.hidden_layers = hidden_layers
        self.requests: dict[int, DraftRequest] = {}
        self.observed: list[Verified] = []

    def add_request(self, request: DraftRequest) -> None:
        self.requests[request.request_id] = request

    def propose(self, request_ids, contexts, max_ks, max_nodes=None) -> list[Proposal]:
        # The last context token repeated: sometimes right, mostly wrong.
        return [Proposal([int(ctx[-1])] * k) for ctx, k in zip(contexts, max_ks)]

    def observe(self, request_id: int, verified: Verified) -> None:
        self.observed.append(verified)

    def remove_request(self, request_id: int) -> None:
        self.requests.pop(request_id)


@pytest.mark.parametrize("path", ["pytorch-fp32", "fused-bf16"])
def test_drafters_observe_what_the_target_computed(path):
    """Every round the drafter sees the scored tokens, their positions, the accepted path and the hidden
    states it asked for, equal (up to the path's rounding) to a cache-free forward over the final context:
    they come from the verification forward itself."""
    from specdraft.runtime import cpu_kernels

    if path == "fused-bf16":
        if not cpu_kernels.available():
            pytest.skip("fused kernels unavailable (test_kernels_build_where_a_compiler_exists says why)")
        target, vocab, tolerance = kernel_model("gemma3"), KERNEL_VOCAB, 0.03
    else:
        target, vocab, tolerance = tiny_model(seed=0, vocab=16, layers=3), 16, 1e-5
    drafter = RecordingDrafter(hidden_layers=(0, 2, -1))
    engine = Engine(target, ToyTokenizer(vocab), drafter, 3, FIXED)
    prompt = [1, 2, 3, 4, 5]
    result = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=16))
    assert not drafter.requests  # removed at the end
    context = prompt + result.token_ids
    with cpu_kernels.disabled():
        reference = target.forward_sequence(torch.tensor([context]), capture_layers=(0, 2))
    want = {0: reference.captured[0, 0], 2: reference.captured[1, 0], -1: reference.hidden[0]}

    assert drafter.observed
    for verified in drafter.observed:
        n, start, accepted = len(verified.scored), verified.positions[0], len(verified.accepted)
        assert verified.positions == list(range(start, start + n))
        assert verified.scored[0] == context[start]  # the pending token
        assert verified.accepted == list(range(accepted))
        assert verified.emitted == context[start + 1:start + 2 + accepted]
        assert verified.scored[1:1 + accepted] == verified.emitted[:accepted]
        kept = verified.positions[:1 + accepted]  # rows of rejected drafts belong to no final context
        for layer in (0, 2, -1):
            assert verified.hidden[layer].shape == (n, target.config.hidden_size)
            got, expected = verified.hidden[layer][:1 + accepted].float(), want[layer][kept].float()
            assert (got - expected).abs().max() <= tolerance * expected.abs().max(), (layer, verified.positions)


def test_the_prompt_hidden_states_reach_the_drafter():
    target = tiny_model(seed=0, vocab=16, layers=3)
    seen: list[DraftRequest] = []

    class Keep(RecordingDrafter):
        def add_request(self, request: DraftRequest) -> None:
            seen.append(request)
            super().add_request(request)

    engine = Engine(target, ToyTokenizer(16), Keep(hidden_layers=(1, -1)), 2, FIXED)
    prompt = [3, 1, 4, 1, 5, 9]
    engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4))
    reference = target.forward_sequence(torch.tensor([prompt]), capture_layers=(1,))
    hidden = seen[0].prompt_hidden
    torch.testing.assert_close(hidden[1], reference.captured[0, 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[-1], reference.hidden[0], rtol=1e-4, atol=1e-4)
    assert seen[0].target_cache is engine.cache


def test_proposals_are_chains_with_parents():
    assert Proposal([5, 6, 7]).parents == [ROOT, 0, 1] and Proposal([5, 6, 7]).is_chain
    tree = Proposal([5, 6, 7], parents=[ROOT, ROOT, 0])
    assert not tree.is_chain
    with pytest.raises(ValueError, match="parent"):
        Proposal([5, 6], parents=[ROOT])
    assert Proposal([5, 6, 7]).truncated(2).tokens == [5, 6]


def test_cache_free_forward_trains_with_autograd_and_matches_the_cached_forward():
    """`forward_sequence` is what drafter training runs through: same logits as the cached forward, and
    gradients reach parameters that ask for them."""
    model = tiny_model(seed=2, vocab=16, layers=2)
    tokens = torch.tensor([[1, 5, 2, 9, 3, 3, 7]])
    cache = model.new_cache(16)
    cached = model(tokens, cache)
    model.requires_grad_(True)
    out = model.forward_sequence(tokens, capture_layers=(0,))
    torch.testing.assert_close(out.logits, cached, rtol=1e-5, atol=1e-5)
    loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], tokens[0, 1:]) + out.captured.square().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.requires_grad_(False)


def test_batch_depth_chooser_turns_drafts_off_where_the_batch_loses_by_them():
    """Simulated rounds: two requests gain from drafting 4 deep, eight lose (their padded verification costs
    more than the accepted tokens bring); each batch size settles on its own cap and re-measures the others
    rarely."""
    chooser = BatchDepthChooser(4, window=4, explore_every=8, max_wait=64)
    assert chooser.arms == [0, 1, 2, 4] and chooser.choose(1) is None  # a lone request decides alone
    assert [BatchDepthChooser.bucket(b) for b in (2, 3, 4, 5, 8, 9)] == [2, 4, 4, 8, 8, 16]

    def round_of(batch: int, cap: int) -> tuple[float, float]:
        tokens = batch * (1 + 0.6 * min(cap, 2))  # about 1.2 accepted per request at depth >= 2
        seconds = 0.02 * (1 + 0.1 * batch * cap) if batch > 4 else 0.02 * (1 + 0.05 * cap)
        return tokens, seconds

    picks = {2: [], 8: []}
    for _ in range(300):
        for batch in picks:
            cap = chooser.choose(batch)
            picks[batch].append(cap)
            chooser.update(batch, cap, *round_of(batch, cap))
    # Both start plain and climb while a longer cap is faster: the small batch up to 4 (which loses to 2),
    # the large one never past 1 (which loses to plain), so its 2 and 4 are never tried.
    assert picks[2][:4] == [0, 1, 2, 4] and picks[8][:2] == [0, 1]
    assert chooser.bandit(2).best() == 2 and chooser.bandit(8).best() == 0
    assert set(picks[8]) == {0, 1} and picks[8][150:].count(0) > 0.9 * 150  # drafting off for the large batch
    assert set(picks[2][150:]) == {1, 2, 4}  # only the best cap's neighbours are re-measured


def test_batch_depth_chooser_keeps_the_cheaper_cap_unless_a_costlier_one_wins_by_its_margin():
    """A cap that measures a few percent faster than plain (noise on a shared VM, or a gain not worth its
    risk) does not take over, and is re-measured ever more rarely; one that wins by more than the margin
    does take over."""
    def picks_with(gain: float) -> list[int]:
        chooser = BatchDepthChooser(4, window=4, explore_every=8, max_wait=64)
        picks = []
        for _ in range(300):
            cap = chooser.choose(8)
            picks.append(cap)
            chooser.update(8, cap, 8 * (1 + gain * min(cap, 1)), 0.02)  # cap 1 and above: `gain` more tokens
        return picks

    small = picks_with(0.03)
    assert small[:2] == [0, 1] and small[100:].count(1) <= 3 and set(small) == {0, 1}
    large = picks_with(0.10)
    assert large[150:].count(0) < large[150:].count(1)  # cap 1 wins (2 and 4 gain no more: not taken)


@needs_kernels
def test_greedy_requests_decode_the_same_alone_and_batched_under_adaptation():
    """With adaptation on, a batch's depth cap and each request's own controller change the drafts of every
    round, never a greedy request's tokens."""
    target = kernel_model("llama")
    tokenizer = ToyTokenizer(KERNEL_VOCAB)
    prompts = kernel_prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=30)] * 6
    plain = Engine(target, tokenizer, None, 0, max_model_len=256)
    expected = [plain.generate(ids, p).token_ids for ids, p in zip(prompts, params)]
    batched = Engine(target, tokenizer, NgramDrafter(), 4, AdaptiveConfig(), max_model_len=256, max_batch=6)
    assert [r.token_ids for r in batched.generate_many(prompts, params)] == expected
    tried = {arm for bandit in batched.batch_depths.bandits.values() for arm in bandit.tokens}
    assert batched.batch_depths.bandits and 0 in tried and tried - {0}  # caps were measured, plain among them
