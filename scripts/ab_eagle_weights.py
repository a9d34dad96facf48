"""The EAGLE head's linear layers in float, int8 or int4 (the drafter option `weights`), alternated in one process.

    python scripts/ab_eagle_weights.py [--model smollm2-135m] [--tree 8] [--weights float,int8,int4]
        [--prompts 24] [--max-tokens 128] [--repeats 2]

Two measurements on the same dev-suite prompts, greedy:
- one chain draft step against one target step (K = 3, fixed; `bench-draft`'s measurement), and the tokens
  per target forward of those chains;
- end to end, adaptive (the engine's default), chains or trees of `--tree`: every prompt is decoded plainly
  and with each variant in turn, so a busy minute of the VM hits all of them alike; tok/s over the whole run.
"""

from __future__ import annotations

import argparse
import time

from specdraft.bench.draft_cost import measure_draft_cost
from specdraft.bench.machine import header, header_lines
from specdraft.bench.suite import load_suite, spread
from specdraft.drafters import make_drafter
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--weights", default="float,int8,int4")
    parser.add_argument("--tree", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("\n".join(header_lines(header())))
    target, tokenizer = load_model(args.model, progress=False), load_tokenizer(args.model)
    prompts = [tokenizer.prompt_ids(q.turns[0], chat=tokenizer.has_chat_template)
               for q in spread(load_suite(args.suite), args.prompts)]
    variants = args.weights.split(",")

    def drafter(weights: str):
        return make_drafter("eagle", target, tokenizer, options={"weights": weights})

    cost = measure_draft_cost(target, tokenizer, prompts, {w: drafter(w) for w in variants}, 3, args.max_tokens,
                              1)
    print(f"chains of K = 3, fixed: plain step {cost['plain_step_ms']:.2f} ms")
    for weights, d in cost["drafters"].items():
        print(f"  {weights}: draft step {d['draft_step_ms']:.2f} ms = {d['step_ratio']:.3f} of a target step, "
              f"{d['mean_accepted_length']:.3f} tokens per forward")

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {"plain": Engine(target, tokenizer, None, 0, AdaptiveConfig())}
    engines |= {w: Engine(target, tokenizer, drafter(w), 5, AdaptiveConfig(), tree=args.tree) for w in variants}
    seconds = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    forwards = dict.fromkeys(engines, 0)
    for _ in range(args.repeats):
        for ids in prompts:
            for name, engine in engines.items():
                start = time.perf_counter()
                metrics = engine.generate(ids, params).metrics
                seconds[name] += time.perf_counter() - start
                tokens[name] += metrics.produced_tokens
                forwards[name] += metrics.target_forwards
    plain_rate = tokens["plain"] / seconds["plain"]
    print(f"end to end, adaptive, {'trees of ' + str(args.tree) if args.tree else 'chains'}:")
    for name in engines:
        rate = tokens[name] / seconds[name]
        print(f"  {name}: {rate:.1f} tok/s, {rate / plain_rate:.3f}x plain, "
              f"{tokens[name] / forwards[name]:.3f} tokens per forward")


if __name__ == "__main__":
    main()
