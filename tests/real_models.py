"""The bundled real models with plain greedy references, for drafters shipped for them."""

from __future__ import annotations

from specdraft.engine.core import Engine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams


def greedy_reference(model_name: str, dev_prompts: list[dict], max_tokens: int):
    """(target, tokenizer, prompts, plain greedy outputs, params) on two dev prompts cut to 160 tokens."""
    target = load_model(model_name, progress=False)
    tokenizer = load_tokenizer(model_name, progress=False)
    prompts = [tokenizer.prompt_ids(row["turns"][0], chat=tokenizer.has_chat_template)[:160]
               for row in dev_prompts[::40][:2]]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    plain = Engine(target, tokenizer, None, 0, max_model_len=512)
    return target, tokenizer, prompts, [plain.generate(ids, params).token_ids for ids in prompts], params
