"""Where the time of one engine round goes, outside the target's forward: greedy decoding of one prompt with a
drafter (or none), each engine and drafter function on the round's path timed by wrapping it; medians of
repeats. For measuring the Python around the kernels before and after a change (run both in turn).

    python scripts/profile_round.py [--model smollm2-135m] [--dtype gguf] [--drafter ngram] [--tokens 200]
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
    args = parser.parse_args()
    print(machine_info())
    model = load_model(args.model, dtype=args.dtype, progress=False)
    tokenizer = load_tokenizer(args.model)
    engine = build_engine(model, tokenizer, None if args.drafter == "none" else args.drafter, 5)
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
    timed(type(engine), "_decode_round", "whole round")
    if engine.drafter is not None:
        timed(type(engine.drafter), "propose", "drafter propose")
        timed(type(engine.drafter), "observe", "drafter observe")
    ids = tokenizer.prompt_ids(PROMPT, chat=tokenizer.has_chat_template)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    engine.generate(ids, params)  # warm-up
    runs = []
    for _ in range(args.repeats):
        seconds.clear()
        start = time.perf_counter()
        result = engine.generate(ids, params)
        runs.append((time.perf_counter() - start, dict(seconds), len(result.token_ids),
                     result.metrics.target_forwards))
    total, split, tokens, forwards = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    print(f"{args.model} {args.dtype} drafter={args.drafter}: {tokens} tokens in {forwards} target forwards, "
          f"{total / tokens * 1e3:.3f} ms/token (median of {args.repeats})")
    for label, s in split.items():
        print(f"  {label:16s} {s / forwards * 1e3:.3f} ms/round")
    print("  median ms/token over repeats:", f"{statistics.median(r[0] / r[2] for r in runs) * 1e3:.3f}")


if __name__ == "__main__":
    main()
