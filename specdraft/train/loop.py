"""The training loop every drafter head shares (`specdraft train eagle|medusa`): seeded batches, AdamW with
warm-up and cosine decay, gradient clipping, checkpoints that resume bit for bit, validation, a progress bar,
and the loss and accuracy curves as PNG.

Batches hold sequences of similar length, so they pad little (the data mixes 20- and 700-token sequences):
each epoch shuffles the items with a generator seeded by (seed, epoch), sorts each run of 64 batches' worth
by length, cuts it into batches and shuffles the batches.

Deterministic and resumable: step i's batch depends only on (seed, i), and a checkpoint (head,
optimizer state, step, history, the config) is written every `checkpoint_every` steps, so an interrupted run
resumed with `resume=True` ends with the same weights as an uninterrupted one. A checkpoint made with other
settings (anything but the step counts) is refused.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.runtime.paths import replaced_on_success
from specdraft.train.features import cut, item_positions

CHECKPOINT = "checkpoint.pt"
# Settings that may change between an interrupted run and its resumption.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "eval_every")


@dataclass
class LoopConfig:
    """The settings `train_loop` reads, shared by every head's training config (which adds its own)."""

    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512  # sequences are cut to this many tokens
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup: int = 20
    grad_clip: float = 0.5
    draft_vocab: int | None = None  # None: the target's whole vocabulary
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 100


# One step: (weighted loss with a graph, per-draft-step losses, per-draft-step accuracies) of a batch.
StepLosses = Callable[[list], tuple[torch.Tensor, list[float], list[float]]]


