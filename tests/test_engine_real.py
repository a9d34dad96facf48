"""Greedy identity of every drafter against plain decoding on the bundled real models.

fp32: token-for-token identical. bf16: identical, or at each divergence the target's top-2 logits must be
within BF16_TIE of each other (a genuine near-tie). The runtime is built to be batch-invariant in bf16, so
in practice no divergence is expected; any that happens is printed with its gap.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.drafters import make_drafter
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.generate import SpeculativeEngine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams

pytestmark = pytest.mark.slow

DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench-dev.jsonl"
BF16_TIE = 0.25  # bf16 logits near 20 are spaced 0.125 apart: a gap this small is a rounding-level tie
MAX_TOKENS = 40

DRAFTERS = {
    "smollm2-135m": ["ngram", "quant:int8", "quant:int4", "self:12", "draft:smollm2-135m"],
    "gemma3-270m": ["ngram", "quant:int8", "self:9"],
}


def dev_prompts(n: int) -> list[str]:
    if not DEV.exists():
        pytest.skip(f"dev suite not found at {DEV}")
    rows = [json.loads(line) for line in DEV.read_text().splitlines() if line.strip()]
    step = len(rows) // n
    return [rows[i * step]["turns"][0] for i in range(n)]


def encode(tokenizer, text: str) -> list[int]:
    if tokenizer.has_chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)[:200]


def first_divergence_gap(model, prompt_ids, expected, got) -> tuple[int, float]:
    pos = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    cache = model.new_cache(len(prompt_ids) + pos + 8)
    logits = model(torch.tensor([prompt_ids + expected[:pos]]), cache)[0, -1].float()
    top2 = logits.topk(2).values
    return pos, float(top2[0] - top2[1])


@pytest.mark.parametrize("model_name", list(DRAFTERS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_drafter_matches_plain_greedy(model_name, dtype):
    target = load_model(model_name, dtype=dtype, progress=False)
    tokenizer = load_tokenizer(model_name, progress=False)
    plain = SpeculativeEngine(target, tokenizer, None, 0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [encode(tokenizer, text) for text in dev_prompts(3)]
    expected = [plain.generate(ids, params).token_ids for ids in prompts]
    report = []
    for spec in DRAFTERS[model_name]:
        drafter = make_drafter(spec, target, tokenizer, max_len=1024, dtype=dtype)
        engine = SpeculativeEngine(target, tokenizer, drafter, 4, AdaptiveConfig(enabled=False), max_model_len=1024)
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


def test_mismatched_draft_tokenizer_is_refused():
    from specdraft.runtime.errors import SpecdraftError

    target = load_model("smollm2-135m", progress=False)
    tokenizer = load_tokenizer("smollm2-135m", progress=False)
    with pytest.raises(SpecdraftError, match="tokenizers do not match"):
        make_drafter("draft:gemma3-270m", target, tokenizer)
