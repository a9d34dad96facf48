"""Any transformers causal LM as a target (`backend="transformers"`), for architectures the runtime lacks.

`HFTarget` answers the calls the engine makes on the runtime's `Transformer`: score tokens appended after
each slot's committed length without committing them, optionally as a token tree (positions by depth, a
tree mask), and hand out a cache that rolls back. The cache (`HFCache`) keeps one transformers
`DynamicCache` per slot and a committed length per slot: a forward appends its keys and values, `commit`
only moves the length, and the entries past it are cut off before the slot's next forward (`crop`), which
is the rollback; `compact` gathers an accepted tree path behind the committed part.

Chains run through the model's own masking, so every architecture's attention (sliding windows included)
is exactly what its own `generate` does. A token tree passes a custom additive 4D mask (per layer type
for models such as Gemma 3 that mix full and sliding-window layers). Rows of a batch run one forward each
(slots hold different lengths): this is the compatible path, not the fast one, and it is checked against
transformers' own greedy decoding in the tests.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdraft.errors import ModelLoadError
from specdraft.runtime.kv_cache import SlotLengths


@dataclass(frozen=True)
class HFConfig:
    """The model numbers the engine reads (the runtime `ModelConfig`'s names)."""

    model_type: str
    vocab_size: int
    num_layers: int
    max_position_embeddings: int


class HFCache(SlotLengths):
    """Per-slot transformers caches behind committed lengths (see the module docstring)."""

    def __init__(self, max_len: int, num_slots: int = 1) -> None:
        from transformers import DynamicCache

        super().__init__(max_len, num_slots)
        self._new = DynamicCache
        self.caches = [DynamicCache() for _ in range(num_slots)]

    def reset(self, slot: int | None = None) -> None:
        super().reset(slot)
        for s in range(self.num_slots) if slot is None else [slot]:
            self.caches[s] = self._new()

    def stored(self, slot: int) -> int:
        return self.caches[slot].get_seq_length()

    def rolled_back(self, slot: int):
        """The slot's transformers cache cut to its committed length (what the next forward extends)."""
        cache = self.caches[slot]
        extra = cache.get_seq_length() - self.lengths[slot]
        if extra > 0:
            cache.crop(-extra)
        return cache

    def compact(self, slot: int, src_offsets: Sequence[int]) -> None:
        """Move uncommitted entries at committed+src_offsets[i] to committed+i, then commit them."""
        start = self.lengths[slot]
        keep = torch.cat([torch.arange(start), torch.tensor(src_offsets, dtype=torch.long) + start])
        for layer in self.caches[slot].layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, keep.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, keep.to(layer.values.device))
        self.commit(slot, start + len(src_offsets))


