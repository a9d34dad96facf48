"""Greedy identity of every drafter against plain decoding on the bundled real models.

fp32: token-for-token identical. bf16: identical, or at each divergence the target's top-2 logits must be
within BF16_TIE of each other (a genuine near-tie). The runtime is built to be batch-invariant in bf16, so
in practice no divergence is expected; any that happens is printed with its gap.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import assert_tree_nodes_equal_their_paths, needs_kernels

from specdraft.drafters import make_drafter
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine, build_engine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams

pytestmark = pytest.mark.slow

BF16_TIE = 0.25  # bf16 logits near 20 are spaced 0.125 apart: a gap this small is a rounding-level tie
MAX_TOKENS = 32

DRAFTERS = {
    "smollm2-135m": ["ngram", "quant:int8", "quant:int4", "self:12", "draft:smollm2-135m", "cascade:ngram,quant:int8"],
    "gemma3-270m": ["ngram", "quant:int8", "self:9"],
}


def spread(rows: list[dict], n: int) -> list[str]:
    step = len(rows) // n
    return [rows[i * step]["turns"][0] for i in range(n)]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.prompt_ids(text, chat=tokenizer.has_chat_template)[:200]


def first_divergence_gap(model, prompt_ids, expected, got) -> tuple[int, float]:
    pos = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    cache = model.new_cache(len(prompt_ids) + pos + 8)
    logits = model(torch.tensor([prompt_ids + expected[:pos]]), cache)[0, -1].float()
    top2 = logits.topk(2).values
    return pos, float(top2[0] - top2[1])


@pytest.mark.parametrize("model_name", list(DRAFTERS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_drafter_matches_plain_greedy(model_name, dtype, dev_prompts):
    target = load_model(model_name, dtype=dtype, progress=False)
    tokenizer = load_tokenizer(model_name, progress=False)
    plain = Engine(target, tokenizer, None, 0)
    # fp32 runs the PyTorch ops (3x slower than the bf16 kernels, the path of GPUs): one prompt keeps the suite
    # short; bf16 (the fused kernels, the CPU default) gets two.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS if dtype == "bf16" else 24)
    prompts = [encode(tokenizer, text) for text in spread(dev_prompts, 2 if dtype == "bf16" else 1)]
    expected = [plain.generate(ids, params).token_ids for ids in prompts]
    report = []
    for spec in DRAFTERS[model_name]:
        drafter = make_drafter(spec, target, tokenizer, max_len=1024, dtype=dtype)
        engine = Engine(target, tokenizer, drafter, 4, AdaptiveConfig(enabled=False), max_model_len=1024)
        for ids, want in zip(prompts, expected):
            got = engine.generate(ids, params).token_ids
            if got == want:
                continue
            pos, gap = first_divergence_gap(target, ids, want, got)
            report.append(f"{spec}: diverged at token {pos}, top-2 gap {gap:.4f}")
            assert dtype == "bf16" and gap < BF16_TIE, report[-1]
        stats = engine.totals
        print(f"{model_name} {dtype} {spec}: acceptance {stats.acceptance_rate:.2f}, "
              f"mean accepted length {stats.mean_accepted_length:.2f}")
        assert stats.drafted > 0
        if spec.startswith("draft:") and spec.endswith(model_name):
            assert stats.acceptance_rate >= 0.99, "draft = target must accept (almost) everything"
    print("\n".join(report) or f"{model_name} {dtype}: all outputs identical")


@pytest.mark.parametrize("target_name,draft_name,tree", [("gemma3-270m", "smollm2-135m", 0),
                                                         ("smollm2-135m", "gemma3-270m", 0),
                                                         ("gemma3-270m", "smollm2-135m", 8)])
def test_a_draft_with_another_tokenizer_matches_plain_greedy(target_name, draft_name, tree, dev_prompts):
    """Gemma's 262k SentencePiece vocabulary and SmolLM2's 49k byte-level BPE share no ids: the draft reads
    the target's text in its own tokens, and its text comes back as target tokens (cross_tokenizer.py), as
    chains or as the draft's trees merged into tries of target tokens."""
    from specdraft.drafters.cross_tokenizer import CrossTokenizerDrafter

    target = load_model(target_name, dtype="bf16", progress=False)
    tokenizer = load_tokenizer(target_name, progress=False)
    drafter = make_drafter(f"draft:{draft_name}", target, tokenizer, max_len=1024)
    assert isinstance(drafter, CrossTokenizerDrafter)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = encode(tokenizer, spread(dev_prompts, 3)[1])
    expected = Engine(target, tokenizer, None, 0).generate(ids, params).token_ids
    engine = Engine(target, tokenizer, drafter, 4, AdaptiveConfig(enabled=False), max_model_len=1024, tree=tree)
    assert engine.generate(ids, params).token_ids == expected
    stats = engine.totals
    assert (stats.tree_rounds > 0) == (tree > 0)
    print(f"{target_name} <- draft:{draft_name}, trees of {tree}: acceptance {stats.acceptance_rate:.2f}, "
          f"mean accepted length {stats.mean_accepted_length:.2f}")
    # Two related small models agree on much of a continuation; zero would mean the text round trip is broken.
    assert stats.drafted > 0 and stats.accepted > 0


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_request_decodes_the_same_alone_and_beside_seven_others(drafter, dev_prompts):
    """bf16 on the fused kernels: a token's logits do not depend on the batch it is verified in, so eight
    requests advanced together by `Engine.step` give each the tokens it gets alone, exactly. Four prompts
    are long (prefilled alone), four short ones of equal length share one prefill."""
    target = load_model("smollm2-135m", dtype="bf16", progress=False)
    tokenizer = load_tokenizer("smollm2-135m", progress=False)
    texts = spread(dev_prompts, 4)
    prompts = [encode(tokenizer, text) for text in texts]
    prompts += [tokenizer.prompt_ids(text)[:12] for text in texts]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    alone = build_engine(target, tokenizer, drafter, 4, adaptive=False)
    together = build_engine(target, tokenizer, drafter, 4, adaptive=False, max_batch=8)
    expected = [alone.generate(ids, p).token_ids for ids, p in zip(prompts, params)]
    got = [r.token_ids for r in together.generate_many(prompts, params)]
    assert got == expected
    if drafter:
        assert together.totals.accepted > 0


