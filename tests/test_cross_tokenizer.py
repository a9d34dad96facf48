"""Cross-tokenizer drafting (`draft:REF` with another vocabulary): the text boundary cases, and lossless
output (greedy identical to plain, sampling matching the target's distribution) through the whole engine."""

from __future__ import annotations

import pytest
import torch
from test_engine import (
    BATCH,
    FIXED,
    NUM_SAMPLES,
    VOCAB,
    assert_law_or_caught,
    broken_verify_any_draft,
    exact_joint,
    matches,
    sample_joint,
)
from tiny_models import ToyTokenizer, tiny_model

import specdraft.verify.batch as verify_batch_module
from specdraft.drafters.base import DraftRequest, Proposal
from specdraft.drafters.cross_tokenizer import (
    CrossTokenizerDrafter,
    continuation_text,
    special_ids,
    target_continuation,
    word_boundary,
)
from specdraft.drafters.draft_model import ModelDrafter, tokenizers_match
from specdraft.engine.core import Engine
from specdraft.verify.greedy import common_prefix
from specdraft.verify.sampling import SamplingParams


class PairTokenizer:
    """A draft vocabulary unlike the target's letters: ids 0-15 are the letters in reverse order, 16-23 the
    pairs 'ab', 'cd', ... 'op' (encoded greedily, longest first), 24 an end-of-text special token."""

    PAIRS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
    EOS = 24

    def __init__(self) -> None:
        self.eos_token_ids = frozenset({self.EOS})
        self.has_chat_template = False

    def piece(self, i: int) -> str:
        return chr(97 + 15 - i) if i < 16 else self.PAIRS[i - 16] if i < 24 else ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text[i:i + 2] in self.PAIRS:
                ids.append(16 + self.PAIRS.index(text[i:i + 2]))
                i += 2
            else:
                ids.append(15 - (ord(text[i]) - 97))
                i += 1
        return ids

    def decode(self, ids) -> str:
        return "".join(self.piece(int(i)) for i in ids)


DRAFT_VOCAB = 25


def toy_drafter(draft_model, max_batch: int = 1, max_len: int = 256) -> CrossTokenizerDrafter:
    return CrossTokenizerDrafter(ModelDrafter(draft_model, max_len=max_len, max_batch=max_batch), PairTokenizer(),
                                 ToyTokenizer(VOCAB), name="draft:pairs")


def engine(target, drafter=None, k=4, max_batch=1, max_len=256, tree=0):
    return Engine(target, ToyTokenizer(VOCAB), drafter, k, FIXED, max_model_len=max_len, max_batch=max_batch,
                  tree=tree)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=VOCAB)


@pytest.fixture(scope="module")
def pair_draft():
    return tiny_model(seed=1, vocab=DRAFT_VOCAB)


# ------------------------------------------------------------------------------------ the text boundary


def test_word_boundary_keeps_the_unfinished_word_with_its_space():
    assert word_boundary("Hello wor") == 5
    assert word_boundary("Hello world\n\nNext") == 11
    assert word_boundary("Hello ") == 5  # trailing whitespace may still join the next word
    assert word_boundary("Hello") == 0 and word_boundary("") == 0 and word_boundary("  x") == 0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2


def test_a_word_the_target_started_is_completed_in_its_own_tokens(gemma_tokenizer):
    """The target committed '▁hel'; the draft wrote 'lo world'. Encoding ' hello world' would give '▁hello',
    which cannot follow '▁hel': the text is encoded on its own, and context + proposal reads right."""
    tok = gemma_tokenizer
    context = tok.encode("I say", add_special_tokens=False) + [tok.hf.convert_tokens_to_ids("▁hel")]
    assert tok.decode(context) == "I say hel"
    tokens = target_continuation(tok, context, "lo world")
    assert tok.decode(context + tokens) == "I say hello world"
    assert tokens == tok.encode("lo world", add_special_tokens=False)


