"""`self:N`: early-exit self-drafting. The target's first N layers, then its final norm and LM head.

Training-free and free in memory (it *is* the target, cut short); its keys/values for the prompt are exactly
the target's, so they are copied rather than recomputed. How well an untrained early exit predicts the full
model varies a lot by model and depth: measure it (`specdraft bench`) before relying on it.
"""

from __future__ import annotations

from specdraft.drafters.draft_model import ModelDrafter
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer


def make_self_drafter(target: Transformer, num_layers: int, max_len: int = 4096,
                      min_confidence: float = 0.0, max_batch: int = 1) -> ModelDrafter:
    total = target.config.num_layers
    if not 1 <= num_layers < total:
        raise SpecdraftError(f"self:N needs 1 <= N < {total} (the target has {total} layers), got {num_layers}")
    return ModelDrafter(target, name=f"self:{num_layers}", exit_layer=num_layers, max_len=max_len,
                        min_confidence=min_confidence, share_prompt_cache=True, max_batch=max_batch)
