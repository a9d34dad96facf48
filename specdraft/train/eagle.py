"""Training an EAGLE-3 head on the target's own features (`specdraft train eagle`).

Each step takes a batch of token sequences (the target's own responses, from `specdraft distill`) with the
target's features (the three aux streams and the final-normed output: recorded while the target generated
them, or recomputed with one cache-free `forward_sequence`; see train/features.py), and unrolls the head for
`ttt_steps` draft steps (training-time test, EAGLE-3):
step 0 reads the target's fused features, step s > 0 the head's own step s-1 outputs, so the head learns
on the inputs it sees when drafting. Step s at row t predicts token t+2+s; its loss is the cross-entropy
against the target's distribution there restricted to the draft vocabulary (renormalised), at positions
whose target argmax is in the draft vocabulary where that argmax is known (recomputed features; recorded
ones train every position, see features.py); step s weighs 0.8**s (EAGLE-3's weights).

The EAGLE-1 variant (`variant="eagle1"`: the last layer's stream in, fc the identity, the target's final norm
and lm_head rows frozen) adds EAGLE-1's feature regression: step s at row t also learns the target's own
feature at position t+1+s (smooth L1 on RMS-normalised vectors: `feature_loss`), and its token loss weighs
0.1 (EAGLE-1's weights).

The head starts from a fixed seed; the loop (seeded batches, AdamW, checkpoints that resume bit for bit,
validation, curves) is `train/loop.py`'s. The output directory gets the head (`config.json` +
`model.safetensors`, loadable as `eagle:DIR`), `history.json`, `loss.png` and `accuracy.png`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdraft.drafters.eagle import EagleConfig, EagleHead
from specdraft.drafters.shipped import target_signature
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer
from specdraft.train.features import (
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

STEP_WEIGHT = 0.8
EAGLE1_TOKEN_WEIGHT = 0.1  # EAGLE-1: L = L_feature + 0.1 L_token


@dataclass
class TrainConfig(LoopConfig):
    """An EAGLE head's training: the loop's settings and the head's own."""

    ttt_steps: int = 3
    variant: str = "eagle3"  # or "eagle1" (see the module docstring)
    init_from_target: bool = True  # lm_head rows and final norm from the target's; fc passes the high stream
    init_head: str | None = None  # start from this trained head (its weights and draft vocabulary) instead


@dataclass
class TrainResult:
    head: EagleHead
    history: dict
    out_dir: Path


def new_head(target: Transformer, config: TrainConfig, train_seqs: Sequence[Sequence[int]]) -> EagleHead:
    if config.init_head is not None:
        return warm_start(target, config)
    vocab = target.config.vocab_size
    size = min(config.draft_vocab or vocab, vocab)
    head = EagleHead(EagleConfig.for_target(target, draft_vocab_size=size, variant=config.variant))
    head.init_weights(config.seed)
    head.set_draft_vocab(draft_vocabulary(train_seqs, size, vocab))
    if head.eagle.variant == "eagle1":
        with torch.no_grad():
            head.fc.weight.copy_(torch.eye(head.config.hidden_size))
            head.lm_head.weight.copy_(draft_readout(target, head.draft_to_target))
            head.norm.weight.copy_(target.norm.weight.float() + (1.0 if target.config.is_gemma else 0.0))
        return _trainable(head.float())
    if config.init_from_target:
        # A head that starts from the target's own readout of its high stream (fc passes it through, the
        # final norm and lm_head rows are the target's) begins near "predict like the target at the current
        # position" instead of confidently random: measured on SmolLM2-135M, the first loss 36 instead of 56.
        dim = head.config.hidden_size
        with torch.no_grad():
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, 2 * dim:] += torch.eye(dim)
            head.lm_head.weight.copy_(draft_readout(target, head.draft_to_target))
            if not target.config.is_gemma:
                head.norm.weight.copy_(target.norm.weight.float())
    return _trainable(head.float())


def _trainable(head: EagleHead) -> EagleHead:
    """Every weight trains but an EAGLE-1 head's fixed ones: fc (the identity) and the target's own final
    norm and lm_head rows, which read the head's output as a feature of the target's."""
    head.trainable()
    if head.eagle.variant == "eagle1":
        for p in (head.fc.weight, head.norm.weight, head.lm_head.weight):
            p.requires_grad_(False)
    return head


