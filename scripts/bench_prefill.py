"""Prefill of one prompt on the fused kernels in causal chunks of each size in --chunks against one GEMM over
the prompt, on a bundled model, interleaved, medians of repeats. The figures behind `CHUNKED_PREFILL_TOKENS`
and `PREFILL_CHUNK_TOKENS` in runtime/model.py.

    python scripts/bench_prefill.py [--model smollm2-135m] [--dtype gguf|bf16] [--lengths 40,200,500,1000]
        [--chunks 32,64,128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft.bench.machine import machine_info
from specdraft.runtime import cpu_kernels
from specdraft.runtime import model as model_module
from specdraft.runtime.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--lengths", default="40,200,500,1000")
    parser.add_argument("--chunks", default=str(model_module.PREFILL_CHUNK_TOKENS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine_info(), "kernel path:", cpu_kernels.simd_path() if cpu_kernels.available() else "none")
    model = load_model(args.model, dtype=args.dtype, progress=False)
    g = torch.Generator().manual_seed(0)
    modes = {f"chunks of {c}": (1 << 30, int(c)) for c in args.chunks.split(",")}
    modes["one GEMM"] = (0, model_module.PREFILL_CHUNK_TOKENS)
    print(f"{args.model} ({args.dtype}): ms to prefill one prompt, median of {args.repeats}")
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode, (limit, chunk) in modes.items():
                model_module.CHUNKED_PREFILL_TOKENS, model_module.PREFILL_CHUNK_TOKENS = limit, chunk
                start = time.perf_counter()
                model(tokens, model.new_cache(n + 64), logits_from=n - 1)
                times[mode].append(time.perf_counter() - start)
        ms = {mode: statistics.median(v) * 1000 for mode, v in times.items()}
        print(f"  {n} tokens: " + ", ".join(f"{mode} {v:.1f} ({n / v * 1000:.0f} tok/s)" for mode, v in ms.items()))


if __name__ == "__main__":
    main()
