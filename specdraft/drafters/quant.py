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
    with torch.device("meta"):
        draft = Transformer(target.config)
    # Shares the target's tensors (no copy); quantization below swaps in new linear modules for the draft only.
    native = getattr(target, "native_report", None) is not None
    draft.load_state_dict(target.state_dict(), assign=True, strict=not native)
    if native:
        _dense_from_native(draft, target)
    draft.init_rope_tables(target.device)
    meta = [name for name, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if meta:
        raise SpecdraftError(f"quant:int{bits}: the target gave no weights for {', '.join(meta[:4])}")
    return quantize_linears(draft, bits, group_size=group_size)


def _dense_from_native(draft: Transformer, target: Transformer) -> None:
    """Give a draft built on a GGUF-native target (dtype gguf) the target's own weights: its embedding module
    (shared), and each linear layer's weights dequantized to bf16 (the file's values, rounded as the bf16
    model holds them), for `quantize_linears` to quantize. Such a draft reads about as many bytes a step as
    the target (int8: more), so the adaptive controller finds it does not pay; it is offered so that every
    drafter runs on every target, and measured."""
    from specdraft.runtime.gguf_native import GGUFLinear

    draft.embed = target.embed
    for name, module in target.named_modules():
        if isinstance(module, GGUFLinear):
            dense = draft.get_submodule(name)
            dense.weight = torch.nn.Parameter(module.dequantize(torch.bfloat16), requires_grad=False)


def make_quant_drafter(target: Transformer, bits: int, max_len: int = 4096, min_confidence: float = 0.0,
                       group_size: int = 128, max_batch: int = 1) -> ModelDrafter:
    return ModelDrafter(quantized_copy(target, bits, group_size), name=f"quant:int{bits}", max_len=max_len,
                        min_confidence=min_confidence, share_prompt_cache=True, max_batch=max_batch)
