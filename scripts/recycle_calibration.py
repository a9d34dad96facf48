"""How often each source of the `recycle` drafter guesses the target's next token, on held-out distilled
answers (the validation split of a `specdraft distill` output that recorded the final hidden states): the
figures behind `MATCH_CHANCE`, `RECYCLED_CHANCE` and `TABLE_WEIGHT` in specdraft/drafters/recycle.py.

    python scripts/recycle_calibration.py --model smollm2-135m --data DATA_DIR --table TABLE_DIR

For every answer position: the token after the latest earlier occurrence of the longest matching suffix
(by match length); the target's ranked predictions recycled from earlier positions of the split (by context
order and rank; the target's top-k at a position comes from its recorded final hidden state through the
LM head); and the static table's candidates (observed hits over the table's summed frequencies, by order).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

from specdraft.drafters.ngram import NgramIndex
from specdraft.drafters.recycle import MAX_ORDER, NgramTable, RecycledPredictions
from specdraft.runtime.loader import load_model
from specdraft.train.data import read_features, read_manifest, read_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--split", default="val")
    parser.add_argument("--max-n", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    args = parser.parse_args()
    target = load_model(args.model, dtype="bf16", progress=False)
    table = NgramTable.load(args.table)
    recycled = RecycledPredictions()
    match_tries, match_hits = Counter(), Counter()
    recycled_tries, recycled_hits = Counter(), Counter()
    table_tries, table_hits, table_mass = Counter(), Counter(), Counter()
    manifest = read_manifest(args.data)
    for shard in manifest["shards"]:
        if shard["split"] != args.split:
            continue
        path = Path(args.data) / shard["file"]
        sequences, prompt_lens = read_shard(path)
        features = read_features(path, [-1])
        for seq, prompt_len, feats in zip(sequences, prompt_lens, features):
            hidden = feats[-1]
            with torch.inference_mode():
                top = target._head(hidden.to(target.dtype)).topk(args.topk, dim=-1).indices.tolist()
            index = NgramIndex(1, args.max_n)
            index.sync(seq[:prompt_len])
            for i in range(prompt_len, min(len(seq), len(top) + 1)):
                nxt = seq[i]
                n, end = index.longest_match()
                if n:
                    match_tries[n] += 1
                    match_hits[n] += index.tokens[end + 1] == nxt
                order, ranked = recycled.lookup(seq[max(0, i - MAX_ORDER):i])
                if order:
                    recycled_tries[order] += 1
                    if nxt in ranked:
                        recycled_hits[order, ranked.index(nxt)] += 1
                order, found = table.lookup(seq[max(0, i - MAX_ORDER):i])
                if order:
                    table_tries[order] += 1
                    table_mass[order] += sum(p for _, p in found)
                    table_hits[order] += any(t == nxt for t, _ in found)
                recycled.record(seq[max(0, i - MAX_ORDER):i], top[i - 1])
                index.extend([nxt])
    print("| match length | positions | next token right |")
    print("| ---: | ---: | ---: |")
    for n in sorted(match_tries):
        print(f"| {n} | {match_tries[n]} | {match_hits[n] / match_tries[n]:.3f} |")
    print("\n| recycled, context order | positions | right at rank 0 / 1 / 2 / 3 |")
    print("| ---: | ---: | :--- |")
    for order in sorted(recycled_tries):
        rates = " / ".join(f"{recycled_hits[order, r] / recycled_tries[order]:.3f}" for r in range(args.topk))
        print(f"| {order} | {recycled_tries[order]} | {rates} |")
    print("\n| table, context order | positions | a candidate right | summed frequencies | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for order in sorted(table_tries):
        hits, mass = table_hits[order] / table_tries[order], table_mass[order] / table_tries[order]
        print(f"| {order} | {table_tries[order]} | {hits:.3f} | {mass:.3f} | {hits / mass:.2f} |")


if __name__ == "__main__":
    main()
