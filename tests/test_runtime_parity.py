"""Our runtime against transformers on the bundled models (same converted weights, both in fp32).

- logits over a 64-token prompt agree within 1e-3, whether scored at once, one token at a time after a
  40-token prefill, or in blocks of 5 (the KV cache path);
- greedy decoding gives the same 40 tokens as `generate(do_sample=False)`, except at genuine near-ties;
- bf16 (the default dtype) changes fp32's top-1 token only at near-ties, and no more often than
  transformers' own bf16 does (the goal was 99% agreement; bf16 itself does not reach it, see the test);
- a prompt longer than Gemma 3's 512-token sliding window still matches (the sliding-window layers).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.slow

ATOL = 1e-3
PROMPT_LEN = 64
GREEDY_STEPS = 40
NEAR_TIE = 1e-3
BF16_AGREEMENT = 0.99  # the goal; printed, not asserted (see test_bf16_top1_agrees_with_fp32)
# logits: bf16 errors at the top of the distribution are ~0.1, up to ~1 over the vocabulary. On Intel's AMX
# tiles SmolLM2's first chat-template token flips at an fp32 gap of 0.80 (AMD's AVX512-BF16 and transformers'
# bf16 keep it), so 0.5 held on one vendor only; a broken bf16 path flips far more (the count test below).
BF16_TIE = 1.0
GREEDY_CATEGORIES = ("coding", "translation", "math_reasoning")
LONG_CATEGORIES = ("summarization", "rag")
LONG_RANGE = (600, 900)  # tokens: past the 512-token window, short enough to stay quick
LONG_TAIL = 16


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Instruct models get their chat template, base models (Gemma 3 270M) the plain text."""
    return tokenizer.prompt_ids(text, chat=tokenizer.has_chat_template)


def hf_logits(hf_model, ids: list[int], last: int | None = None) -> torch.Tensor:
    """transformers logits [T or last, V] for one sequence scored at once."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), logits_to_keep=last or 0)
    return out.logits[0].float()


def score_in_chunks(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Our logits [T, V], feeding the sequence in chunks of the given sizes and committing after each."""
    assert sum(chunks) == len(ids)
    cache = model.new_cache(len(ids))
    out, pos = [], 0
    for size in chunks:
        out.append(model(torch.tensor([ids[pos:pos + size]]), cache)[0])
        pos += size
        cache.commit(0, pos)
    return torch.cat(out).float()


def greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decoding on `model(...)` + `cache.commit`: the new tokens and the logits that chose them."""
    cache = model.new_cache(len(ids) + steps)
    logits = model(torch.tensor([ids]), cache, logits_from=len(ids) - 1)[0, -1]
    cache.commit(0, len(ids))
    tokens, chosen_from = [], []
    for step in range(steps):
        chosen_from.append(logits.float())
        tokens.append(int(logits.argmax()))
        if step + 1 < steps:
            logits = model(torch.tensor([[tokens[-1]]]), cache)[0, -1]
            cache.commit(0, cache.length(0) + 1)
    return tokens, torch.stack(chosen_from)


@pytest.fixture(scope="module")
def hf_bf16_model(model_name):
    """transformers in bf16: how often bf16 itself flips the top-1 token on these weights."""
    from transformers import AutoModelForCausalLM

    from specdraft.runtime import resolve

    return AutoModelForCausalLM.from_pretrained(
        resolve(model_name, progress=False), dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def parity_prompt(dev_prompts, tokenizer) -> list[int]:
    """The first PROMPT_LEN tokens of the first dev prompt that is long enough."""
    for row in dev_prompts:
        ids = prompt_ids(tokenizer, row["turns"][0])
        if len(ids) >= PROMPT_LEN:
            return ids[:PROMPT_LEN]
    pytest.fail(f"no dev prompt has {PROMPT_LEN} tokens")


@pytest.fixture(scope="module")
def parity_reference(hf_model, parity_prompt) -> torch.Tensor:
    return hf_logits(hf_model, parity_prompt)


@pytest.fixture(scope="module")
def greedy_prompts(dev_prompts, tokenizer) -> list[tuple[str, list[int]]]:
    """One prompt from each of three different categories: (label, token ids)."""
    picked = []
    for category in GREEDY_CATEGORIES:
        row = next((r for r in dev_prompts if r["category"] == category), None)
        if row is None:
            pytest.fail(f"no dev prompt of category {category!r}")
        picked.append((f"q{row['question_id']}/{category}", prompt_ids(tokenizer, row["turns"][0])))
    return picked


@pytest.fixture(scope="module")
def fp32_greedy(fp32_model, greedy_prompts) -> list[tuple[list[int], torch.Tensor]]:
    return [greedy(fp32_model, ids, GREEDY_STEPS) for _, ids in greedy_prompts]


@pytest.mark.parametrize(
    "chunks",
    [[PROMPT_LEN], [40] + [1] * (PROMPT_LEN - 40), [5] * (PROMPT_LEN // 5) + [PROMPT_LEN % 5]],
    ids=["prefill", "prefill40-then-1-by-1", "blocks-of-5"],
)
def test_fp32_logits_match_transformers(model_name, fp32_model, parity_prompt, parity_reference, chunks):
    reference = parity_reference
    ours = score_in_chunks(fp32_model, parity_prompt, [c for c in chunks if c])
    diff = (ours - reference).abs().max().item()
    print(f"{model_name} {len(chunks)} chunk(s): max |logit diff| = {diff:.2e}")
    assert diff <= ATOL


def test_greedy_matches_transformers_generate(model_name, hf_model, tokenizer, greedy_prompts, fp32_greedy):
    eos = set(tokenizer.eos_token_ids)
    for (label, ids), (ours, chosen_from) in zip(greedy_prompts, fp32_greedy, strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=GREEDY_STEPS, pad_token_id=tokenizer.hf.pad_token_id,
            )
        theirs = out[0, len(ids):].tolist()
        if len(theirs) < GREEDY_STEPS:  # transformers stops at end-of-sequence; we compare up to there
            assert theirs and theirs[-1] in eos, f"{label}: generate stopped early without EOS"
        diverge = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if diverge is None:
            print(f"{model_name} {label}: {len(theirs)} greedy tokens identical")
            continue
        top2 = chosen_from[diverge].topk(2)
        gap = (top2.values[0] - top2.values[1]).item()
        print(
            f"{model_name} {label}: diverges at step {diverge}: ours {ours[diverge]} "
            f"({tokenizer.token_text(ours[diverge])!r}), transformers {theirs[diverge]} "
            f"({tokenizer.token_text(theirs[diverge])!r}); our top-2 gap {gap:.2e}"
        )
        assert theirs[diverge] in top2.indices.tolist(), f"{label}: transformers' token is not in our top 2"
        assert gap < NEAR_TIE, f"{label}: divergence at step {diverge} is not a near-tie (gap {gap:.2e})"


def test_bf16_top1_agrees_with_fp32(model_name, fp32_model, bf16_model, hf_model, hf_bf16_model,
                                    greedy_prompts, fp32_greedy):
    """Teacher-forced over prompt + fp32 greedy continuation. bf16 keeps ~3 significant digits, so the top-1
    flips where fp32's top two logits are close; measured with transformers' own bf16 on the same weights:
    97.1% (smollm2) and 98.5% (gemma3) agreement, so a fixed 99% bar fails on a correct runtime. Checked
    instead: every flip is a near-tie in fp32, and we agree no less often than transformers' bf16 does."""
    agree = agree_hf = total = 0
    flips = []
    for (label, ids), (continuation, _) in zip(greedy_prompts, fp32_greedy, strict=True):
        seq = ids + continuation
        logits_fp32 = score_in_chunks(fp32_model, seq, [len(seq)])
        top_fp32 = logits_fp32.argmax(-1)
        top_bf16 = score_in_chunks(bf16_model, seq, [len(seq)]).argmax(-1)
        top_hf_fp32 = hf_logits(hf_model, seq).argmax(-1)
        top_hf_bf16 = hf_logits(hf_bf16_model, seq).argmax(-1)
        top2 = logits_fp32.topk(2).values
        gaps = top2[:, 0] - top2[:, 1]
        flipped = (top_fp32 != top_bf16).nonzero().flatten().tolist()
        flips += [(label, i, gaps[i].item()) for i in flipped]
        same, same_hf = len(seq) - len(flipped), int((top_hf_fp32 == top_hf_bf16).sum())
        print(f"{model_name} {label}: bf16 top-1 = fp32 top-1 on {same}/{len(seq)} positions "
              f"(transformers {same_hf}/{len(seq)}); flips at {flipped} with fp32 top-2 gaps "
              f"{[round(gaps[i].item(), 3) for i in flipped]}")
        agree, agree_hf, total = agree + same, agree_hf + same_hf, total + len(seq)
    print(f"{model_name}: bf16/fp32 top-1 agreement {agree / total:.2%} over {total} positions "
          f"(transformers: {agree_hf / total:.2%}); target {BF16_AGREEMENT:.0%}")
    wide = [f for f in flips if f[2] >= BF16_TIE]
    assert not wide, f"bf16 changed the top-1 token where fp32 is not a near-tie: {wide}"
    # How many near-ties flip depends on how the CPU rounds bf16 dot products (measured on smollm2: 13 flips
    # on Intel Sapphire Rapids, 20 on AMD Zen 4, 13 for transformers' bf16), so no fixed margin holds on
    # every machine. Under "we flip near-ties at transformers' rate" the two flip counts are about Poisson,
    # and their difference over sqrt(their sum) about standard normal: 4 sigma is a 3e-5 false alarm, while
    # a broken bf16 path (wrong rounding, fp16 overflow) flips far more, and at wide gaps too.
    ours, theirs = total - agree, total - agree_hf
    assert ours <= theirs + 4 * math.sqrt(ours + theirs) + 1, (
        f"{ours} bf16 top-1 flips against transformers' {theirs} over {total} positions")