def test_a_new_word_is_split_as_the_target_splits_it_after_its_context(smollm2_tokenizer):
    tok = smollm2_tokenizer
    context = tok.encode("The cat sat on the", add_special_tokens=False)
    tokens = target_continuation(tok, context, " mat, and then")
    assert tokens == tok.encode("The cat sat on the mat, and then", add_special_tokens=False)[len(context):]


def test_byte_tokens_pass_only_as_whole_characters(smollm2_tokenizer):
    """SmolLM2 spells an emoji in two byte-level tokens: the first alone is no character yet."""
    tok = smollm2_tokenizer
    ids = tok.encode(" ok 😀 fine", add_special_tokens=False)
    emoji_start = next(i for i in range(len(ids)) if "\ufffd" in tok.decode(ids[:i + 1]))
    window = tok.encode("Say", add_special_tokens=False)
    assert continuation_text(tok, window, ids[:emoji_start + 1]) == " ok "
    assert continuation_text(tok, window, ids) == " ok 😀 fine"


def test_special_tokens(smollm2_tokenizer, gemma_tokenizer):
    for tok in (smollm2_tokenizer, gemma_tokenizer):
        special = special_ids(tok)
        assert tok.eos_token_ids <= special and not {tok.encode(" the", add_special_tokens=False)[0]} & special
    im_start = smollm2_tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert im_start in special_ids(smollm2_tokenizer)
    assert not tokenizers_match(smollm2_tokenizer, gemma_tokenizer)
    assert tokenizers_match(smollm2_tokenizer, smollm2_tokenizer)


def test_the_draft_sees_the_targets_text_without_its_special_tokens(smollm2_tokenizer, gemma_tokenizer):
    """Chat markers of the target are not text the draft should read; the draft gets its own BOS."""

    class Recorder:
        def add_request(self, request):
            self.prompt = request.prompt_ids

    recorder = Recorder()
    drafter = CrossTokenizerDrafter(recorder, gemma_tokenizer, smollm2_tokenizer)
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    drafter.add_request(DraftRequest(0, prompt, SamplingParams(temperature=0.0), None))
    assert recorder.prompt[0] == gemma_tokenizer.hf.bos_token_id
    text = gemma_tokenizer.decode(recorder.prompt)
    assert "Name a colour." in text and "<|im_start|>" not in text


def test_a_draft_special_token_ends_the_draft_and_keeps_the_last_word(target, pair_draft):
    drafter = toy_drafter(pair_draft)
    # Draft text 'ab' then end of text: the word is complete, so no target token is dropped.
    assert drafter._to_target([3, 7], [5], [16, PairTokenizer.EOS, 20]) == [0, 1]
    # The same text without an end: the last target token may be half a word and is dropped.
    assert drafter._to_target([3, 7], [5], [16]) == [0]


def test_text_without_spaces_is_re_encoded_a_bounded_tail_at_a_time(pair_draft):
    """Letters never contain a word boundary; the text re-encoded each round stays bounded anyway, and the
    draft context still spells the whole text."""
    from specdraft.drafters.cross_tokenizer import MAX_PENDING

    drafter = toy_drafter(pair_draft, max_len=1024)
    context = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    drafter.add_request(DraftRequest(0, context[:10], SamplingParams(temperature=0.0), None))
    state = drafter._states[0]
    for end in range(20, 401, 20):
        drafter._advance(state, context[:end])
        assert len(state.pending) <= MAX_PENDING
        assert PairTokenizer().decode(drafter._draft_context(state)) == ToyTokenizer(VOCAB).decode(context[:end])


# ------------------------------------------------------------------------------------- lossless output


@pytest.mark.parametrize("tree", [0, 8])
def test_greedy_output_is_identical_to_plain(target, pair_draft, tree):
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = engine(target)
    spec = engine(target, toy_drafter(pair_draft, max_batch=3), k=4, max_batch=3, tree=tree)
    prompts = [[1, 2], [5, 5, 9, 0], [14, 3, 3, 7, 11, 2]]
    expected = [plain.generate(p, params).token_ids for p in prompts]
    assert [r.token_ids for r in spec.generate_many(prompts, [params] * 3)] == expected
    assert [spec.generate(p, params).token_ids for p in prompts] == expected  # one at a time, slots reused
    assert spec.totals.drafted > 0
    assert (spec.totals.tree_rounds > 0) == (tree > 0)


