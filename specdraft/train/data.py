"""Token-sequence shards as `specdraft distill` writes them and `specdraft train` reads them.

A dataset directory holds `manifest.json` and shards `{split}-{index:05d}.safetensors`, each with
`tokens` (int32, the sequences concatenated), `offsets` (int64 [n + 1]) and `prompt_lens` (int32 [n]: the
prompt part of each sequence, the rest is the target's response). Splits: `train` and `val` (held out).

A distillation that recorded the target's features (manifest setting `hidden_layers`) adds, per layer,
`hidden.{layer}` ([rows, dim] bf16, the sequences' feature rows concatenated; `hidden.-1` is the final-normed
output) and `feature_offsets` (int64 [n + 1]): sequence i has features for its first
`feature_offsets[i+1] - feature_offsets[i]` positions.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.runtime.paths import replaced_on_success

MANIFEST = "manifest.json"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.safetensors"


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths, dtype=torch.long).cumsum(0)])


def write_shard(path: Path, sequences: list[list[int]], prompt_lens: list[int],
                features: dict[int, list[torch.Tensor]] | None = None) -> None:
    """Atomically (a temporary file, then a rename): an interrupted write never looks finished. features:
    {layer: one [positions, dim] tensor per sequence}, at most one row per token."""
    from safetensors.torch import save_file

    flat = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    tensors = {"tokens": flat, "offsets": _offsets([len(s) for s in sequences]),
               "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32)}
    if features and sequences:
        counts = None
        for layer, rows in features.items():
            lengths = [len(r) for r in rows]
            if counts is not None and lengths != counts:
                raise ValueError("every recorded layer needs the same positions")
            if any(n > len(s) for n, s in zip(lengths, sequences)):
                raise ValueError("more feature rows than tokens in a sequence")
            counts = lengths
            tensors[f"hidden.{layer}"] = torch.cat(rows).contiguous()
        tensors["feature_offsets"] = _offsets(counts)
    with replaced_on_success(path) as tmp:
        save_file(tensors, str(tmp))


def write_text_atomically(path: str | Path, text: str) -> None:
    """`text` to `path` whole or not at all: an interrupted run leaves the old file (or none), never half of one."""
    with replaced_on_success(Path(path)) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_features(path: Path, layers: list[int]) -> list[dict[int, torch.Tensor]]:
    """Per sequence of a shard, {layer: [positions, dim]} (views into the shard's tensors)."""
    from safetensors.torch import load_file

    data = load_file(str(path))
    if len(data["offsets"]) == 1:  # every prompt of the shard was skipped
        return []
    missing = [layer for layer in layers if f"hidden.{layer}" not in data]
    if missing or "feature_offsets" not in data:
        raise SpecdraftError(f"{path} holds no recorded target features for layers {missing or layers}")
    offsets = data["feature_offsets"].tolist()
    return [{layer: data[f"hidden.{layer}"][a:b] for layer in layers} for a, b in zip(offsets[:-1], offsets[1:])]


def read_shard(path: Path) -> tuple[list[list[int]], list[int]]:
    """(sequences, prompt lengths) of a shard, reading none of its recorded features."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        data = {name: f.get_tensor(name) for name in ("tokens", "offsets", "prompt_lens")}
    offsets = data["offsets"].tolist()
    flat = data["tokens"].long()
    seqs = [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    return seqs, data["prompt_lens"].tolist()


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise SpecdraftError(f"{data_dir} has no {MANIFEST}: make one with `specdraft distill`")
    return json.loads(path.read_text())


def recorded_layers(data_dir: str | Path) -> list[int]:
    """The target layers whose features the distillation recorded (empty: tokens only)."""
    return list(read_manifest(data_dir).get("settings", {}).get("hidden_layers", []))


def load_split(data_dir: str | Path, split: str) -> list[list[int]]:
    """Every sequence of a split (prompt + response token ids), in shard order."""
    return [seq for seq, _ in load_split_with_features(data_dir, split, [])]


def split_shards(data_dir: str | Path, split: str) -> list[Path]:
    """The shard files of a split ("train" or "val"), in order."""
    return [Path(data_dir) / s["file"] for s in read_manifest(data_dir)["shards"] if s["split"] == split]


def load_split_with_features(data_dir: str | Path, split: str, layers: list[int]
                             ) -> list[tuple[list[int], dict[int, torch.Tensor]]]:
    """Every (sequence, {layer: features}) of a split in shard order; no layers: tokens only ({})."""
    out: list[tuple[list[int], dict[int, torch.Tensor]]] = []
    for path in split_shards(data_dir, split):
        seqs, _ = read_shard(path)
        feats = read_features(path, layers) if layers else [{} for _ in seqs]
        out.extend(zip(seqs, feats))
    return out


def train_val_split(data_dir: str | Path, val_fraction: float = 0.05, layers: list[int] | None = None
                    ) -> tuple[list, list]:
    """The train and validation sequences of a distillation (with `layers`: (sequence, features) pairs). One
    stopped before its validation prompts (the last of the prompt file) holds out the last `val_fraction` of
    its training sequences instead, with a warning: prompts are independent, so those are as unseen as the
    planned ones."""
    if layers:
        train, val = (load_split_with_features(data_dir, s, layers) for s in ("train", "val"))
    else:
        train, val = load_split(data_dir, "train"), load_split(data_dir, "val")
    if not val and len(train) >= 2:
        held = max(1, round(len(train) * val_fraction))
        warnings.warn(f"{data_dir} has no validation split (distillation unfinished): holding out its last "
                      f"{held} training sequences", stacklevel=2)
        train, val = train[:-held], train[-held:]
    return train, val


def data_dirs(spec: str) -> list[str]:
    """`--data A[,B,...]`: one distillation, or several trained on as one (a prompt file's answers with those
    to prompts the target wrote itself, say); each must be a distillation."""
    dirs = [d.strip() for d in spec.split(",") if d.strip()]
    if not dirs:
        raise SpecdraftError("--data names no directory")
    for d in dirs:
        read_manifest(d)
    return dirs


def train_val_splits(dirs: Sequence[str | Path], val_fraction: float = 0.05, layers: list[int] | None = None
                     ) -> tuple[list, list]:
    """`train_val_split` of each distillation, concatenated in the order given."""
    train: list = []
    val: list = []
    for data_dir in dirs:
        t, v = train_val_split(data_dir, val_fraction, layers)
        train += t
        val += v
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


def model_identity(model: str) -> dict:
    """What data and heads record of the model they were made with: its reference and fingerprint."""
    from specdraft.runtime.loader import resolve

    return {"model": model, "model_fingerprint": model_fingerprint(resolve(model))}


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