def test_long_prompt_past_sliding_window(model_name, fp32_model, hf_model, tokenizer, dev_prompts):
    """Gemma 3 attends only to the last 512 positions in 5 of every 6 layers: past 512 tokens a missing or
    wrong window shows up in the logits. Checked scoring the prompt at once and decoding its tail through
    the cache; for Gemma also that the check is sensitive (ignoring the window must break it)."""
    lo, hi = LONG_RANGE
    ids = next(
        (ids for r in dev_prompts if r["category"] in LONG_CATEGORIES
         for ids in [prompt_ids(tokenizer, r["turns"][0])] if lo <= len(ids) <= hi),
        None,
    )
    if ids is None:
        pytest.fail(f"no summarization/rag dev prompt with {lo}-{hi} tokens")
    reference = hf_logits(hf_model, ids, last=LONG_TAIL)
    cfg = fp32_model.config
    window = cfg.sliding_window
    if cfg.is_gemma:
        assert window is not None and len(ids) > window + LONG_TAIL and "sliding" in cfg.layer_types

    cache = fp32_model.new_cache(len(ids))
    at_once = fp32_model(torch.tensor([ids]), cache, logits_from=len(ids) - LONG_TAIL)[0]
    diff_at_once = (at_once - reference).abs().max().item()
    head = len(ids) - LONG_TAIL
    chunks = [head] + [1] * LONG_TAIL
    diff_decode = (score_in_chunks(fp32_model, ids, chunks)[head:] - reference).abs().max().item()
    print(f"{model_name} {len(ids)}-token prompt, last {LONG_TAIL} positions: max |diff| at once "
          f"{diff_at_once:.2e}, decoding {diff_decode:.2e}")
    assert diff_at_once <= ATOL
    assert diff_decode <= ATOL

    if cfg.is_gemma:
        cfg.sliding_window = 10**9  # every layer sees everything: must no longer match
        try:
            no_window = fp32_model(torch.tensor([ids]), fp32_model.new_cache(len(ids)),
                                   logits_from=len(ids) - LONG_TAIL)[0]
        finally:
            cfg.sliding_window = window
        diff_no_window = (no_window - reference).abs().max().item()
        print(f"{model_name} without the sliding window: max |diff| {diff_no_window:.2e}")
        assert diff_no_window > 100 * ATOL
