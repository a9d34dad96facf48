"""Prompts a chat target writes itself, for distillation data like what it is asked in use (Magpie).

Given only its chat template up to where a user message starts, an instruction-tuned model writes a user
message, drawn from what it was tuned on (Xu et al., 2024, arXiv:2406.08464). A draft head learns to predict
the target's answers, and it learns most from answers to prompts like those the target meets in use: chat
questions, rewriting, explanations, plans. A prompt file from another task mix (T0's classification and
extraction templates, say) teaches it answers of another kind. `specdraft self-prompts` writes such a file;
`specdraft distill --prompts` reads it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer
from specdraft.train.data import write_text_atomically
from specdraft.verify.sampling import SamplingParams

SENTINEL = "\ue000"  # a private-use character: no template writes it, so it marks where the content goes
SOURCE = "self"


@dataclass
class SelfPromptConfig:
    """`num` messages are drawn (fewer are kept: see `keep_prompt`), `max_batch` at a time, each with its own
    seed (`seed` * 1,000,003 + its index), so a run is reproducible and a larger `num` extends a smaller."""

    num: int = 2000
    max_tokens: int = 160
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    max_batch: int = 32
    min_chars: int = 16

    def __post_init__(self) -> None:
        if self.num < 1 or self.max_tokens < 1 or self.max_batch < 1:
            raise SpecdraftError("num, max_tokens and max_batch must be at least 1")
        if self.temperature <= 0:
            raise SpecdraftError(f"self-written prompts are sampled: temperature must be > 0, got {self.temperature}")
        self.params(0)  # top_p and the rest checked now, before any weights load

    def params(self, index: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=self.seed * 1_000_003 + index)


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's token ids up to where a user message's text starts (its default system prompt, if
    it writes one, included)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise SpecdraftError("the model has no chat template (a base model): self-written prompts need a chat "
                             "model; give a base model a prompt file")
    text = tokenizer.hf.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                            add_generation_prompt=False)
    return tokenizer.encode(text[:text.index(SENTINEL)], add_special_tokens=False)


def prompt_key(text: str) -> str:
    """What two prompts share when one repeats the other: their first 64 characters, case and spacing aside."""
    return " ".join(text.lower().split())[:64]


def keep_prompt(text: str, finish_reason: str, seen: set[str], min_chars: int) -> bool:
    """A message the target ended itself (not cut by max_tokens), of at least `min_chars` characters, and not
    a repeat of one already kept (`seen` gains its key)."""
    key = prompt_key(text)
    if finish_reason != "stop" or len(text) < min_chars or key in seen:
        return False
    seen.add(key)
    return True


def self_prompts(target: Transformer, tokenizer, config: SelfPromptConfig | None = None,
                 prefix: Sequence[int] | None = None, progress: bool = True) -> tuple[list[str], dict]:
    """The prompts kept, in the order drawn, and counts (drawn, kept, tokens, seconds). `prefix`: the ids to
    continue (default: `user_turn_prefix(tokenizer)`)."""
    config = config or SelfPromptConfig()
    prefix = list(prefix) if prefix is not None else user_turn_prefix(tokenizer)
    engine = Engine(target, tokenizer, None, 0, AdaptiveConfig(enabled=False), max_batch=config.max_batch)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.num, desc="self-prompts", unit="prompt", dynamic_ncols=True)
    start = time.perf_counter()
    try:
        results = engine.generate_many([prefix] * config.num, [config.params(i) for i in range(config.num)],
                                       on_result=(lambda _i, _result: bar.update(1)) if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    seen: set[str] = set()
    kept = []
    for result in results:
        text = result.text.strip()
        if keep_prompt(text, result.finish_reason, seen, config.min_chars):
            kept.append(text)
    tokens = sum(len(r.token_ids) for r in results)
    return kept, {"drawn": config.num, "kept": len(kept), "tokens": tokens, "seconds": round(seconds, 1)}


def write_prompts(path: str | Path, prompts: Sequence[str]) -> None:
    """One `{"source": "self", "prompt": ...}` line each, written whole or not at all (an interrupted run
    leaves no half file for `distill` to read)."""
    write_text_atomically(path, "".join(json.dumps({"source": SOURCE, "prompt": text}, ensure_ascii=False) + "\n"
                                        for text in prompts))
