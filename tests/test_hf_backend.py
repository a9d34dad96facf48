"""The transformers backend: architectures the runtime lacks (GPT-2, OPT) and Gemma 3's sliding windows, run by
the same engine, drafters and verifier. Greedy: identical to plain decoding and to transformers' own
`generate` (fp32); sampling: the target's distribution (the engine test's statistic); the cache rolls back and
keeps only a tree's accepted path."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_engine import FIXED, VOCAB, OracleDrafter, broken_residual_verify, exact_joint, matches, prompts, sample_joint
from tiny_models import ToyTokenizer, tiny_model

from specdraft.drafters import make_drafter
from specdraft.drafters.draft_model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine
from specdraft.errors import InvalidParameterError, ModelLoadError, SpecdraftError
from specdraft.runtime.hf_backend import HFTarget
from specdraft.verify import batch as verify_batch_module
from specdraft.verify.sampling import SamplingParams
from specdraft.verify.tree import tree_attention_mask

transformers = pytest.importorskip("transformers")


def _scaled(model, seed: int = 0, scale: float = 0.3):
    """Random weights large enough that next-token distributions are peaked (no argmax near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def tiny_hf(kind: str, seed: int = 0, layers: int = 2):
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=32, n_layer=layers, n_head=4,
                                      bos_token_id=0, eos_token_id=0)
        return _scaled(transformers.GPT2LMHeadModel(cfg), seed)
    if kind == "opt":
        cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
                                     num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return _scaled(transformers.OPTForCausalLM(cfg), seed)
    if kind == "gemma3":  # sliding window 4: every test context is longer than the window
        cfg = transformers.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"], bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return _scaled(transformers.Gemma3ForCausalLM(cfg), seed)
    raise ValueError(kind)


KINDS = ["gpt2", "opt", "gemma3"]


@pytest.fixture(scope="module", params=KINDS)
def hf_target(request):
    return HFTarget(tiny_hf(request.param))


def engine(target, drafter=None, k=4, adaptive=FIXED, max_batch=1, tree=0):
    return Engine(target, ToyTokenizer(VOCAB), drafter, k, adaptive, max_model_len=128, max_batch=max_batch,
                  tree=tree)


def hf_greedy(target: HFTarget, ids: list[int], n: int) -> list[int]:
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_block_rollback_and_tree_paths_give_the_logits_of_one_full_forward(hf_target):
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    full = hf_target.model(ids).logits[0]
    cache = hf_target.new_cache(64, 2)
    assert torch.allclose(hf_target(ids[:, :9], cache, slots=[1])[0], full[:9], atol=1e-5)
    cache.commit(1, 6)  # roll back three of the nine
    assert torch.allclose(hf_target(ids[:, 6:10], cache, slots=[1])[0], full[6:10], atol=1e-5)
    # A tree behind 6 committed: the pending token, a wrong sibling at each depth, the true path.
    toks = [int(ids[0, 6]), int(ids[0, 7]), (int(ids[0, 7]) + 1) % VOCAB, int(ids[0, 8]),
            (int(ids[0, 8]) + 1) % VOCAB, int(ids[0, 9])]
    parents = [-1, -1, 0, 0, 2]  # nodes 0 (true), 1 (wrong) at depth 1; 2 (true), 3 (wrong) under 0; 4 under 2
    depths = [0, 1, 1, 2, 2, 3]
    logits = hf_target(torch.tensor([toks]), cache, slots=[1], positions=torch.tensor([[6 + d for d in depths]]),
                       tree_mask=tree_attention_mask(parents))[0]
    assert torch.allclose(logits[[0, 1, 3, 5]], full[6:10], atol=1e-5)
    assert not torch.allclose(logits[2], full[7], atol=1e-3)  # the sibling sees its own token, not node 0's
    cache.compact(1, [0, 1, 3, 5])  # keep the pending token and the true path
    assert cache.length(1) == 10
    assert torch.allclose(hf_target(ids[:, 10:14], cache, slots=[1])[0], full[10:14], atol=1e-5)
    assert cache.length(0) == 0 and cache.stored(0) == 0  # the other slot untouched


