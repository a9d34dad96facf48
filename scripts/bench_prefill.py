"""Prefill of one prompt on the fused kernels in blocks of 32 tokens against one GEMM over the prompt, on a
bundled model, interleaved, medians of repeats. The figures behind `CHUNKED_PREFILL_TOKENS` in
runtime/model.py.

    python scripts/bench_prefill.py [--model smollm2-135m] [--dtype gguf|bf16] [--lengths 40,200,500,1000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft.bench.machine import machine_info
from specdraft.runtime import model as model_module
from specdraft.runtime.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--lengths", default="40,200,500,1000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine_info())
    model = load_model(args.model, dtype=args.dtype, progress=False)
    g = torch.Generator().manual_seed(0)
    print(f"{args.model} ({args.dtype}): ms to prefill one prompt, median of {args.repeats}")
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
        times: dict[str, list[float]] = {"chunks of 32": [], "one GEMM": []}
        for _ in range(args.repeats):
            for mode, limit in (("chunks of 32", 1 << 30), ("one GEMM", 0)):
                model_module.CHUNKED_PREFILL_TOKENS = limit
                start = time.perf_counter()
                model(tokens, model.new_cache(n + 64), logits_from=n - 1)
                times[mode].append(time.perf_counter() - start)
        chunks, gemm = (statistics.median(v) * 1000 for v in times.values())
        print(f"  {n} tokens: chunks of 32 {chunks:.1f}, one GEMM {gemm:.1f} ({gemm / chunks:.2f}x)")


if __name__ == "__main__":
    main()
