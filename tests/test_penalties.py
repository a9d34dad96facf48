"""Repetition, frequency and presence penalties: the target's penalized distribution, the same with speculation
(chains, trees, batches; greedy tokens and the sampled law) as with plain decoding, which itself follows an
independent reference loop."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from test_engine import FIXED, engine, matches, prompts
from test_logprobs import prefix_reference
from test_tree import ENGINE_SHAPES, PROMPT, ShapeDrafter, make_tree_drafters, small_pair, tree_engine  # noqa: F401
from tiny_models import tiny_model

from specdraft.drafters.draft_model import ModelDrafter
from specdraft.engine import core
from specdraft.engine.core import Engine
from specdraft.verify.penalties import node_paths, penalize_rows_
from specdraft.verify.sampling import InvalidParameterError, SamplingParams, logits_to_probs
from specdraft.verify.tree import ROOT

VOCAB = 16
PENALTIES = {
    "repetition 1.8": {"repetition_penalty": 1.8},
    "frequency 1.5": {"frequency_penalty": 1.5},
    "presence 2": {"presence_penalty": 2.0},
    "all three, negative presence": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": -0.7},
    "logit bias": {"logit_bias": {3: 2.5, 9: -100.0, 12: -1.5}},
    "logit bias, then repetition": {"logit_bias": {1: -3.0, 4: 1.0}, "repetition_penalty": 1.5},
}


def reference_penalty(row: torch.Tensor, prompt: list[int], generated: list[int], repetition: float = 1.0,
                      frequency: float = 0.0, presence: float = 0.0, bias: dict[int, float] | None = None
                      ) -> torch.Tensor:
    """Token by token, as OpenAI's logit bias, HF's RepetitionPenaltyLogitsProcessor and OpenAI's penalty formula
    describe them, in vLLM's order."""
    out = row.float().clone()
    for token, value in (bias or {}).items():
        out[token] += value
    for token in set(prompt) | set(generated):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in Counter(generated).items():
        out[token] -= frequency * count + presence
    return out


def test_node_paths_follow_each_node_back_to_the_root():
    assert node_paths([]) == [[]]
    assert node_paths([ROOT, 0, 1]) == [[], [0], [0, 1], [0, 1, 2]]
    assert node_paths([ROOT, ROOT, 0, 1, 0]) == [[], [0], [1], [0, 2], [1, 3], [0, 4]]


def penalized_copy(logits: torch.Tensor, prompt, generated, rows, **penalties) -> torch.Tensor:
    out = logits.to(torch.float32, copy=True)
    penalize_rows_(out, prompt, generated, rows, **penalties)
    return out


@pytest.mark.parametrize("setting", list(PENALTIES))
def test_each_row_is_penalized_for_what_precedes_it(setting):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g).to(torch.bfloat16)
    prompt, generated = [1, 2, 2, 9], [5, 2, 5]
    rows = [[], [7], [7, 5], [11]]
    got = penalized_copy(logits, prompt, generated, rows, **_args(setting))
    for r, before in enumerate(rows):
        expected = reference_penalty(logits[r], prompt, generated + before, **_args(setting))
        assert torch.allclose(got[r], expected, atol=1e-5), f"row {r}"
    assert not torch.allclose(got, logits.float())  # the test sees a change
    # A prompt's first token (nothing generated yet): only the repetition penalty acts, on the prompt's tokens.
    first = penalized_copy(logits[:1], prompt, [], [[]], **_args(setting))
    assert torch.allclose(first[0], reference_penalty(logits[0], prompt, [], **_args(setting)), atol=1e-5)


def test_neutral_penalties_leave_the_logits_alone_and_other_dtypes_are_refused():
    logits = torch.randn(2, 10)
    assert torch.equal(penalized_copy(logits, [1], [2, 3], [[], [4]]), logits)
    with pytest.raises(ValueError, match="one row each"):
        penalize_rows_(logits, [1], [2], [[]], repetition=1.2)
    with pytest.raises(ValueError, match="fp32"):
        penalize_rows_(logits.to(torch.bfloat16), [1], [2], [[], []], repetition=1.2)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 0), ("repetition_penalty", -1.0),
                                          ("repetition_penalty", float("inf")), ("repetition_penalty", "1.2"),
                                          ("frequency_penalty", 2.5), ("frequency_penalty", float("nan")),
                                          ("presence_penalty", -3), ("presence_penalty", True),
                                          ("logit_bias", {1: 101}), ("logit_bias", {-1: 1.0}),
                                          ("logit_bias", {"1": 1.0}), ("logit_bias", {True: 1.0}),
                                          ("logit_bias", {1: float("nan")}), ("logit_bias", [1, 2])])
