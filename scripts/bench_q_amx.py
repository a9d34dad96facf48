"""GGUF-native panels on AMX-INT8 tiles against VNNI, layer by layer: ms per call of layer 0's four linear
layers of a bundled model on its GGUF-native weights at several block sizes, the two paths alternated in one
process (`cpu_kernels.q_amx_rows`), medians of 30 calls, best of 2 alternations, and whether every output bit
agrees. The figures behind `sd_q_amx_rows` in cpu_kernels.c.

    python scripts/bench_q_amx.py [--model smollm2-135m] [--rows 16,24,32,48,64,128,200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdraft.bench.machine import machine_info
from specdraft.runtime import cpu_kernels
from specdraft.runtime.loader import load_model


def ms_per_call(layer: torch.nn.Module, x: torch.Tensor, calls: int = 30) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        layer(x, exact_rows=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="16,24,32,48,64,128,200")
    args = parser.parse_args()
    print(machine_info())
    model = load_model(args.model, dtype="gguf", progress=False)
    default = cpu_kernels.q_amx_rows()
    if not default:
        raise SystemExit("no AMX-INT8 tiles on this CPU (or SPECDRAFT_Q_AMX_ROWS=0): nothing to compare")
    layer = model.layers[0]
    g = torch.Generator().manual_seed(0)
    print(f"{args.model} layer 0, ms per call (VNNI panels -> AMX-INT8 tiles); default threshold {default} rows")
    try:
        for name, linear in (("wqkv", layer.attn.wqkv), ("wo", layer.attn.wo), ("gate_up", layer.mlp.w_gate_up),
                             ("down", layer.mlp.w_down)):
            cells = []
            for rows in (int(r) for r in args.rows.split(",")):
                x = (torch.randn(rows, linear.in_features, generator=g) * 2).to(torch.bfloat16)
                times: dict[int, list[float]] = {0: [], 1: []}
                outputs = {}
                for _ in range(2):
                    for tiles in (0, 1):
                        cpu_kernels.q_amx_rows(1 if tiles else 0)
                        outputs[tiles] = linear(x, exact_rows=True)
                        times[tiles].append(ms_per_call(linear, x))
                same = "" if torch.equal(outputs[0], outputs[1]) else " BITS DIFFER"
                cells.append(f"{rows}: {min(times[0]):.3f} -> {min(times[1]):.3f}{same}")
            print(f"  {name} ({getattr(linear, 'extra_repr', lambda: '')()}): " + ", ".join(cells))
    finally:
        cpu_kernels.q_amx_rows(default)


if __name__ == "__main__":
    main()
