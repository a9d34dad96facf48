"""The target's side of a training batch: its features and its distributions over the draft vocabulary.

A head trains on the target's hidden states (EAGLE-3: three residual streams; Medusa: the final-normed
output) and learns the target's next-token distribution, restricted to the head's draft vocabulary. Both come
either from what `specdraft distill` recorded while generating (no target forward at training time) or, for
data without recorded features, from one cache-free `forward_sequence` per batch.

An item of training data is a token sequence, or a `(sequence, {layer: [positions, dim]})` pair with recorded
features for its first positions. `TargetBatch.lengths` counts, per sequence, the positions whose features and
distributions are known (a recorded sequence of n tokens usually has n - 2: see train/distill.py).

The soft labels come from the final-normed hidden state through the target's own lm_head rows of the draft
vocabulary (soft-capped as the target's logits are), which is the target's distribution over the draft
vocabulary renormalised, at a fraction of the full head's cost (Gemma-3's full head is 168M parameters).
Where the full-vocabulary argmax is needed (validation agreement, and masking positions whose target token
is not in the draft vocabulary), `target_argmax` computes the whole head, in chunks of rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdraft.errors import SpecdraftError
from specdraft.runtime.cpu_kernels import bf16_gemm_is_native
from specdraft.runtime.model import Transformer

FINAL = -1
HEAD_CHUNK = 2048  # rows of the full head computed at once (memory: rows x vocab fp32)


def item_tokens(item) -> list[int]:
    return item[0] if isinstance(item, tuple) else item


def item_length(item) -> int:
    return len(item_tokens(item))


def cut(item, seq_len: int):
    """The item's first `seq_len` tokens (and features)."""
    if isinstance(item, tuple):
        seq, feats = item
        return list(seq[:seq_len]), {layer: f[:seq_len] for layer, f in feats.items()}
    return list(item[:seq_len])


def item_positions(item) -> int:
    """Positions of an item whose target features are known (all of a plain sequence's)."""
    return len(item[1][FINAL]) if isinstance(item, tuple) else len(item)


def training_items(items: Sequence, seq_len: int) -> list:
    """The items cut to `seq_len`, without those too short to train on (fewer than 2 known positions)."""
    kept = [it for it in (cut(item, seq_len) for item in items) if item_positions(it) >= 2]
    if not kept:
        raise SpecdraftError("no training sequences with at least 2 positions")
    return kept


@dataclass
class TargetBatch:
    tokens: torch.Tensor  # [B, T + extra] long, zero-padded
    lengths: torch.Tensor  # [B]: positions with known features and distributions
    hidden: dict[int, torch.Tensor]  # {layer: [B, T, dim]} fp32 (FINAL: final-normed)
    logits: torch.Tensor | None = None  # [B, T, vocab] in the target's dtype when a target forward computed them

    @property
    def rows(self) -> int:
        return self.hidden[FINAL].shape[1]


def target_batch(target: Transformer, items: Sequence, layers: Sequence[int], extra_tokens: int = 0) -> TargetBatch:
    """Stack recorded features, or compute them with one target forward when the items have none; on the
    target's device (training on a GPU keeps the whole batch there)."""
    seqs = [item_tokens(item) for item in items]
    device = target.device
    T = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), T + extra_tokens, dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = torch.tensor(s)
    layers = sorted(set(layers) | {FINAL})
    if all(isinstance(item, tuple) for item in items):
        feats = [item[1] for item in items]
        lengths = torch.tensor([len(f[FINAL]) for f in feats])
        rows = int(lengths.max())
        dim = feats[0][FINAL].shape[-1]
        hidden = {}
        for layer in layers:
            out = torch.zeros(len(items), rows, dim)
            for b, f in enumerate(feats):
                out[b, :len(f[layer])] = f[layer].float()
            hidden[layer] = out.to(device)
        return TargetBatch(tokens.to(device), lengths.to(device), hidden)
    if any(isinstance(item, tuple) for item in items):
        raise ValueError("a batch mixes sequences with and without recorded features")
    capture = [layer for layer in layers if layer != FINAL]
    with torch.no_grad():
        out = target.forward_sequence(tokens[:, :T].to(device), capture_layers=capture)
    hidden = {FINAL: out.hidden.float()}
    for layer in capture:
        hidden[layer] = out.captured[capture.index(layer)].float()
    # The logits stay in the model's dtype: the soft labels need only the draft vocabulary's columns in fp32,
    # and an argmax is the same over bf16 values as over their exact fp32 copies. This spares a whole-vocabulary
    # fp32 copy (6.4 GB for 32 x 1024 tokens of SmolLM2 on a GPU); on 2 CPU cores the step time did not
    # change measurably (8 x 437 tokens: medians 4.73 s against 4.67 s, runs vary by 1 s; same losses).
    return TargetBatch(tokens.to(device), torch.tensor([len(s) for s in seqs], device=device), hidden, out.logits)


def mixed_precision(device: torch.device) -> torch.autocast:
    """bf16 matrix products with fp32 weights and fp32 losses on GPUs and where the CPU multiplies bf16 in
    hardware (AVX512-BF16, AMX): a head's products run several times faster there than in fp32."""
    enabled = device.type == "cuda" or (device.type == "cpu" and bf16_gemm_is_native())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def draft_readout(target: Transformer, draft_to_target: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows of the draft vocabulary, fp32 [draft_vocab, dim], on the target's device."""
    return target.lm_head.weight.detach()[draft_to_target.to(target.lm_head.weight.device)].float()


def _softcap(target: Transformer, logits: torch.Tensor) -> torch.Tensor:
    cap = target.config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


def draft_distribution(target: Transformer, batch: TargetBatch, readout: torch.Tensor,
                       draft_to_target: torch.Tensor) -> torch.Tensor:
    """[B, T, draft_vocab]: the target's next-token distribution at every row, over the draft vocabulary."""
    if batch.logits is not None:
        logits = batch.logits[..., draft_to_target].float()
    else:
        logits = _softcap(target, batch.hidden[FINAL] @ readout.T)
    return torch.softmax(logits, dim=-1)


def full_readout(target: Transformer) -> torch.Tensor:
    """The target's whole lm_head, fp32 [vocab, dim] (make it once: Gemma-3's is 670 MB in fp32)."""
    return target.lm_head.weight.detach().float()


def target_argmax(target: Transformer, batch: TargetBatch, readout: torch.Tensor) -> torch.Tensor:
    """[B, T]: the target's argmax over its whole vocabulary at every row (`readout`: `full_readout`),
    computed in chunks of rows."""
    if batch.logits is not None:
        return batch.logits.argmax(-1)
    final = batch.hidden[FINAL]
    flat = final.reshape(-1, final.shape[-1])
    weight = readout
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    with torch.no_grad():
        for i in range(0, flat.shape[0], HEAD_CHUNK):
            out[i:i + HEAD_CHUNK] = _softcap(target, flat[i:i + HEAD_CHUNK] @ weight.T).argmax(-1)
    return out.view(final.shape[:2])


__all__ = ["FINAL", "TargetBatch", "cut", "draft_distribution", "draft_readout", "full_readout", "item_length",
           "item_positions", "item_tokens", "mixed_precision", "target_argmax", "target_batch", "training_items"]
