"""Before/after for a kernel change: alternate builds of several cpu_kernels.c versions in one process.

    git show HEAD:specdraft/runtime/cpu_kernels.c > /tmp/before.c
    python scripts/ab_kernels.py --model smollm2-135m@gguf /tmp/before.c specdraft/runtime/cpu_kernels.c

Each round runs every version at every block size (`--rows` new tokens after a 128-token prompt, logits of
every row, nothing committed), so a busy minute on a shared VM hits all versions alike; the figures are
medians over rounds. It also says whether the versions give the same logits bit for bit (a change meant
only to be faster should). Versions are built like the package's own library (same flags, same cache).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdraft.runtime import cpu_kernels
from specdraft.runtime.loader import load_model


def build(source: Path):
    """The library built from `source`, loaded (cpu_kernels.load() keyed on that file)."""
    cpu_kernels.SOURCE, cpu_kernels._lib, cpu_kernels._load_error = source, None, None
    library = cpu_kernels.load()
    if library is None:
        raise SystemExit(f"{source}: {cpu_kernels.unavailable_reason()}")
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", type=Path, help="cpu_kernels.c versions")
    parser.add_argument("--model", default="smollm2-135m@bf16", help="MODEL@DTYPE (bf16 or gguf)")
    parser.add_argument("--rows", default="1,8,16,32", help="block sizes (new tokens per forward)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per version, size and round")
    args = parser.parse_args()
    original = cpu_kernels.SOURCE
    libraries = [build(source.resolve()) for source in args.sources]
    ref, _, dtype = args.model.partition("@")
    model = load_model(ref, dtype=dtype or "bf16", progress=False)
    sizes = [int(r) for r in args.rows.split(",")]
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = model.new_cache(128 + max(sizes))
    cpu_kernels._lib = libraries[0]
    model(torch.randint(0, vocab, (1, 128), generator=gen), cache, logits_from=127)
    cache.commit(0, 128)
    blocks = {m: torch.randint(0, vocab, (1, m), generator=gen) for m in sizes}
    times: dict[tuple[int, int], list[float]] = {(v, m): [] for v in range(len(libraries)) for m in sizes}
    logits: dict[tuple[int, int], torch.Tensor] = {}
    for _ in range(args.rounds):
        for v, library in enumerate(libraries):
            cpu_kernels._lib = library
            for m in sizes:
                logits[v, m] = model(blocks[m], cache)  # also the warm-up after the switch
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    model(blocks[m], cache)
                    times[v, m].append(time.perf_counter() - start)
    cpu_kernels.SOURCE = original
    print(f"{args.model}, {args.rounds} rounds x {args.repeats} forwards, median ms per forward")
    for m in sizes:
        same = all(torch.equal(logits[0, m], logits[v, m]) for v in range(len(libraries)))
        cells = "  ".join(f"{s.name}: {statistics.median(times[v, m]) * 1e3:6.2f}" for v, s in enumerate(args.sources))
        print(f"{m:>3} rows  {cells}  {'same bits' if same else 'bits differ'}")


if __name__ == "__main__":
    main()
