"""Micro-benchmark: F.linear (full-precision weight) vs Int8Linear vs Int4Linear on draft-model shapes.

    .venv/bin/python scripts/bench_quant.py [--repeats 50] [--threads 2] [--dtype bf16|fp32]

Prints the median wall time of one forward call for 1 and 6 activation rows (decode step, and a
typical speculative verification / draft width).  Not a test; run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from specdraft.runtime.quant import Int4Linear, Int8Linear, quant_supported

SHAPES = [
    ("smollm2 lm_head", 49152, 576),
    ("smollm2 gate+up", 3072, 576),
    ("smollm2 qkv", 960, 576),
    ("gemma3 lm_head", 262144, 640),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_shape(name: str, n: int, k: int, dtype: torch.dtype, gen: torch.Generator, repeats: int) -> None:
    w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
    t0 = time.perf_counter()
    q8 = Int8Linear.from_linear_weight(w, None)
    t8 = time.perf_counter() - t0
    t0 = time.perf_counter()
    q4 = Int4Linear.from_linear_weight(w, None)
    t4 = time.perf_counter() - t0
    for rows in (1, 6):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        ref = median_ms(functools.partial(F.linear, x, w), repeats)
        m8 = median_ms(functools.partial(q8, x), repeats)
        m4 = median_ms(functools.partial(q4, x), repeats)
        label = f"{name} [{n}x{k}]"
        print(f"{label:<28}{rows:>5}{ref:>13.3f}{m8:>10.3f}{m4:>10.3f}"
              f"{ref / m8:>7.2f}x{ref / m4:>7.2f}x", flush=True)
    print(f"{'':<28}  quantize: int8 {t8:.2f} s, int4 {t4:.2f} s (group {q4.group_size}); "
          f"weight MB bf16 {n * k * 2 / 2**20:.1f} / int8 {q8.weight_int8.numel() / 2**20:.1f} / "
          f"int4 {q4.weight_int4.numel() / 2**20:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(f"torch {torch.__version__}  threads={torch.get_num_threads()}  activations={args.dtype}  "
          f"cpu capability={torch.backends.cpu.get_cpu_capability()}  repeats={args.repeats}")
    if not (quant_supported(8) and quant_supported(4)):
        raise SystemExit(f"int8 supported: {quant_supported(8)}, int4 supported: {quant_supported(4)}")
    gen = torch.Generator().manual_seed(0)
    header = (f"{'shape':<28}{'rows':>5}{'F.linear ms':>13}{'int8 ms':>10}{'int4 ms':>10}"
              f"{'int8 x':>8}{'int4 x':>8}")
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for name, n, k in SHAPES:
            bench_shape(name, n, k, dtype, gen, args.repeats)


if __name__ == "__main__":
    main()
