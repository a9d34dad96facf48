"""`specdraft self-prompts`: prompts a chat target writes itself (Magpie), for `specdraft distill`."""

from __future__ import annotations

import json

import pytest
from tiny_models import ToyTokenizer, tiny_model

from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.train.distill import read_prompts
from specdraft.train.self_prompts import (
    SelfPromptConfig,
    keep_prompt,
    self_prompts,
    user_turn_prefix,
    write_prompts,
)

VOCAB = 16
EOS = 0


def test_user_turn_prefix_ends_where_a_user_message_starts(smollm2_tokenizer):
    prefix = user_turn_prefix(smollm2_tokenizer)
    message = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    assert message[:len(prefix)] == prefix and len(message) > len(prefix)
    assert smollm2_tokenizer.hf.decode(prefix).endswith("<|im_start|>user\n")
    assert "Name" in smollm2_tokenizer.hf.decode(message[len(prefix):])


def test_a_model_without_a_chat_template_is_refused():
    with pytest.raises(SpecdraftError, match="no chat template"):
        user_turn_prefix(ToyTokenizer(VOCAB))


def test_keep_prompt_drops_cut_short_and_repeated_messages():
    seen: set[str] = set()
    assert keep_prompt("What is the capital of France?", "stop", seen, 16)
    assert not keep_prompt("what is  the capital of France?", "stop", seen, 16)  # a repeat, case and spaces aside
    assert not keep_prompt("Tell me a story about a dragon", "length", seen, 16)  # cut by max_tokens
    assert not keep_prompt("Hi there", "stop", seen, 16)  # too short
    assert keep_prompt("Tell me a story about a dragon", "stop", seen, 16)


@pytest.mark.parametrize("bad", [{"num": 0}, {"temperature": 0.0}, {"max_batch": 0}, {"top_p": 1.5}])
def test_self_prompt_config_refuses_nonsense(bad):
    with pytest.raises(SpecdraftError):
        SelfPromptConfig(**bad)


def test_self_prompts_keep_what_the_target_wrote_and_ended(tmp_path):
    """Each kept prompt is the target's own sampled continuation of the prefix (its index's seed), in the order
    drawn, among those it ended itself; the file written is one `distill` reads back."""
    target = tiny_model(seed=3, vocab=VOCAB)
    tokenizer = ToyTokenizer(VOCAB, eos=EOS)
    prefix = [5, 6, 7]
    config = SelfPromptConfig(num=24, max_tokens=12, min_chars=2, max_batch=1, seed=1)
    kept, counts = self_prompts(target, tokenizer, config, prefix=prefix, progress=False)

    alone = Engine(target, tokenizer, None, 0, AdaptiveConfig(enabled=False))
    seen: set[str] = set()
    expected, finishes = [], []
    for i in range(config.num):
        result = alone.generate(prefix, config.params(i))
        finishes.append(result.finish_reason)
        if keep_prompt(result.text.strip(), result.finish_reason, seen, config.min_chars):
            expected.append(result.text.strip())
    assert kept == expected
    assert 0 < len(kept) < config.num and "length" in finishes  # the test exercises both sides of the filter
    assert counts["drawn"] == 24 and counts["kept"] == len(kept)

    path = tmp_path / "prompts.jsonl"
    write_prompts(path, kept)
    assert read_prompts(path) == kept
    assert all(json.loads(line)["source"] == "self" for line in path.read_text().splitlines())
    assert not (tmp_path / "prompts.jsonl.tmp").exists()


def test_self_prompts_cli_refuses_a_base_model_before_loading_it(tmp_path, capsys):
    from specdraft.cli import main

    out = tmp_path / "p.jsonl"
    assert main(["self-prompts", "--model", "gemma3-270m", "--out", str(out), "--num", "2"]) == 2
    assert "no chat template" in capsys.readouterr().err and not out.exists()
