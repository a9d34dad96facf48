"""Streamed against not streamed through one `specdraft serve` process, alternated: what streaming costs the
server at each concurrency (the same requests, `bench-serve`'s client, medians of the passes).

    .venv/bin/python scripts/serve_stream_ab.py [--model smollm2-135m] [--concurrency 1,8] [--passes 4]
        [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

from specdraft.bench.serve_bench import _run_level, _serve_process
from specdraft.bench.suite import load_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    serve_args = argparse.Namespace(model=args.model, dtype="auto", api_key=None, num_speculative_tokens=5)
    prompts = [q.turns[0] for q in load_suite(args.suite)]
    with _serve_process(serve_args, max(levels), None) as url:
        _run_level(url, args.model, prompts[:1], 1, 4, None)  # warm-up
        for concurrency in levels:
            batch = [prompts[i % len(prompts)] for i in range(max(8, 2 * concurrency))]
            rates: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.passes):
                for stream in (True, False):
                    results, wall = _run_level(url, args.model, batch, concurrency, args.max_tokens, None, stream)
                    if any("error" in r for r in results):
                        raise SystemExit(f"a request failed: {next(r for r in results if 'error' in r)}")
                    rates[stream].append(sum(r["tokens"] for r in results) / wall)
            for stream, runs in rates.items():
                print(f"c={concurrency} {'streamed' if stream else 'not streamed':12} output tok/s median "
                      f"{statistics.median(runs):.1f}  runs {' '.join(f'{r:.0f}' for r in runs)}", flush=True)


if __name__ == "__main__":
    main()
