"""How often prompt lookup's first guess is right, by the length of the context suffix it matched, on the
target's own responses in a `specdraft distill` output (its validation split by default: prompts that share
nothing with Spec-Bench). The figures behind the hybrid drafter's `min_match`.

    python scripts/ngram_match_stats.py DATA_DIR [--split val] [--max-n 6]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from specdraft.drafters.ngram import NgramIndex
from specdraft.train.data import read_shard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data")
    parser.add_argument("--split", default="val")
    parser.add_argument("--max-n", type=int, default=6)
    args = parser.parse_args()
    positions, right, accepted = Counter(), Counter(), Counter()
    for path in sorted(Path(args.data).glob(f"{args.split}-*.safetensors")):
        sequences, prompt_lens = read_shard(path)
        for seq, prompt_len in zip(sequences, prompt_lens):
            index = NgramIndex(1, args.max_n)
            index.sync(seq[:prompt_len])
            for t in range(prompt_len, len(seq)):
                n, _ = index.longest_match()
                guess = index.lookup(5)
                run = 0
                while run < len(guess) and t + run < len(seq) and guess[run] == seq[t + run]:
                    run += 1
                positions[n] += 1
                right[n] += run > 0
                accepted[n] += run
                index.extend([seq[t]])
    total = sum(positions.values())
    print("| matched tokens | positions | share | first guess right | accepted per round (K = 5) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in sorted(positions):
        print(f"| {n} | {positions[n]} | {positions[n] / total:.1%} | {right[n] / positions[n]:.1%} | "
              f"{accepted[n] / positions[n]:.2f} |")


if __name__ == "__main__":
    main()
