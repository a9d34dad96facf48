"""Prefill of one prompt on the fused kernels in causal chunks of each size in --chunks against one GEMM over
the prompt, on a bundled model, interleaved, medians of repeats. The figures behind `CHUNKED_PREFILL_TOKENS`
and `PREFILL_CHUNK_TOKENS` in runtime/model.py; with --q-amx-rows, each chunk size also at each threshold of
the AMX-INT8 GGUF panels (`cpu_kernels.q_amx_rows`, 0: VNNI only).

    python scripts/bench_prefill.py [--model smollm2-135m] [--dtype gguf|bf16] [--lengths 40,200,500,1000]
        [--chunks 32,64,128] [--q-amx-rows 0,48]
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
    parser.add_argument("--q-amx-rows", default=None,
                        help="comma-separated thresholds for AMX-INT8 GGUF panels to compare (0: VNNI only)")
    args = parser.parse_args()
    print(machine_info(), "kernel path:", cpu_kernels.simd_path() if cpu_kernels.available() else "none")
    model = load_model(args.model, dtype=args.dtype, progress=False)
    g = torch.Generator().manual_seed(0)
    default_rows = cpu_kernels.q_amx_rows() if cpu_kernels.available() else 0
    thresholds = [int(r) for r in args.q_amx_rows.split(",")] if args.q_amx_rows else [default_rows]
    modes = {}
    for c in args.chunks.split(","):
        for rows in thresholds:
            label = f"chunks of {c}" + (f", AMX-INT8 from {rows} rows" if len(thresholds) > 1 else "")
            modes[label] = (1 << 30, int(c), rows)
    modes["one GEMM"] = (0, model_module.PREFILL_CHUNK_TOKENS, default_rows)
    print(f"{args.model} ({args.dtype}): ms to prefill one prompt, median of {args.repeats}")
    for n in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode, (limit, chunk, rows) in modes.items():
                model_module.CHUNKED_PREFILL_TOKENS, model_module.PREFILL_CHUNK_TOKENS = limit, chunk
                if cpu_kernels.available():
                    cpu_kernels.q_amx_rows(rows)
                start = time.perf_counter()
                model(tokens, model.new_cache(n + 64), logits_from=n - 1)
                times[mode].append(time.perf_counter() - start)
        ms = {mode: statistics.median(v) * 1000 for mode, v in times.items()}
        print(f"  {n} tokens: " + ", ".join(f"{mode} {v:.1f} ({n / v * 1000:.0f} tok/s)" for mode, v in ms.items()))


if __name__ == "__main__":
    main()
