"""Tiny random-weight models and a toy tokenizer: fast stand-ins for engine and verifier tests."""

from __future__ import annotations

import torch

from specdraft.runtime.config import ModelConfig
from specdraft.runtime.model import Transformer


def tiny_config(vocab: int = 16, layers: int = 2, hidden: int = 32, gemma: bool = False) -> ModelConfig:
    raw = {
        "model_type": "gemma3_text" if gemma else "llama",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": None,
    }
    if gemma:
        raw.update(sliding_window=4, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                   hidden_activation="gelu_pytorch_tanh")
    return ModelConfig.from_hf_dict(raw)


def tiny_model(seed: int = 0, scale: float = 1.0, dtype: torch.dtype = torch.float32, **kwargs) -> Transformer:
    """Random weights scaled so that next-token distributions are neither flat nor one-hot."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.zeros_like(p) if model.config.is_gemma else torch.ones_like(p))
            else:
                p.normal_(0.0, 0.3 * scale)
    return model.to(dtype).eval()


def recycle_drafter(table_seed: int | None = None, vocab: int = 16):
    """A `recycle` drafter for a toy vocabulary, with an n-gram table counted from random text (or none)."""
    from specdraft.drafters.recycle import NgramTable, RecycleDrafter

    table = None
    if table_seed is not None:
        g = torch.Generator().manual_seed(table_seed)
        table = NgramTable.build([(torch.randint(0, vocab, (300,), generator=g).tolist(), 0)], top=3, min_count=1)
    return RecycleDrafter(table)


class ToyTokenizer:
    """Token i is the letter chr(97 + i); `eos` (optional) ends generation."""

    def __init__(self, vocab: int = 16, eos: int | None = None) -> None:
        self.vocab = vocab
        self.eos_token_ids = frozenset() if eos is None else frozenset({eos})
        self.has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(97 + int(i)) for i in ids if int(i) not in self.eos_token_ids)
