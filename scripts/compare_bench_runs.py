"""Compare two `specdraft bench` runs of the same suite (e.g. before and after a refactor): are the outputs
of every method the same, prompt by prompt, and how do the throughputs compare?

    python scripts/compare_bench_runs.py bench-out/before/results.json bench-out/after/results.json

Throughput ratios across two runs carry the machine's run-to-run noise; speedups (each method against plain
in its own run) do not, so both are printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    key = lambda s: (str(s["question_id"]), s["turn"])  # noqa: E731
    after_samples = {key(s): s for s in after["samples"]}
    methods = [m["name"] for m in before["methods"] if m["name"] in {m["name"] for m in after["methods"]}]
    print(f"{'method':<12} {'same output':>12} {'tok/s before':>13} {'tok/s after':>12} {'after/before':>13} "
          f"{'speedup before':>15} {'speedup after':>14}")
    for name in methods:
        same = total = 0
        for sample in before["samples"]:
            other = after_samples.get(key(sample))
            if other is None or name not in sample["methods"] or name not in other["methods"]:
                continue
            a, b = sample["methods"][name], other["methods"][name]
            total += 1
            same += (a["text"], a["tokens"], a["finish_reason"]) == (b["text"], b["tokens"], b["finish_reason"])
        tb = before["summary"]["overall"][name]
        ta = after["summary"]["overall"][name]
        print(f"{name:<12} {same:>6}/{total:<5} {tb['tokens_per_s']:13.1f} {ta['tokens_per_s']:12.1f} "
              f"{ta['tokens_per_s'] / tb['tokens_per_s']:12.3f}x {tb['speedup']:14.3f}x {ta['speedup']:13.3f}x")


if __name__ == "__main__":
    main()
