"""Decoding step time when another process keeps one core busy: the ThreadGovernor against always using all
threads (a shell busy-loop plays the other process).

    .venv/bin/python scripts/bench_contention.py [--model smollm2-135m] [--steps 150]

Prints the mean single-token forward time in three settings: quiet, busy core with the governor, busy core
with all threads always (the governor never probes).
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch

from specdraft.runtime.fused import ThreadGovernor
from specdraft.runtime.loader import load_model


def decode(model, steps: int) -> tuple[float, int]:
    """Mean ms per single-token forward after a 60-token prompt, and how many ran single-threaded."""
    cache = model.new_cache(64 + steps)
    prompt = torch.randint(100, 20000, (1, 60), generator=torch.Generator().manual_seed(0))
    model(prompt, cache, logits_from=59)
    cache.commit(0, 60)
    token, single = torch.tensor([[5]]), 0
    start = time.perf_counter()
    for i in range(steps):
        single += model.fused.governor.threads(torch.get_num_threads()) == 1
        model(token, cache)
        cache.commit(0, 61 + i)
    return (time.perf_counter() - start) / steps * 1e3, single


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    model = load_model(args.model, dtype="bf16", progress=False)
    print(f"torch threads {torch.get_num_threads()}, {args.steps} steps")

    def report(label: str, governor: ThreadGovernor, steps: int) -> None:
        model.fused.governors[1] = governor  # single-row forwards' (`governor_for(1)`)
        ms, single = decode(model, steps)
        print(f"{label:<24} {ms:6.1f} ms/forward ({single} single-threaded)")

    report("quiet, governor", ThreadGovernor(), args.steps)
    hog = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        time.sleep(1.0)
        report("busy core, governor", ThreadGovernor(), args.steps)
        report("busy core, all threads", ThreadGovernor(first_probe=10**9), args.steps // 2)
    finally:
        hog.kill()


if __name__ == "__main__":
    main()