def draft_vocabulary(sequences: Sequence[Sequence[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the data (ties: lower id first), padded with the lowest unseen ids
    when the data has fewer distinct tokens; sorted target ids."""
    counts = Counter(t for seq in sequences for t in seq)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen][:size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.long)


BUCKET_BATCHES = 64  # batches' worth of items sorted by length together


def epoch_batches(lengths: Sequence[int], size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of item indices: every item once, batches of up to `size` items of similar length,
    in a random order fixed by (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches = []
    span = size * BUCKET_BATCHES
    for start in range(0, len(order), span):
        bucket = sorted(order[start:start + span], key=lambda i: lengths[i])
        batches += [bucket[i:i + size] for i in range(0, len(bucket), size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


class BatchSchedule:
    """Step -> batch of item indices, epoch after epoch (each epoch's batches made once)."""

    def __init__(self, lengths: Sequence[int], size: int, seed: int) -> None:
        self.lengths, self.size, self.seed = list(lengths), size, seed
        self.per_epoch = -(-len(self.lengths) // size)
        self._epoch, self._batches = -1, []

    def __call__(self, step: int) -> list[int]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, epoch_batches(self.lengths, self.size, self.seed, epoch)
        return self._batches[index]


def learning_rate(config: LoopConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_loop(head: torch.nn.Module, config: LoopConfig, train_items: Sequence, lengths: Sequence[int],
               step_losses: StepLosses, evaluate: Callable[[], list[float]] | None, out_dir: Path,
               save: Callable[[], None], resume: bool = False, stop_after: int | None = None,
               progress: bool = True, desc: str = "train") -> dict:
    """Run (or resume) `config.steps` steps over `train_items` (their `lengths` shape the batches); returns
    the history. `save` writes the finished head into out_dir. `stop_after` ends this run after that many
    steps, checkpointed (an interruption, for tests)."""
    ckpt_path = out_dir / CHECKPOINT
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    history: dict = {"step": [], "loss": [], "step_loss": [], "step_acc": [], "val_step": [], "val_agreement": []}
    start = 0
    if ckpt_path.exists():
        if not resume:
            raise SpecdraftError(f"{out_dir} holds a training checkpoint: pass --resume to continue it, or "
                                 f"choose another --out")
        ckpt = torch.load(ckpt_path, weights_only=False)
        saved = {k: v for k, v in ckpt["config"].items() if k not in RESUMABLE_CHANGES}
        now = {k: v for k, v in asdict(config).items() if k not in RESUMABLE_CHANGES}
        if saved != now:
            raise SpecdraftError(f"the checkpoint in {out_dir} was trained with {saved}, not {now}")
        head.load_state_dict(ckpt["head"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start, history = ckpt["step"], ckpt["history"]
    end = config.steps if stop_after is None else min(config.steps, start + stop_after)

    def checkpoint(step: int) -> None:
        with replaced_on_success(ckpt_path) as tmp:
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "history": history, "config": asdict(config)}, tmp)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start, desc=desc, unit="step", dynamic_ncols=True)
    schedule = BatchSchedule(lengths, config.batch_size, config.seed)
    head.train()
    for step in range(start, end):
        seqs = [train_items[i] for i in schedule(step)]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        loss, losses, accs = step_losses(seqs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
        optimizer.step()
        history["step"].append(step + 1)
        history["loss"].append(float(loss.detach()))
        history["step_loss"].append(losses)
        history["step_acc"].append(accs)
        done = step + 1
        if evaluate is not None and (done % config.eval_every == 0 or done == config.steps):
            head.eval()
            history["val_step"].append(done)
            history["val_agreement"].append(evaluate())
            head.train()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(epoch=f"{step / schedule.per_epoch:.2f}", loss=f"{float(loss.detach()):.3f}",
                            acc=" ".join(f"{a:.2f}" for a in accs))
        if done % config.checkpoint_every == 0 or done == end:
            checkpoint(done)
    if bar is not None:
        bar.close()
    head.eval()
    if end == config.steps:
        save()
        (out_dir / "history.json").write_text(json.dumps(history) + "\n")
        plot_history(history, out_dir, desc)
    return history


def held_out_agreement(items: Sequence, config: LoopConfig, steps: int,
                       score: Callable[[list], tuple[list[float], list[float]]]) -> list[float]:
    """Top-1 agreement with the target per draft step (`steps` of them) over held-out items, in batches of the
    training's size and length: `score(batch items)` gives each step's agreement and how many positions it
    counted, which weigh it (batches differ in length, and later steps count fewer positions)."""
    hits, total = [0.0] * steps, [0.0] * steps
    with torch.no_grad():
        for i in range(0, len(items), config.batch_size):
            chunk = [cut(item, config.seq_len) for item in items[i:i + config.batch_size]]
            chunk = [item for item in chunk if item_positions(item) >= 2]
            if not chunk:
                continue
            agree, counted = score(chunk)
            for s, (a, n) in enumerate(zip(agree, counted, strict=True)):
                hits[s] += a * n
                total[s] += n
    return [h / t if t else 0.0 for h, t in zip(hits, total)]


def plot_history(history: dict, out_dir: Path, title: str = "head") -> None:
    """loss.png (weighted total and per draft step) and accuracy.png (training and validation top-1
    agreement with the target per draft step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = history["step"]
    if not steps:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, history["loss"], label="weighted total", color="black")
    for s in range(len(history["step_loss"][0])):
        ax.plot(steps, [row[s] for row in history["step_loss"]], label=f"draft step {s + 1}", alpha=0.7)
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"{title}: training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for s in range(len(history["step_acc"][0])):
        ax.plot(steps, [row[s] for row in history["step_acc"]], label=f"train, draft step {s + 1}", alpha=0.6)
    if history["val_step"]:
        for s in range(len(history["val_agreement"][0])):
            ax.plot(history["val_step"], [row[s] for row in history["val_agreement"]], marker="o",
                    label=f"validation, draft step {s + 1}")
    ax.set_xlabel("training step")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title}: accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=100)
    plt.close(fig)


__all__ = ["CHECKPOINT", "BatchSchedule", "draft_vocabulary", "epoch_batches", "learning_rate", "plot_history",
           "train_loop"]
