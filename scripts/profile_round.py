"""Where the time of one engine round goes, outside the target's forward: greedy decoding of one prompt with a
drafter (or none), each engine and drafter function on the round's path timed by wrapping it; medians of
repeats. For measuring the Python around the kernels before and after a change (run both in turn).
`--batch N` decodes the dev suite's first N prompts together instead (a serving round at N clients; the
prefills are left out of the per-round figures).

    python scripts/profile_round.py [--model smollm2-135m] [--dtype gguf] [--drafter ngram] [--tokens 200]
        [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdraft.bench.machine import machine_info
from specdraft.engine import core
from specdraft.engine.core import build_engine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    args = parser.parse_args()
    print(machine_info())
    model = load_model(args.model, dtype=args.dtype, progress=False)
    tokenizer = load_tokenizer(args.model)
    engine = build_engine(model, tokenizer, None if args.drafter == "none" else args.drafter, 5,
                          max_batch=args.batch)
    seconds: dict[str, float] = {}

    def timed(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(type(model), "forward", "target forward")
    for name in ("_target_argmax", "_target_topk", "for_reduction", "verify_batch", "_tree_layout"):
        timed(core, name, name.lstrip("_"))
    timed(type(engine), "_accept", "accept")
    timed(type(engine), "_draft_budget", "draft budgets")
    timed(type(engine), "_plan_batch", "batch plan")
    timed(type(engine), "_learn_from_batch", "batch learning")
    timed(type(engine), "_decode_round", "whole round")
    timed(type(engine), "_prefill", "prefill")
    if engine.drafter is not None:
        timed(type(engine.drafter), "propose", "drafter propose")
        timed(type(engine.drafter), "observe", "drafter observe")
    if args.batch == 1:
        prompts = [PROMPT]
    else:
        from specdraft.bench.suite import load_suite

        prompts = [q.turns[0] for q in load_suite(args.suite)][:args.batch]
    ids = [tokenizer.prompt_ids(p, chat=tokenizer.has_chat_template) for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)] * len(ids)
    engine.generate_many(ids, params)  # warm-up
    runs = []
    for _ in range(args.repeats):
        seconds.clear()
        start = time.perf_counter()
        results = engine.generate_many(ids, params)
        runs.append((time.perf_counter() - start, dict(seconds), sum(len(r.token_ids) for r in results),
                     max(r.metrics.target_forwards for r in results)))
    total, split, tokens, forwards = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    print(f"{args.model} {args.dtype} drafter={args.drafter} batch={len(ids)}: {tokens} tokens, about {forwards} "
          f"rounds, {total / tokens * 1e3:.3f} ms/token (median of {args.repeats})")
    prefill = split.pop("prefill", 0.0)
    print(f"  {'prefills':16s} {prefill * 1e3:.1f} ms in all ({prefill / total:.0%} of the time)")
    for label, s in split.items():
        print(f"  {label:16s} {s / forwards * 1e3:.3f} ms/round")
    print("  median ms/token over repeats:", f"{statistics.median(r[0] / r[2] for r in runs) * 1e3:.3f}")


if __name__ == "__main__":
    main()