def warm_start(target: Transformer, config: TrainConfig) -> EagleHead:
    """A trained head to train further (more data, more steps), in fp32: its draft vocabulary stays, so
    `draft_vocab` must be unset or equal to it."""
    head = EagleHead.load(config.init_head)
    head.check_target(target)
    recorded = head.eagle.target.get("signature")
    if recorded is not None and recorded != target_signature(target):
        raise SpecdraftError(f"{config.init_head} was trained for another target ({recorded})")
    size = head.eagle.draft_vocab_size
    if config.draft_vocab not in (None, size):
        raise SpecdraftError(f"{config.init_head} drafts over {size} tokens; drop --draft-vocab or set it to {size}")
    if head.eagle.variant != config.variant:
        raise SpecdraftError(f"{config.init_head} is an {head.eagle.variant} head; train it as one "
                             f"(--variant {head.eagle.variant})")
    return _trainable(head.float())


class _Batch:
    """One batch: the head's inputs and the target's answers (recorded features, or one target forward), all
    without gradients. `full_readout` (the target's whole head) makes the target's argmax exact over its whole
    vocabulary, which masks positions whose target token the draft vocabulary lacks; without it (training on
    recorded features) the argmax is taken over the draft vocabulary and every position trains."""

    def __init__(self, target: Transformer, head: EagleHead, items: Sequence, steps: int, readout: torch.Tensor,
                 full_readout: torch.Tensor | None = None) -> None:
        layers = head.eagle.hidden_layers
        with torch.no_grad():
            tb = target_batch(target, items, layers, extra_tokens=steps)
            T = tb.rows
            self.aux = torch.cat([tb.hidden[layer] for layer in layers], dim=-1)[:, :T - 1]  # t needs token t+1
            # EAGLE-1 learns the stream it reads one position on: step s at row t, the feature at t+1+s
            self.features = tb.hidden[layers[-1]] if head.eagle.variant == "eagle1" else None
            self.embeds = target.embed_tokens(tb.tokens[:, 1:T + steps - 1]).float()
            self.soft = draft_distribution(target, tb, readout, head.draft_to_target)  # [B, T, draft vocab]
            if tb.logits is not None or full_readout is not None:
                self.target_argmax = target_argmax(target, tb, full_readout)
                self.in_vocab = head.t2d[self.target_argmax]
            else:
                self.target_argmax = head.draft_to_target[self.soft.argmax(-1)]
                self.in_vocab = torch.ones_like(self.target_argmax, dtype=torch.bool)
        self.rows = T - 1
        self.lengths = tb.lengths
        self.steps = steps

    def valid(self, s: int) -> torch.Tensor:
        """[B, rows]: step s at row t is real when the target's distribution at t+1+s is known."""
        t = torch.arange(self.rows, device=self.lengths.device)[None, :]
        return t + 1 + s < self.lengths[:, None]

    def target_rows(self, s: int) -> slice:
        return slice(1 + s, 1 + s + self.rows)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[1] >= rows:
        return x[:, :rows]
    pad = torch.zeros(x.shape[0], rows - x.shape[1], *x.shape[2:], dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def feature_loss(predicted: torch.Tensor, features: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """EAGLE-1's regression, smooth L1 between the head's outputs and the target's features [B, rows, dim]
    averaged over the real rows' elements, with each vector divided by its RMS first: whatever reads the
    output (the final norm, the next step's hidden_norm) sees only that, and it keeps EAGLE-1's 0.1 weighting
    of the token loss balanced on models whose streams are large. SmolLM2-135M's last stream has median |x|
    14 and outliers to 4,700: on raw features the regression was ~40 against 0.5 for the weighted token loss
    and the head agreed with the target less (0.238 against 0.335 at draft step 1 after 100 steps, EAGLE-3's
    head with the same data and settings; docs/results.md, stop 47)."""
    per_row = F.smooth_l1_loss(_unit_rms(predicted.float()), _unit_rms(features), reduction="none").mean(-1)
    return (per_row * real).sum() / real.sum().clamp(min=1)


def batch_losses(head: EagleHead, batch: _Batch) -> tuple[torch.Tensor, list[float], list[float], list[float]]:
    """(weighted loss, per-step losses, per-step accuracies in the trained positions, per-step top-1 agreement
    with the target over all real positions). An EAGLE-1 head's per-step loss is its weighted sum of feature
    and token losses."""
    valid0 = batch.valid(0)
    with mixed_precision(batch.embeds.device):
        logits, outputs = head.unroll(batch.embeds, head.fuse(batch.aux), batch.steps, valid=valid0)
    total = torch.zeros((), device=batch.embeds.device)
    losses, accs, agree = [], [], []
    for s, step_logits in enumerate(logits):
        rows = batch.target_rows(s)
        soft = _pad_rows(batch.soft[:, rows], batch.rows)
        argmax = _pad_rows(batch.target_argmax[:, rows], batch.rows)
        in_vocab = _pad_rows(batch.in_vocab[:, rows], batch.rows)
        real = batch.valid(s)
        mask = real & in_vocab
        log_probs = torch.log_softmax(step_logits.float(), -1)
        per_row = -(soft * log_probs).sum(-1)
        n = mask.sum().clamp(min=1)
        loss = (per_row * mask).sum() / n
        if batch.features is not None:
            features = _pad_rows(batch.features[:, rows], batch.rows)
            loss = feature_loss(outputs[s], features, real) + EAGLE1_TOKEN_WEIGHT * loss
        total = total + STEP_WEIGHT ** s * loss
        pred = head.draft_to_target[step_logits.argmax(-1)]
        hits = (pred == argmax)
        losses.append(float(loss.detach()))
        accs.append(float((hits & mask).sum() / n))
        agree.append(float((hits & real).sum() / real.sum().clamp(min=1)))
    return total, losses, accs, agree


def evaluate(target: Transformer, head: EagleHead, items: Sequence, config: TrainConfig,
             readout: torch.Tensor, full: torch.Tensor) -> list[float]:
    """Top-1 agreement with the target (its argmax over the whole vocabulary) per draft step over held-out
    sequences."""
    def score(chunk: list) -> tuple[list[float], list[float]]:
        batch = _Batch(target, head, chunk, config.ttt_steps, readout, full)
        agree = batch_losses(head, batch)[3]
        return agree, [float(batch.valid(s).sum()) for s in range(len(agree))]

    return held_out_agreement(items, config, config.ttt_steps, score)


def train_eagle(target: Transformer, train_items: Sequence, val_items: Sequence, out_dir: str | Path,
                config: TrainConfig | None = None, resume: bool = False, stop_after: int | None = None,
                progress: bool = True, target_info: dict | None = None) -> TrainResult:
    """Train (or resume training) a head on token sequences or (sequence, recorded features) pairs (see
    train/features.py); `stop_after` ends this run after that many steps, checkpointed (an interruption, for
    tests). The finished head is saved in out_dir (loadable as `eagle:DIR`)."""
    config = config or TrainConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_items = training_items(train_items, config.seq_len)
    head = new_head(target, config, [item_tokens(item) for item in train_items]).to(target.device)
    earlier = dict(head.eagle.target) if config.init_head is not None else None
    head.eagle.target.update({**(target_info or {}), "signature": target_signature(target)})
    if earlier is not None:  # what the warm start had been trained on
        head.eagle.target["warm_start"] = {k: v for k, v in earlier.items() if k != "signature"}
    readout = draft_readout(target, head.draft_to_target)
    full = full_readout(target) if val_items else None

    def step_losses(items: list) -> tuple[torch.Tensor, list[float], list[float]]:
        loss, losses, accs, _ = batch_losses(head, _Batch(target, head, items, config.ttt_steps, readout))
        return loss, losses, accs

    history = train_loop(head, config, train_items, [item_positions(item) for item in train_items], step_losses,
                         (lambda: evaluate(target, head, val_items, config, readout, full)) if val_items else None,
                         out_dir, lambda: head.cpu().save(out_dir), resume, stop_after, progress,
                         desc="train eagle")
    return TrainResult(head, history, out_dir)
