"""The draft heads shipped inside the package: small enough, documented, found for their real target, and
lossless on it (greedy output identical to plain decoding, chains and trees)."""

from __future__ import annotations

import json

import pytest
from real_models import greedy_reference

from specdraft.drafters import make_drafter
from specdraft.drafters.shipped import shipped_heads
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine

MAX_HEAD_BYTES = 25 * 10**6
HEADS = shipped_heads()


def test_a_head_ships_for_each_bundled_model():
    assert {p.parent.name for p in shipped_heads("eagle")} >= {"smollm2-135m", "gemma3-270m"}


@pytest.mark.parametrize("head", HEADS, ids=lambda p: f"{p.parent.name}-{p.name}")
def test_shipped_head_is_small_and_has_its_card(head):
    weights = sum(f.stat().st_size for f in head.glob("*.safetensors"))
    assert 0 < weights <= MAX_HEAD_BYTES, f"{head}: {weights} bytes of weights"
    card = (head / "CARD.md").read_text()
    for section in ("## Data", "## Commands", "## Training", "## Measured"):
        assert section in card, f"{head}/CARD.md lacks {section}"
    target = json.loads((head / "config.json").read_text())["specdraft"]["target"]
    assert target["model"] == head.parent.name and target["signature"]["vocab_size"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["smollm2-135m", "gemma3-270m"])
def test_shipped_eagle_head_drafts_losslessly_for_its_target(model_name, dev_prompts):
    target, tokenizer, prompts, expected, params = greedy_reference(model_name, dev_prompts, 24)
    drafter = make_drafter("eagle", target, tokenizer, max_len=512)
    for tree in (0, 8):
        engine = Engine(target, tokenizer, drafter, 3, AdaptiveConfig(enabled=False), max_model_len=512, tree=tree)
        assert [engine.generate(ids, params).token_ids for ids in prompts] == expected
        assert engine.totals.drafted > 0
