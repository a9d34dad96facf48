"""Forward ms of a model at a few block shapes (B sequences x T new tokens after `--context` (100) committed
tokens each, median of 5 means of 16 forwards), optionally beside a process that takes a slice of a core. The figures
behind stop 30's fp16 panel scales and guided panel loops: run it in two checkouts, alternately, to compare.
`--ab-q8-int8 N` instead times every shape N times with the GGUF-native 8-bit output layer on 16-bit and on
int8 activations in turn (`cpu_kernels.q8_int8_activations`), in one process, and prints the medians and
ratios.

    python scripts/bench_forward_shapes.py [--model smollm2-135m] [--dtype gguf] [--shapes 1x1,8x1,1x8]
        [--context 100] [--busy 0.1] [--ab-q8-int8 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from specdraft.runtime import cpu_kernels
from specdraft.runtime.loader import load_model

# A process that spins for `busy` of every 5 ms and sleeps the rest.
SPINNER = """
import sys, time
busy = float(sys.argv[1]) * 0.005
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(0.005 - busy)
"""


def forward_ms(model, batch: int, tokens: int, generator: torch.Generator, context: int = 100) -> float:
    cache = model.new_cache(context + 300, num_slots=batch)
    model.forward(torch.randint(1000, 30000, (batch, context), generator=generator), cache, logits_from=context - 1)
    for slot in range(batch):
        cache.commit(slot, context)
    block = torch.randint(1000, 30000, (batch, tokens), generator=generator)
    means = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(16):
            model.forward(block, cache)
        means.append((time.perf_counter() - start) / 16 * 1e3)
    return statistics.median(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--shapes", default="1x1,8x1,1x8,1x32", help="BxT, comma-separated")
    parser.add_argument("--context", type=int, default=100, help="tokens committed in each sequence before")
    parser.add_argument("--busy", type=float, default=0.0, help="fraction of a core another process spins")
    parser.add_argument("--ab-q8-int8", type=int, default=0, metavar="N",
                        help="alternate the 8-bit output layer's 16-bit and int8 activations, N times per shape")
    args = parser.parse_args()
    model = load_model(args.model, dtype=args.dtype, progress=False)
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER, str(args.busy)]) if args.busy > 0 else None
    try:
        generator = torch.Generator().manual_seed(0)
        for shape in args.shapes.split(","):
            batch, tokens = (int(n) for n in shape.split("x"))
            if args.ab_q8_int8:
                times: dict[bool, list[float]] = {False: [], True: []}
                before = cpu_kernels.q8_int8_activations()
                for _ in range(args.ab_q8_int8):
                    for on in (False, True):
                        cpu_kernels.q8_int8_activations(on)
                        times[on].append(forward_ms(model, batch, tokens, generator))
                cpu_kernels.q8_int8_activations(before)
                ratios = [b / a for a, b in zip(times[False], times[True])]
                print(f"{args.model} {args.dtype} B={batch} T={tokens}: 16-bit {statistics.median(times[False]):.2f} "
                      f"ms, int8 {statistics.median(times[True]):.2f} ms, int8 / 16-bit per pair "
                      f"{' '.join(f'{r:.3f}' for r in ratios)} median {statistics.median(ratios):.3f}", flush=True)
                continue
            ms = forward_ms(model, batch, tokens, generator, args.context)
            print(f"{args.model} {args.dtype} B={batch} T={tokens} after {args.context}: {ms:.2f} ms", flush=True)
    finally:
        if spinner is not None:
            spinner.terminate()


if __name__ == "__main__":
    main()
