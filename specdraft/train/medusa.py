"""Training Medusa-1 heads on the target's own outputs (`specdraft train medusa`).

Each step takes the final-normed hidden states h_t of a batch of sequences (the target's own responses, from
`specdraft distill`: recorded while it generated them, or recomputed with one cache-free target forward) and
the target's distributions (train/features.py). Head k (1-based) at row t learns the target's distribution
at row t + k (which predicts token t + k + 1, the token head k guesses from h_t), restricted to the draft
vocabulary and renormalised (at positions whose target argmax is in it, where that argmax is known exactly);
head k weighs 0.8**(k-1). The loop (seeded batches, checkpoints that resume bit for
bit, curves) is `train/loop.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.drafters.medusa import MedusaConfig, MedusaHeads
from specdraft.drafters.shipped import target_signature
from specdraft.runtime.model import Transformer
from specdraft.train.features import (
    FINAL,
    draft_distribution,
    draft_readout,
    full_readout,
    item_positions,
    item_tokens,
    mixed_precision,
    target_argmax,
    target_batch,
    training_items,
)
from specdraft.train.loop import LoopConfig, draft_vocabulary, held_out_agreement, train_loop

HEAD_WEIGHT = 0.8


@dataclass
class MedusaTrainConfig(LoopConfig):
    """Medusa heads' training: the loop's settings (a higher learning rate) and the number of heads."""

    lr: float = 1e-3
    heads: int = 4


class _Batch:
    """The heads' inputs and the target's answers for one batch (recorded features, or one target forward),
    without gradients; `full_readout` as in train/eagle.py (exact argmax and the draft-vocabulary mask)."""

    def __init__(self, target: Transformer, heads: MedusaHeads, items: Sequence, readout: torch.Tensor,
                 full_readout: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            tb = target_batch(target, items, [FINAL])
            self.hidden = tb.hidden[FINAL]
            self.soft = draft_distribution(target, tb, readout, heads.draft_to_target)
            if tb.logits is not None or full_readout is not None:
                self.target_argmax = target_argmax(target, tb, full_readout)
                self.in_vocab = heads.t2d[self.target_argmax]
            else:
                self.target_argmax = heads.draft_to_target[self.soft.argmax(-1)]
                self.in_vocab = torch.ones_like(self.target_argmax, dtype=torch.bool)
        self.lengths = tb.lengths
        self.rows = tb.rows

    def valid(self, k: int) -> torch.Tensor:
        """[B, rows]: head k's prediction at row t is real when the target's token t+k is known."""
        t = torch.arange(self.rows, device=self.lengths.device)[None, :]
        return t + k < self.lengths[:, None]


def medusa_losses(heads: MedusaHeads, batch: _Batch) -> tuple[torch.Tensor, list[float], list[float], list[float]]:
    """(weighted loss, per-head losses, per-head accuracies in the trained positions, per-head top-1 agreement
    with the target over all real positions)."""
    with mixed_precision(batch.hidden.device):
        logits = heads(batch.hidden)  # [B, T, K, V']
    total = torch.zeros((), device=batch.hidden.device)
    losses, accs, agree = [], [], []
    for k in range(1, heads.medusa.num_heads + 1):
        rows = batch.rows - k
        if rows <= 0:
            losses.append(0.0)
            accs.append(0.0)
            agree.append(0.0)
            continue
        real = batch.valid(k)[:, :rows]
        mask = real & batch.in_vocab[:, k:]
        log_probs = torch.log_softmax(logits[:, :rows, k - 1].float(), -1)
        per_row = -(batch.soft[:, k:] * log_probs).sum(-1)
        n = mask.sum().clamp(min=1)
        loss = (per_row * mask).sum() / n
        total = total + HEAD_WEIGHT ** (k - 1) * loss
        hits = heads.draft_to_target[log_probs.argmax(-1)] == batch.target_argmax[:, k:]
        losses.append(float(loss.detach()))
        accs.append(float((hits & mask).sum() / n))
        agree.append(float((hits & real).sum() / real.sum().clamp(min=1)))
    return total, losses, accs, agree


def new_heads(target: Transformer, config: MedusaTrainConfig, train_seqs: Sequence[Sequence[int]]) -> MedusaHeads:
    vocab = target.config.vocab_size
    size = min(config.draft_vocab or vocab, vocab)
    heads = MedusaHeads(MedusaConfig(target.config.hidden_size, vocab, size, config.heads))
    heads.set_draft_vocab(draft_vocabulary(train_seqs, size, vocab))
    heads.init_from_target(target)
    return heads.float().requires_grad_(True)


def evaluate(target: Transformer, heads: MedusaHeads, items: Sequence, config: MedusaTrainConfig,
             readout: torch.Tensor, full: torch.Tensor) -> list[float]:
    """Top-1 agreement with the target (its argmax over the whole vocabulary) per head over held-out
    sequences."""
    def score(chunk: list) -> tuple[list[float], list[float]]:
        batch = _Batch(target, heads, chunk, readout, full)
        agree = medusa_losses(heads, batch)[3]
        return agree, [float(batch.valid(k).sum()) for k in range(1, len(agree) + 1)]

    return held_out_agreement(items, config, config.heads, score)


def train_medusa(target: Transformer, train_items: Sequence, val_items: Sequence, out_dir: str | Path,
                 config: MedusaTrainConfig | None = None, resume: bool = False, stop_after: int | None = None,
                 progress: bool = True, target_info: dict | None = None) -> tuple[MedusaHeads, dict]:
    """Train (or resume training) Medusa heads on token sequences or (sequence, recorded features) pairs;
    returns them and the history. The finished heads are saved in out_dir (loadable as `medusa:DIR`)."""
    config = config or MedusaTrainConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_items = training_items(train_items, config.seq_len)
    heads = new_heads(target, config, [item_tokens(item) for item in train_items]).to(target.device)
    heads.medusa.target.update({**(target_info or {}), "signature": target_signature(target)})
    readout = draft_readout(target, heads.draft_to_target)
    full = full_readout(target) if val_items else None

    def step_losses(items: list) -> tuple[torch.Tensor, list[float], list[float]]:
        loss, losses, accs, _ = medusa_losses(heads, _Batch(target, heads, items, readout))
        return loss, losses, accs

    history = train_loop(heads, config, train_items, [item_positions(item) for item in train_items], step_losses,
                         (lambda: evaluate(target, heads, val_items, config, readout, full)) if val_items else None,
                         out_dir, lambda: heads.cpu().save(out_dir, dtype=target.dtype), resume, stop_after, progress,
                         desc="train medusa")
    return heads, history


__all__ = ["MedusaTrainConfig", "medusa_losses", "train_medusa"]