def test_nonsense_penalties_are_refused(field, value):
    with pytest.raises(InvalidParameterError, match=field):
        SamplingParams(**{field: value})


def test_a_logit_bias_outside_the_vocabulary_is_refused_and_leaves_the_engine_usable():
    plain = engine(tiny_model(seed=0, vocab=VOCAB))
    with pytest.raises(InvalidParameterError, match=rf"logit_bias token ids must be in \[0, {VOCAB}\)"):
        plain.generate([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert plain.free_slots == 1 and plain.generate([1, 2], SamplingParams(max_tokens=3)).token_ids


def _args(setting: str) -> dict[str, float]:
    names = {"repetition_penalty": "repetition", "frequency_penalty": "frequency", "presence_penalty": "presence",
             "logit_bias": "bias"}
    return {names[k]: v for k, v in PENALTIES[setting].items()}


def reference_greedy(model, prompt: list[int], max_tokens: int, setting: str) -> list[int]:
    """Greedy decoding with penalties, one full forward over the whole sequence per token (no cache kept)."""
    generated: list[int] = []
    for _ in range(max_tokens):
        sequence = prompt + generated
        logits = model(torch.tensor([sequence]), model.new_cache(len(sequence), 1), slots=[0])[0, -1]
        generated.append(int(reference_penalty(logits, prompt, generated, **_args(setting)).argmax()))
    return generated


def penalized(setting: str, **params) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 30, **PENALTIES[setting], **params})


@pytest.mark.parametrize("setting", list(PENALTIES))
def test_plain_greedy_with_penalties_follows_the_reference(setting):
    target = tiny_model(seed=0, vocab=VOCAB)
    plain = engine(target)
    changed = 0
    for ids in prompts(4):
        got = plain.generate(ids, penalized(setting)).token_ids
        assert got == reference_greedy(target, ids, 30, setting)
        changed += got != plain.generate(ids, SamplingParams(temperature=0, max_tokens=30)).token_ids
    assert changed, "the penalty changed no output: the test would prove nothing"


def drafters(target, draft) -> dict:
    """Tree-capable drafters; "draft=target" proposes the target's own greedy tokens without the penalties:
    accepted wherever the penalty leaves the argmax alone, so many rows follow accepted drafts."""
    return {**make_tree_drafters(target, draft), "draft=target": lambda: ModelDrafter(target, max_len=256,
                                                                                       max_batch=3)}


# Each setting with each drafter on bf16 (the fused kernels' path where built), and with the drafter that gets
# the most rows past accepted drafts in fp32 too (the PyTorch path).
GREEDY_CASES = [(setting, name, torch.bfloat16) for setting in ("repetition 1.8", "all three, negative presence",
                                                                "logit bias", "logit bias, then repetition")
                for name in ("ngram", "draft", "recycle", "draft=target")]
GREEDY_CASES += [(setting, "draft=target", torch.float32) for setting in PENALTIES]


@pytest.mark.parametrize("setting, name, dtype", GREEDY_CASES)
def test_speculative_greedy_with_penalties_equals_plain(setting, name, dtype):
    """Chains, then trees, three requests at a time (beside requests without penalties)."""
    target = tiny_model(seed=0, vocab=VOCAB, dtype=dtype)
    draft = tiny_model(seed=1, vocab=VOCAB, dtype=dtype)
    make = drafters(target, draft)[name]
    plain = engine(target)
    batch = prompts(4) + [[1, 2, 3, 1, 2, 3, 1, 2]]
    params = [penalized(setting) if i % 2 == 0 else SamplingParams(temperature=0, max_tokens=30)
              for i in range(len(batch))]
    expected = [plain.generate(ids, p).token_ids for ids, p in zip(batch, params)]
    chains = engine(target, make(), k=4, max_batch=3)
    trees = tree_engine(target, make(), k=4, tree=8, adaptive=FIXED, max_batch=3)
    for eng in (chains, trees):
        results = eng.generate_many(batch, params)
        assert [r.token_ids for r in results] == expected
        assert eng.totals.accepted > 0, "nothing accepted: the test would prove nothing"
    assert trees.totals.tree_rounds > 0


@pytest.mark.parametrize("setting", ["repetition 1.8", "frequency 1.5", "presence 2"])
def test_penalties_that_ignore_the_draft_path_are_caught(setting, monkeypatch):
    """Planted bug: every row of a verification block penalized as if it followed only the tokens generated
    before the round (the draft path left out): the greedy comparison above must see it."""
    target = tiny_model(seed=0, vocab=VOCAB)
    plain = engine(target)
    monkeypatch.setattr(core, "node_paths", lambda parents: [[]] * (len(parents) + 1))
    spec = engine(target, ModelDrafter(target, max_len=256), k=4)
    params = penalized(setting, max_tokens=40)
    batch = prompts(6) + [[1, 2, 3, 1, 2, 3, 1, 2]]
    diverged = sum(spec.generate(ids, params).token_ids != plain.generate(ids, params).token_ids for ids in batch)
    assert diverged, "path-blind penalties gave the same tokens: the greedy comparison would not catch them"