@needs_kernels
@pytest.mark.parametrize("model_name", list(DRAFTERS))
@pytest.mark.parametrize("dtype", ["bf16", "gguf"])
def test_tree_nodes_get_the_bits_of_their_paths_in_the_real_models(model_name, dtype):
    """Random trees of up to 17 nodes on the real models (30 and 18 layers: a rounding difference anywhere
    shows in the logits, where the tiny models' few layers can hide it). Caught the AMX attention summing a
    node's softmax denominator by key position."""
    assert_tree_nodes_equal_their_paths(load_model(model_name, dtype=dtype, progress=False))


@pytest.mark.parametrize("model_name,drafters", [("smollm2-135m", ["ngram", "quant:int8"]),
                                                 ("gemma3-270m", ["ngram", "self:9"])])
def test_token_trees_match_plain_greedy_bit_for_bit(model_name, drafters, dev_prompts):
    """bf16 on the fused kernels: a tree node's logits are the bits of its path decoded alone, so trees of up
    to 16 tokens (and a batch of them, verified together) give plain greedy decoding exactly."""
    target = load_model(model_name, dtype="bf16", progress=False)
    tokenizer = load_tokenizer(model_name, progress=False)
    prompts = [encode(tokenizer, text) for text in spread(dev_prompts, 3)]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * len(prompts)
    plain = Engine(target, tokenizer, None, 0, max_model_len=1024)
    expected = [plain.generate(ids, p).token_ids for ids, p in zip(prompts, params)]
    for spec in drafters:
        engine = build_engine(target, tokenizer, spec, 4, adaptive=False, max_model_len=1024, max_batch=3,
                              tree=16)
        got = [r.token_ids for r in engine.generate_many(prompts, params)]
        assert got == expected, f"{model_name} {spec}: a tree diverged from plain greedy"
        assert engine.totals.tree_rounds > 0 and engine.totals.accepted > 0


def test_the_demo_runs_both_prompts_with_output_identical_to_plain(capsys):
    """`specdraft demo` (what `make demo` runs), short: both built-in prompts, each against plain decoding."""
    from specdraft.cli import DEMO_PROMPTS, main

    assert main(["demo", "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical output: yes") == out.count("identical output:") == len(DEMO_PROMPTS) == 2
    assert all(f"prompt: {p}" in out for p in DEMO_PROMPTS)
    assert main(["demo", "--max-tokens", "8", "--prompt", "Say hello."]) == 0
    assert capsys.readouterr().out.count("identical output: yes") == 1