def test_a_draft_tree_becomes_a_trie_of_target_tokens(target, pair_draft):
    """Each leaf of the draft's tree is read as text and re-encoded for the target; shared beginnings merge,
    siblings are distinct, the draft's best path comes first, and the budget and depth hold."""
    from specdraft.drafters.base import ROOT

    drafter = toy_drafter(pair_draft)
    # Draft ids: 16 'ab', 17 'cd', 18 'ef', 13 'c', 11 'e'. Leaves: 'ab'+'cd' (the first children), 'ab'+'c',
    # 'ef'. Each path is cut before its last target letter (the word may go on).
    draft = Proposal([16, 18, 17, 13], parents=[ROOT, ROOT, 0, 0])
    tree = drafter._tree_to_target([3, 7], [5], draft, max_k=5, max_nodes=8)
    assert tree.tokens == [0, 1, 2, 4] and tree.parents == [ROOT, 0, 1, ROOT]  # 'abc', then 'e' off the root
    assert len(set(t for t, p in zip(tree.tokens, tree.parents) if p == ROOT)) == 2
    small = drafter._tree_to_target([3, 7], [5], draft, max_k=2, max_nodes=3)
    assert small.tokens == [0, 1, 4] and small.parents == [ROOT, 0, ROOT]


def test_a_draft_equal_to_the_target_is_accepted_through_the_text_round_trip(target):
    """The target as its own draft, its tokens passed through text both ways: accepted (almost) always,
    which checks that the round trip puts the right tokens in the right places."""

    params = SamplingParams(temperature=0, max_tokens=40)
    drafter = CrossTokenizerDrafter(ModelDrafter(target, max_len=256), ToyTokenizer(VOCAB), ToyTokenizer(VOCAB))
    spec = engine(target, drafter, k=4)
    expected = engine(target).generate([4, 9, 2], params).token_ids
    assert spec.generate([4, 9, 2], params).token_ids == expected
    assert spec.totals.drafted > 20 and spec.totals.accepted / spec.totals.drafted > 0.9


def test_sampled_trees_match_the_target_distribution(target, pair_draft):
    """As below, with the draft's trees turned into target tries of up to 7 nodes (verified after the
    prefill's token by the multi-candidate rule for one-hot drafts)."""
    params = SamplingParams(temperature=1.0)
    spec = engine(target, toy_drafter(pair_draft, max_batch=BATCH, max_len=64), k=3, max_batch=BATCH, max_len=64,
                  tree=7)
    ok, p_value, tv = matches(sample_joint(spec, params, NUM_SAMPLES), exact_joint(target, params))
    assert spec.totals.tree_rounds > NUM_SAMPLES // 2 and 0 < spec.totals.accepted < spec.totals.drafted
    assert ok, f"cross-tokenizer tree sampling differs from the target (p={p_value:.2e}, TV={tv:.4f})"


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_matches_the_target_distribution(target, pair_draft, monkeypatch, broken):
    """20,000 seeded requests at temperature 1: the first two tokens' joint law equals the target's, and the
    same check rejects a verifier that resamples from the target instead of the residual."""
    if broken:
        monkeypatch.setattr(verify_batch_module, "rejection_verify", broken_verify_any_draft)
    params = SamplingParams(temperature=1.0)
    spec = engine(target, toy_drafter(pair_draft, max_batch=BATCH, max_len=64), k=1, max_batch=BATCH, max_len=64)
    assert_law_or_caught(spec, target, params, NUM_SAMPLES // 2 if broken else NUM_SAMPLES, broken,
                         "cross-tokenizer sampling")