class HFTarget:
    """A transformers `AutoModelForCausalLM` behind the runtime model's forward signature."""

    native_report = None  # no GGUF-native weights

    def __init__(self, model, source: str = "") -> None:
        self.model = model.eval()
        self.source = source
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.hf_config = cfg
        layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or 0
        positions = (getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
                     or 4096)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.config = HFConfig(str(getattr(cfg, "model_type", "")), int(vocab), int(layers), int(positions))
        # transformers 5 renames `past_key_values` to `cache` (the old name is deprecated, then removed).
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reuses_cache_entries(self, cache: HFCache, prompt_tokens: int) -> bool:
        """False: transformers' entries depend on how a sequence was batched, so none are copied between
        prompts (see `Transformer.reuses_cache_entries`)."""
        return False

    def new_cache(self, max_len: int, num_slots: int = 1) -> HFCache:
        return HFCache(max_len, num_slots)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: HFCache, slots: Sequence[int] | None = None,
                positions: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                logits_from: int = 0, return_hidden: bool = False, capture_layers: Sequence[int] = (),
                lengths: Sequence[int] | None = None, **unsupported) -> torch.Tensor:
        """Logits [B, T - logits_from, vocab] of `tokens` [B, T] appended after each slot's committed
        length (nothing committed); `positions` and `tree_mask` as in `Transformer.forward` (`lengths` is
        accepted and the padding computed anyway)."""
        if return_hidden or capture_layers or any(v is not None for v in unsupported.values()):
            asked = sorted(["hidden states"] * bool(return_hidden or capture_layers)
                           + [k for k, v in unsupported.items() if v is not None])
            raise NotImplementedError(f"the transformers backend does not provide {', '.join(asked)}")
        B, T = tokens.shape
        slots = list(range(B)) if slots is None else list(slots)
        cache.check_room(slots, T)
        out = []
        for b, slot in enumerate(slots):
            past = cache.rolled_back(slot)
            start = cache.length(slot)
            storage = torch.arange(start, start + T, device=self.device)
            pos = positions[b:b + 1].to(self.device) if positions is not None else storage[None]
            mask = None
            if tree_mask is not None:
                visible = tree_mask if tree_mask.dim() == 2 else tree_mask[b]
                mask = self._tree_masks(start, pos[0], visible.to(self.device))
            result = self.model(input_ids=tokens[b:b + 1].to(self.device), use_cache=True, position_ids=pos,
                                cache_position=storage, attention_mask=mask, logits_to_keep=T - logits_from,
                                **{self._cache_kwarg: past})
            out.append(result.logits[0, -(T - logits_from):])
        return torch.stack(out)

    def _tree_masks(self, start: int, positions: torch.Tensor, visible: torch.Tensor):
        """Additive [1, 1, T, start + T] masks: every committed key (within a sliding window, on its
        layers) and the new tokens `visible` allows. A dict by layer type where the model mixes them."""
        T = positions.shape[0]
        seen = torch.ones(T, start + T, dtype=torch.bool, device=positions.device)
        seen[:, start:] = visible
        key_pos = torch.cat([torch.arange(start, device=positions.device), positions])
        masks = {"full_attention": seen}
        window = getattr(self.hf_config, "sliding_window", None)
        if window:
            masks["sliding_attention"] = seen & (positions[:, None] - key_pos[None, :] < window)
        floor = torch.finfo(self.dtype).min
        additive = {kind: torch.where(m, 0.0, floor).to(self.dtype)[None, None] for kind, m in masks.items()}
        types = set(getattr(self.hf_config, "layer_types", None) or [])
        if len(types) > 1:
            return {kind: additive[kind] for kind in types}
        kind = next(iter(types)) if types else "full_attention"
        if kind == "sliding_attention" or (not types and window and getattr(self.hf_config, "use_sliding_window",
                                                                          True)):
            return additive.get("sliding_attention", additive["full_attention"])
        return additive["full_attention"]


def load_hf_target(ref: str, dtype: str | torch.dtype | None = "auto", device: str | torch.device | None = None,
                   progress: bool = True) -> HFTarget:
    """Load a model reference (catalog name, Hugging Face directory, .gguf file: `loader.resolve`) with
    transformers, whatever its architecture. dtype "auto" is fp32 (the reference precision; transformers'
    bf16 on CPU is no faster here); "gguf" is refused (transformers dequantizes GGUF files)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdraft.runtime.loader import NATIVE, default_device, parse_dtype, resolve

    if dtype == NATIVE:
        raise ModelLoadError("dtype 'gguf' needs the specdraft backend; the transformers backend runs dense weights")
    torch_dtype = torch.float32 if dtype in (None, "auto") else parse_dtype(dtype)
    path = resolve(ref, progress)
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    except Exception as exc:  # transformers raises many kinds for unknown or damaged checkpoints
        raise ModelLoadError(f"transformers could not load {path}: {type(exc).__name__}: {exc}") from exc
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    return HFTarget(model.to(torch.device(device) if device else default_device()), str(path))


__all__ = ["HFCache", "HFConfig", "HFTarget", "load_hf_target"]