def test_logprobs_stay_the_raw_distribution():
    """vLLM's default: the target's own logprobs, before penalties (and temperature)."""
    target = tiny_model(seed=0, vocab=VOCAB)
    spec = engine(target, ModelDrafter(target, max_len=256), k=4)
    ids = [1, 2, 3, 1, 2, 3, 1, 2]
    result = spec.generate(ids, penalized("repetition 1.8", logprobs=2))
    expected = prefix_reference(target, ids, result.token_ids, 2)
    assert [p.logprob for p in result.logprobs] == pytest.approx([p.logprob for p in expected], abs=1e-5)
    assert spec.totals.accepted > 0


# ---------------------------------------------------------------- sampling: the penalized law, exactly

NUM_SAMPLES = 10_000  # against the exact law; a path-blind bug is caught with half of that (p < 1e-6)
BATCH = 64


def exact_penalized_joint_2_3(model, params: SamplingParams) -> torch.Tensor:
    """P(second and third tokens) under plain sampling with penalties, exactly: [VOCAB * VOCAB]."""
    def probs(sequences: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(sequences), model.new_cache(16, num_slots=len(sequences)))[:, -1].clone()
        for i, sequence in enumerate(sequences):
            penalize_rows_(logits[i:i + 1], PROMPT, sequence[len(PROMPT):], [[]], params.repetition_penalty,
                           params.frequency_penalty, params.presence_penalty)
        return logits_to_probs(logits, params)

    first = probs([PROMPT])[0]
    second = probs([PROMPT + [t] for t in range(VOCAB)])
    joint = torch.zeros(VOCAB, VOCAB)
    for t1 in range(VOCAB):
        joint += first[t1] * second[t1][:, None] * probs([PROMPT + [t1, t2] for t2 in range(VOCAB)])
    return joint.flatten()


def sample_joint_2_3(eng: Engine, params: SamplingParams, n: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB * VOCAB)
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(7)).tolist()
    requests = [dataclasses.replace(params, max_tokens=4, seed=s) for s in seeds]
    for result in eng.generate_many([PROMPT] * n, requests):
        counts[result.token_ids[1] * VOCAB + result.token_ids[2]] += 1
    return counts


SAMPLED = SamplingParams(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=1.0)


@pytest.mark.parametrize("drafter", ["model chain", "three siblings then one"])
def test_speculative_sampling_with_penalties_keeps_the_penalized_law(small_pair, drafter):  # noqa: F811
    """10,000 requests each: tokens 2 and 3 come from one verified draft (depth 2), token 3 from a row that
    follows a draft token, so its penalty must count that token."""
    target, draft = small_pair
    if drafter == "model chain":
        eng = engine(target, ModelDrafter(draft, max_len=64, max_batch=BATCH), k=2, max_len=64, max_batch=BATCH)
    else:
        parents, mode = ENGINE_SHAPES[drafter]
        eng = tree_engine(target, ShapeDrafter(parents, mode), k=2, tree=len(parents), max_len=64,
                          max_batch=BATCH)
    counts = sample_joint_2_3(eng, SAMPLED, NUM_SAMPLES)
    assert eng.totals.accepted > 0
    ok, p_value, tv = matches(counts, exact_penalized_joint_2_3(target, SAMPLED))
    assert ok, f"{drafter}: sampling with penalties differs from the target's (p={p_value:.2e}, TV={tv:.4f})"


def test_the_sampling_test_catches_penalties_that_ignore_the_path(small_pair, monkeypatch):  # noqa: F811
    target, _ = small_pair
    monkeypatch.setattr(core, "node_paths", lambda parents: [[]] * (len(parents) + 1))
    parents, mode = ENGINE_SHAPES["top-3 then top-2"]
    eng = tree_engine(target, ShapeDrafter(parents, mode), k=2, tree=len(parents), max_len=64, max_batch=BATCH)
    ok, p_value, tv = matches(sample_joint_2_3(eng, SAMPLED, NUM_SAMPLES // 2),
                              exact_penalized_joint_2_3(target, SAMPLED))
    assert not ok and p_value < 1e-6, f"path-blind penalties not caught (p={p_value:.2e}, TV={tv:.4f})"
