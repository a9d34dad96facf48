"""Forward time of GGUF-native SmolLM2 at long contexts: B sequences x 1 new token after C committed tokens each
(medians of 31). The figures behind the key panels (runtime/kv_cache.py `enable_key_panels`); run it in two
checkouts, alternately, to compare them.

    python scripts/bench_attention_context.py LABEL [--contexts 1000,2000] [--batches 1,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft.runtime.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--contexts", default="1000,2000")
    parser.add_argument("--batches", default="1,4,8")
    args = parser.parse_args()
    model = load_model(args.model, dtype=args.dtype, progress=False)
    batches = [int(b) for b in args.batches.split(",")]
    g = torch.Generator().manual_seed(0)
    results = []
    for context in (int(c) for c in args.contexts.split(",")):
        cache = model.new_cache(context + 64, max(batches))
        for slot in range(max(batches)):
            model.forward(torch.randint(100, 20000, (1, context), generator=g), cache, slots=[slot],
                          logits_from=context - 1)
            cache.commit(slot, context)
        for batch in batches:
            tokens = torch.randint(100, 20000, (batch, 1), generator=g)
            slots = list(range(batch))
            for _ in range(3):
                model.forward(tokens, cache, slots=slots)
            times = []
            for _ in range(31):
                start = time.perf_counter()
                model.forward(tokens, cache, slots=slots)
                times.append(time.perf_counter() - start)
            results.append(f"c{context}:{batch}x1={statistics.median(times) * 1e3:.1f}")
    print(args.label, " ".join(results), flush=True)


if __name__ == "__main__":
    main()
