"""Token-sequence shards as `specdraft distill` writes them and `specdraft train` reads them.

A dataset directory holds `manifest.json` and shards `{split}-{index:05d}.safetensors`, each with
`tokens` (int32, the sequences concatenated), `offsets` (int64 [n + 1]) and `prompt_lens` (int32 [n]: the
prompt part of each sequence, the rest is the target's response). Splits: `train` and `val` (held out).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError

MANIFEST = "manifest.json"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def write_shard(path: Path, sequences: list[list[int]], prompt_lens: list[int]) -> None:
    """Atomically (a temporary file, then a rename): an interrupted write never looks finished."""
    from safetensors.torch import save_file

    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    flat = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"tokens": flat, "offsets": offsets, "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32)},
              str(tmp))
    tmp.replace(path)


def read_shard(path: Path) -> tuple[list[list[int]], list[int]]:
    from safetensors.torch import load_file

    data = load_file(str(path))
    offsets = data["offsets"].tolist()
    flat = data["tokens"].long()
    seqs = [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    return seqs, data["prompt_lens"].tolist()


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise SpecdraftError(f"{data_dir} has no {MANIFEST}: make one with `specdraft distill`")
    return json.loads(path.read_text())


def load_split(data_dir: str | Path, split: str) -> list[list[int]]:
    """Every sequence of a split (prompt + response token ids), in shard order."""
    manifest = read_manifest(data_dir)
    out: list[list[int]] = []
    for shard in manifest["shards"]:
        if shard["split"] == split:
            seqs, _ = read_shard(Path(data_dir) / shard["file"])
            out.extend(seqs)
    return out


def train_val_split(data_dir: str | Path, val_fraction: float = 0.05) -> tuple[list[list[int]], list[list[int]]]:
    """The train and validation sequences of a distillation. One stopped before its validation prompts (the
    last of the prompt file) holds out the last `val_fraction` of its training sequences instead, with a
    warning: prompts are independent, so those are as unseen as the planned ones."""
    train, val = load_split(data_dir, "train"), load_split(data_dir, "val")
    if not val and len(train) >= 2:
        held = max(1, round(len(train) * val_fraction))
        warnings.warn(f"{data_dir} has no validation split (distillation unfinished): holding out its last "
                      f"{held} training sequences", stacklevel=2)
        train, val = train[:-held], train[-held:]
    return train, val


def file_sha256(path: str | Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        read = 0
        while chunk := f.read(1 << 20):
            h.update(chunk)
            read += len(chunk)
            if limit is not None and read >= limit:
                break
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of a model directory: its config and the names and sizes of its weight files (hashing
    gigabytes of weights for a manifest is not worth the minutes)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]
