"""A/B of the AMX and AVX512-BF16 kernel paths in one process: one forward of M new tokens after a fixed prefix,
alternating the two paths every forward (medians of 12 pairs), so machine noise hits both alike.

    python scripts/ab_amx.py [PREFIX]        # needs a CPU with AMX; prints ms per forward for M = 1..32
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch

from specdraft.runtime import cpu_kernels
from specdraft.runtime.loader import load_model


def main() -> None:
    model = load_model("smollm2-135m", dtype="bf16", progress=False)
    if not cpu_kernels.available() or cpu_kernels.simd_path() != "amx":
        sys.exit("this CPU (or its kernel) does not run the AMX path")
    flag = ctypes.c_int.in_dll(cpu_kernels._lib, "sd_amx_active")
    prefix = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    cache = model.new_cache(prefix + 64)
    gen = torch.Generator().manual_seed(0)
    model(torch.randint(0, 49152, (1, prefix), generator=gen), cache, logits_from=prefix - 1)
    cache.commit(0, prefix)
    for m in (1, 4, 8, 16, 32):
        tokens = torch.randint(0, 49152, (1, m), generator=gen)
        times: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(12):
            for amx in (1, 0):
                flag.value = amx
                model(tokens, cache)
                t0 = time.perf_counter()
                model(tokens, cache)
                model(tokens, cache)
                times[amx].append((time.perf_counter() - t0) / 2)
        flag.value = 1
        print(f"{m} amx {statistics.median(times[1]) * 1e3:.2f} ms   avx512bf16 "
              f"{statistics.median(times[0]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