def test_plain_decoding_is_transformers_own_greedy(hf_target):
    plain = engine(hf_target)
    for ids in prompts(3):
        assert plain.generate(ids, SamplingParams(temperature=0, max_tokens=20)).token_ids == \
            hf_greedy(hf_target, ids, 20)


def test_penalties_are_transformers_own_and_speculation_keeps_them(hf_target):
    """HF's `repetition_penalty` in its own `generate` is the reference for plain decoding; drafts change
    nothing, chains and trees: the penalized tokens themselves (every row after the first follows accepted
    drafts, each penalized for them) and the unpenalized ones (right wherever the penalty leaves the argmax
    alone)."""
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.6)
    plain = engine(hf_target)
    changed = accepted = 0
    for ids in prompts(3, seed=3):
        expected = plain.generate(ids, params).token_ids
        # No end-of-sequence token (the tiny OPT's is 0, which `min_new_tokens` would rule out): 20 tokens;
        # every prompt token attended to (a 0 in it would otherwise be taken for padding).
        out = hf_target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None,
                                       repetition_penalty=1.6)
        assert expected == out[0, len(ids):].tolist()
        unpenalized = hf_greedy(hf_target, ids, 20)
        changed += expected != unpenalized
        for tree, drafts in itertools.product((0, 6), (expected, unpenalized)):
            result = engine(hf_target, OracleDrafter(len(ids), drafts), k=4, tree=tree).generate(ids, params)
            assert result.token_ids == expected, (tree, ids, drafts)
            accepted += result.metrics.accepted
    assert changed and accepted, "the penalty changed no output, or no draft was accepted: this proves nothing"


def make(drafter: str, prompt_len: int, expected: list[int]):
    if drafter == "ngram":
        return NgramDrafter()
    if drafter == "draft":  # a draft of the specdraft runtime for a transformers target
        return ModelDrafter(tiny_model(seed=1, vocab=VOCAB))
    return OracleDrafter(prompt_len, expected, wrong=drafter == "oracle-wrong")


@pytest.mark.parametrize("drafter", ["ngram", "draft", "oracle", "oracle-wrong"])
@pytest.mark.parametrize("tree", [0, 6])
def test_speculation_on_a_transformers_target_is_identical_to_plain_greedy(hf_target, drafter, tree):
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = engine(hf_target)
    for ids in prompts(3, seed=2):
        expected = plain.generate(ids, params).token_ids
        spec = engine(hf_target, make(drafter, len(ids), expected), k=4, tree=tree)
        result = spec.generate(ids, params)
        assert result.token_ids == expected, (drafter, tree, ids)
        if drafter == "oracle":
            assert result.metrics.accepted == result.metrics.drafted > 0
            assert result.metrics.target_forwards < len(expected) / 2


def test_logprobs_on_a_transformers_target_are_its_own_log_softmax(hf_target):
    """Prompt and generated tokens' logprobs, sampled with a draft model's trees (rejections included): each is
    transformers' own log-softmax over one full forward of the sequence."""
    spec = engine(hf_target, ModelDrafter(tiny_model(seed=1, vocab=VOCAB)), k=4, tree=6)
    for seed, ids in enumerate(prompts(2, seed=4)):
        got = spec.generate(ids, SamplingParams(temperature=1.0, seed=seed, max_tokens=16, logprobs=2,
                                                prompt_logprobs=1))
        sequence = ids + got.token_ids
        with torch.no_grad():
            reference = torch.log_softmax(hf_target.model(torch.tensor([sequence])).logits[0, :-1].float(), -1)
        rows = [*got.prompt_logprobs[1:], *got.logprobs]
        assert got.prompt_logprobs[0] is None and [e.token_id for e in rows] == sequence[1:]
        expected = reference[torch.arange(len(rows)), torch.tensor(sequence[1:])]
        assert [e.logprob for e in rows] == pytest.approx(expected.tolist(), abs=1e-4)
        assert all(len(e.top) == 2 for e in got.logprobs) and all(len(e.top) == 1 for e in rows[:len(ids) - 1])
    assert 0 < spec.totals.accepted < spec.totals.drafted


