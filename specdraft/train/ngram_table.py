"""`specdraft train ngram-table`: the static table the `recycle` drafter reads, counted from a distillation.

For every context of 1-3 tokens in the target's own answers (prompts are someone else's words and are
skipped), the target's most frequent next tokens and their frequencies (`NgramTable.build`). Counting is a
few seconds per million tokens; the table is a few MB (about 20 bytes per context kept).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdraft.drafters.recycle import TABLE_FILE, NgramTable
from specdraft.drafters.shipped import target_signature
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer
from specdraft.train.data import read_manifest, read_shard, split_shards


def build_ngram_table(target: Transformer, data_dir: str | Path, out_dir: str | Path, top: int = 4,
                      min_count: int = 2, target_info: dict | None = None, progress: bool = True) -> NgramTable:
    """Count the training split of `data_dir` into a table saved as `out_dir`/table.safetensors, with a
    config.json that names the target (found again by `recycle` without a path)."""
    manifest = read_manifest(data_dir)
    shards = split_shards(data_dir, "train")
    if not shards:
        raise SpecdraftError(f"{data_dir} has no training shards: run `specdraft distill` first")
    t0 = time.perf_counter()
    sequences: list[tuple[list[int], int]] = []
    if progress:
        from tqdm import tqdm

        shards = tqdm(shards, desc="read shards", unit="shard")
    for path in shards:
        seqs, prompt_lens = read_shard(path)
        sequences.extend(zip(seqs, prompt_lens))
    answer_tokens = sum(len(s) - p for s, p in sequences)
    signature = target_signature(target)
    info = {**(target_info or {}), "signature": signature, "data_settings": manifest.get("settings", {}),
            "sequences": len(sequences), "answer_tokens": answer_tokens, "top": top, "min_count": min_count}
    table = NgramTable.build(sequences, top=top, min_count=min_count, vocab_size=target.config.vocab_size,
                             meta=info)
    out = Path(out_dir)
    table.save(out / TABLE_FILE)
    info["contexts"] = len(table)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "config.json").write_text(json.dumps({"specdraft": {"format": 1, "kind": "recycle", "target": info}},
                                                indent=2) + "\n")
    return table


__all__ = ["build_ngram_table"]
