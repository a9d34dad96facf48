"""`specdraft bench-runtime --verify-curve`: what verifying M tokens costs against decoding one.

Speculation pays only if scoring M = K + 1 tokens in one target forward costs little more than one token.
For M = 1, 2, 4, ..., 64 new tokens after a fixed prompt this times one forward of each bundled model (median
of repeats, nothing committed, so every forward sees the same cache) and divides by the time of M = 1. Beside
it: the machine's bounds for that forward, from numbers measured in the same run: reading every weight once
at the memory bandwidth (the floor, independent of M), and 2 * parameters * M FLOPs at the peak GEMM rate
(the best of fp32 and, where the CPU has native bf16, bf16 on a 2048-square matrix product). The bound on the ratio is
max(floor, flops(M) / peak) / max(floor, flops(1) / peak). A model given as `NAME@gguf` runs on its GGUF file's
own quantized blocks (its floor: the quantized bytes), beside the bf16 curve of `NAME`.

verify_curve.json (`schema_version` 1):

    {"schema_version": 1, "kind": "specdraft-verify-curve", "header": {...},
     "config": {"tokens": [int], "prefix": int, "repeats": int, "simd_path": str|null},
     "machine": {"bandwidth_gb_s": float, "peak_gflop_s": float, "peak_dtype": "fp32"|"bf16"},
     "models": {MODEL: {"weight_bytes": int, "flops_per_token": int, "floor_ms": float,
                        "points": [{"tokens": int, "ms": float, "ratio": float, "bound_ms": float,
                                    "bound_ratio": float}]}}}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA_VERSION = 1
TOKENS = (1, 2, 4, 8, 16, 32, 64)


def time_forward(model, cache, tokens: torch.Tensor, repeats: int) -> float:
    """Median seconds of one forward over `tokens` [1, M] on top of the cache's committed prefix."""
    model(tokens, cache)  # warm-up at this shape
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(tokens, cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_gemm(size: int = 2048, repeats: int = 5) -> tuple[float, str]:
    """The best FLOP/s of a size^3 matrix product in fp32 and, where the CPU multiplies bf16 in hardware, in
    bf16 (elsewhere torch emulates it far below the fp32 rate), and which dtype reached it."""
    from specdraft.runtime.cpu_kernels import bf16_gemm_is_native

    best = (0.0, "fp32")
    dtypes = [(torch.float32, "fp32")] + ([(torch.bfloat16, "bf16")] if bf16_gemm_is_native() else [])
    for dtype, name in dtypes:
        a = torch.randn(size, size).to(dtype)
        a @ a
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t0)
        best = max(best, (2 * size ** 3 / statistics.median(times), name))
    return best


def curve_points(times_s: dict[int, float], floor_s: float, flops_per_token: float,
                 peak_flop_s: float) -> list[dict]:
    """Measured ratios to one token, next to the bound max(floor, flops / peak) and its ratio."""
    def bound(m: int) -> float:
        return max(floor_s, m * flops_per_token / peak_flop_s)

    return [{"tokens": m, "ms": t * 1e3, "ratio": t / times_s[1], "bound_ms": bound(m) * 1e3,
             "bound_ratio": bound(m) / bound(1)} for m, t in sorted(times_s.items())]


def run_verify_curve(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    from specdraft.bench.machine import header as machine_header
    from specdraft.bench.machine import header_lines
    from specdraft.bench.runtime_bench import measure_bandwidth, weight_bytes_per_token
    from specdraft.runtime import cpu_kernels
    from specdraft.runtime.loader import load_model

    models = [m.strip() for m in args.model.split(",") if m.strip()]
    header = machine_header(argv)
    header.update(model=",".join(models))
    for line in header_lines(header):
        print(line, file=sys.stderr)
    print("measuring memory bandwidth and peak GEMM rate", file=sys.stderr)
    bandwidth = max(measure_bandwidth(torch.float32), measure_bandwidth(torch.bfloat16))
    peak, peak_dtype = peak_gemm()
    results: dict = {
        "schema_version": SCHEMA_VERSION, "kind": "specdraft-verify-curve", "header": header,
        "config": {"tokens": list(TOKENS), "prefix": args.prefix, "repeats": args.repeats,
                   "simd_path": cpu_kernels.simd_path() if cpu_kernels.available() else None},
        "machine": {"bandwidth_gb_s": bandwidth / 1e9, "peak_gflop_s": peak / 1e9, "peak_dtype": peak_dtype},
        "models": {},
    }
    for name in models:
        ref, _, dtype = name.partition("@")
        model = load_model(ref, dtype=dtype or "bf16", progress=False)
        if dtype == "gguf":
            from specdraft.runtime.gguf_native import native_bytes, native_weights

            weight_bytes, weights = native_bytes(model), native_weights(model)
        else:
            named = list(model.named_parameters())
            weight_bytes = weight_bytes_per_token(named, model.embed.weight, model.lm_head.weight)
            weights = weight_bytes // model.embed.weight.element_size()
        flops_per_token = 2 * weights  # a multiply and an add per weight (attention left out)
        vocab = model.config.vocab_size
        cache = model.new_cache(args.prefix + max(TOKENS))
        gen = torch.Generator().manual_seed(0)
        model(torch.randint(0, vocab, (1, args.prefix), generator=gen), cache, logits_from=args.prefix - 1)
        cache.commit(0, args.prefix)
        times = {}
        for m in TOKENS:
            times[m] = time_forward(model, cache, torch.randint(0, vocab, (1, m), generator=gen), args.repeats)
            print(f"{name}: {m:>2} tokens {times[m] * 1e3:7.2f} ms ({times[m] / times[1]:.2f}x one)",
                  file=sys.stderr)
        floor_s = weight_bytes / bandwidth
        results["models"][name] = {"weight_bytes": weight_bytes, "flops_per_token": flops_per_token,
                                   "floor_ms": floor_s * 1e3,
                                   "points": curve_points(times, floor_s, flops_per_token, peak)}
        del model, cache
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_curve.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    plot_curve(results, out / "verify_curve.png")
    print(render_curve(results))
    print(f"wrote {out / 'verify_curve.json'}, {out / 'verify_curve.png'}", file=sys.stderr)
    return results


def render_curve(results: dict) -> str:
    lines = [f"bandwidth {results['machine']['bandwidth_gb_s']:.1f} GB/s, peak GEMM "
             f"{results['machine']['peak_gflop_s']:.0f} GFLOP/s ({results['machine']['peak_dtype']}), kernels: "
             f"{results['config']['simd_path']}",
             "| model | tokens | ms | x one token | bound ms | bound x |",
             "| :--- | ---: | ---: | ---: | ---: | ---: |"]
    for name, entry in results["models"].items():
        for p in entry["points"]:
            lines.append(f"| {name} | {p['tokens']} | {p['ms']:.2f} | {p['ratio']:.2f} | {p['bound_ms']:.2f} | "
                         f"{p['bound_ratio']:.2f} |")
    return "\n".join(lines)


def plot_curve(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, entry in results["models"].items():
        tokens = [p["tokens"] for p in entry["points"]]
        line, = ax.plot(tokens, [p["ratio"] for p in entry["points"]], marker="o", label=f"{name} measured")
        ax.plot(tokens, [p["bound_ratio"] for p in entry["points"]], linestyle="--", color=line.get_color(),
                label=f"{name} machine bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified in one forward (M)")
    ax.set_ylabel("forward time / one-token forward")
    ax.set_title(f"Verification cost ({results['config']['simd_path']} kernels)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

