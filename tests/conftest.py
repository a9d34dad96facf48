"""Shared fixtures: the dev prompts and the bundled models (our runtime, the transformers reference, tokenizers).

Model fixtures are module-scoped: each file that needs a model loads it once, and a parametrized module fixture
is torn down before the next model is loaded, so at most one model family is in memory at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

DEV_PROMPTS = Path(__file__).resolve().parents[2] / "shared/data/specbench-dev.jsonl"
BUNDLED_MODELS = ("smollm2-135m", "gemma3-270m")


@pytest.fixture(scope="session")
def dev_prompts() -> list[dict]:
    """Spec-Bench dev prompts: dicts with `question_id`, `category`, `turns`."""
    if not DEV_PROMPTS.exists():  # CI always has it: a missing suite is a broken checkout, not a reason to skip
        pytest.fail(f"dev prompts not found: {DEV_PROMPTS} (expected in ../shared/data next to the repo)")
    return [json.loads(line) for line in DEV_PROMPTS.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module", params=BUNDLED_MODELS)
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def fp32_model(model_name):
    from specdraft.runtime import load_model

    return load_model(model_name, dtype="fp32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def bf16_model(model_name):
    from specdraft.runtime import load_model

    return load_model(model_name, dtype="bf16", device="cpu", progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_name):
    from specdraft.runtime import load_tokenizer

    return load_tokenizer(model_name, progress=False)


@pytest.fixture(scope="module")
def hf_model(model_name):
    """transformers' own implementation in fp32 on the same converted weights: the reference."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdraft.runtime import resolve

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            resolve(model_name, progress=False), dtype=torch.float32, attn_implementation="eager"
        )
    finally:
        hf_logging.enable_progress_bar()
    return model.eval()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from specdraft.runtime import load_tokenizer

    return load_tokenizer("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from specdraft.runtime import load_tokenizer

    return load_tokenizer("gemma3-270m", progress=False)
