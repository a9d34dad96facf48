"""`quant:int4` / `quant:int8`: the target's own weights, quantized weight-only, as the draft model.

No training and no second checkpoint: same tokenizer, same architecture, about a quarter of the weight bytes
per step (int4), and it agrees with the target almost always. Embeddings and norms are shared with the
target; every linear layer (the LM head included) is replaced by its quantized version.
"""

from __future__ import annotations

import torch

from specdraft.drafters.draft_model import ModelDrafter
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer
from specdraft.runtime.quant import quant_supported, quantize_linears


def quantized_copy(target: Transformer, bits: int, group_size: int = 128) -> Transformer:
    """A new Transformer sharing the target's embedding and norms, with quantized linear layers."""
    if bits not in (4, 8):
        raise SpecdraftError(f"quant drafter supports int4 and int8, not int{bits}")
    if target.device.type != "cpu":
        raise SpecdraftError("quant:int4/int8 use torch's CPU weight-only kernels; on GPU use self:N or a draft model")
    if not quant_supported(bits):
        raise SpecdraftError(f"this torch build lacks the int{bits} weight-only CPU kernel")
    if getattr(target, "native_report", None) is not None:
        raise SpecdraftError(f"quant:int{bits} quantizes a dense target; this one already runs on its GGUF "
                             "blocks (dtype gguf), which read no more bytes than an int8/int4 copy would: draft "
                             "with ngram, eagle or self:N, or load the target in bf16")
    with torch.device("meta"):
        draft = Transformer(target.config)
    # Shares the target's tensors (no copy); quantization below swaps in new linear modules for the draft only.
    draft.load_state_dict(target.state_dict(), assign=True)
    draft.init_rope_tables(target.device)
    return quantize_linears(draft, bits, group_size=group_size)


def make_quant_drafter(target: Transformer, bits: int, max_len: int = 4096, min_confidence: float = 0.0,
                       group_size: int = 128, max_batch: int = 1) -> ModelDrafter:
    return ModelDrafter(quantized_copy(target, bits, group_size), name=f"quant:int{bits}", max_len=max_len,
                        min_confidence=min_confidence, share_prompt_cache=True, max_batch=max_batch)
