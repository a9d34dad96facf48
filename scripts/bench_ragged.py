"""One batched verification forward with blocks of different lengths, padded against ragged (only the real
rows computed, `Transformer.forward(lengths=...)`), on a bundled model: 16 slots with 300-600-token
contexts, medians of repeats, the two interleaved. The figures behind `RAGGED_BELOW` in runtime/model.py.

    python scripts/bench_ragged.py [--model smollm2-135m] [--dtype gguf|bf16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft.bench.machine import machine_info
from specdraft.runtime import model as model_module
from specdraft.runtime.loader import load_model

CASES = [[1] * 10 + [6] * 6, [1] * 15 + [6], [1] * 8 + [4] * 8, [5] * 8 + [6] * 8, [1, 6], [1, 1, 1, 6],
         [3, 6, 2, 4], [1] * 7 + [6]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(machine_info())
    model = load_model(args.model, dtype=args.dtype, progress=False)
    slots = max(len(c) for c in CASES)
    cache = model.new_cache(1024, num_slots=slots)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for s in range(slots):
        n = 300 + 20 * s
        model(torch.randint(0, vocab, (1, n), generator=g), cache, slots=[s])
        cache.commit(s, n)
    model_module.RAGGED_BELOW = 1.0  # ragged whenever any row is padding; `None` lengths give the padded run
    print(f"{args.model} ({args.dtype}): ms per forward, median of {args.repeats}")
    for lengths in CASES:
        tokens = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
        times: dict[str, list[float]] = {"padded": [], "ragged": []}
        for _ in range(args.repeats):
            for mode in times:
                start = time.perf_counter()
                model(tokens, cache, slots=list(range(len(lengths))), lengths=lengths if mode == "ragged" else None)
                times[mode].append(time.perf_counter() - start)
        padded, ragged = (statistics.median(times[m]) * 1000 for m in ("padded", "ragged"))
        print(f"  blocks {lengths}: rows {tokens.numel()} -> {sum(lengths)}: padded {padded:.1f}, "
              f"ragged {ragged:.1f} ({padded / ragged:.2f}x)")


if __name__ == "__main__":
    main()