def test_requests_batched_on_a_transformers_target_decode_as_alone(hf_target):
    params = SamplingParams(temperature=0, max_tokens=16)
    batch = prompts(5, seed=3)
    alone = [engine(hf_target, NgramDrafter()).generate(ids, params).token_ids for ids in batch]
    together = engine(hf_target, NgramDrafter(), max_batch=4, adaptive=AdaptiveConfig())
    assert [r.token_ids for r in together.generate_many(batch, [params] * len(batch))] == alone


SAMPLES = 3000  # each sample is a few forwards of transformers' own modules, one row at a time


@pytest.fixture(scope="module")
def gpt2_pair():
    return HFTarget(tiny_hf("gpt2", layers=1)), tiny_model(seed=1, vocab=VOCAB, layers=1)


def test_sampling_on_a_transformers_target_keeps_its_distribution(gpt2_pair):
    """A sampled draft (q is the draft model's distribution) through the engine on a GPT-2 target; the same
    statistic at the same size rejects a verifier that resamples from the target after a rejection."""
    target, draft = gpt2_pair
    params = SamplingParams(temperature=1.0)
    spec = engine(target, ModelDrafter(draft, max_len=64, max_batch=32), k=1, max_batch=32)
    ok, p_value, tv = matches(sample_joint(spec, params, SAMPLES), exact_joint(target, params))
    assert 0 < spec.totals.accepted < spec.totals.drafted == SAMPLES
    assert ok, f"speculative sampling on the transformers backend differs (p={p_value:.2e}, TV={tv:.4f})"


def test_the_sampling_check_catches_a_broken_verifier_at_that_size(gpt2_pair, monkeypatch):
    target, draft = gpt2_pair
    monkeypatch.setattr(verify_batch_module, "rejection_verify", broken_residual_verify)
    params = SamplingParams(temperature=1.0)
    spec = engine(target, ModelDrafter(draft, max_len=64, max_batch=32), k=1, max_batch=32)
    ok, p_value, tv = matches(sample_joint(spec, params, SAMPLES), exact_joint(target, params))
    assert not ok, f"broken verifier not caught (p={p_value:.2e}, TV={tv:.4f})"


def test_drafters_that_need_the_runtime_are_refused_clearly(hf_target):
    for spec in ["quant:int8", "self:1", "eagle", "medusa"]:
        with pytest.raises(SpecdraftError, match="transformers backend"):
            make_drafter(spec, hf_target, ToyTokenizer(VOCAB))
    assert make_drafter("auto", hf_target, ToyTokenizer(VOCAB)).name == "ngram"


def test_backend_is_checked_in_the_config():
    from specdraft.config import SpecConfig
    from specdraft.runtime.hf_backend import load_hf_target

    with pytest.raises(InvalidParameterError, match="backend"):
        SpecConfig(model="m", backend="vllm")
    with pytest.raises(InvalidParameterError, match="gguf"):
        SpecConfig(model="m", backend="transformers", dtype="gguf")
    with pytest.raises(ModelLoadError, match="not found"):
        load_hf_target("/no/such/model")


@pytest.mark.slow
def test_a_real_model_through_the_api_matches_transformers_generate():
    """SmolLM2-135M loaded by transformers (fp32) under the engine: n-gram chains and trees and a draft model
    of the specdraft runtime, all equal to transformers' own greedy output."""
    from specdraft import LLM

    messages = [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]
    params = SamplingParams(temperature=0, max_tokens=40)
    llm = LLM("smollm2-135m", speculative_model="ngram", backend="transformers", tree=6, progress=False)
    assert isinstance(llm.target, HFTarget) and llm.target.dtype == torch.float32
    out = llm.chat(messages, params)[0]
    expected = hf_greedy(llm.target, out.prompt_token_ids, 40)
    assert out.outputs[0].token_ids == expected[:len(out.outputs[0].token_ids)]
    assert len(out.outputs[0].token_ids) == 40 or out.outputs[0].finish_reason == "stop"
    drafted = LLM("smollm2-135m", speculative_model="draft:smollm2-135m", backend="transformers", dtype="fp32",
                  progress=False)
    again = drafted.chat(messages, params)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.metrics.acceptance_rate > 0.9  # the same model as draft: only fp32 rounding can reject
