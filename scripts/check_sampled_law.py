"""Sampled speculation on a real model keeps the target's law: a check on one next-token distribution.

    python scripts/check_sampled_law.py --drafter recycle --tree 8 --samples 8000

The unit tests check every verifier against the exact law on tiny models (20,000 samples each); this runs the
real thing (bf16 SmolLM2, its 49,152-token vocabulary, the drafter's real trees) where the exact law of a
whole answer is out of reach. Each request samples 3 tokens at temperature T from a fixed prompt with its own
seed, the adaptive controller off so that the second token is always verified against a draft. Among the
requests whose first token is the target's most likely one, the second token must follow the target's
softmax after prompt + that token: a chi-square test over the tokens expected at least 5 times plus one bucket
for the rest. It prints the statistic, its degrees of freedom and how many of those requests had drafts.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from scipy.stats import chi2

from specdraft.api import LLM, SamplingParams

PROMPT = "The cat sat on the mat. The dog sat on the log. The cat sat on the"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--drafter", default="recycle")
    parser.add_argument("--tree", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8000, help="requests (about 40%% are kept)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=100000)
    args = parser.parse_args()

    llm = LLM(args.model, speculative_model=args.drafter, tree=args.tree, dtype=args.dtype, adaptive=False,
              progress=False)
    ids = llm.tokenizer.prompt_ids(PROMPT)
    target = llm.engine.target
    first = int(target(torch.tensor([ids]), target.new_cache(256))[0, -1].float().argmax())
    law = torch.softmax(target(torch.tensor([ids + [first]]), target.new_cache(256))[0, -1].float()
                        / args.temperature, -1)

    counts: collections.Counter[int] = collections.Counter()
    kept = drafted = 0
    start = time.perf_counter()
    for i in range(args.samples):
        params = SamplingParams(temperature=args.temperature, max_tokens=3, seed=args.seed + i)
        out = llm.generate([ids], [params])[0]
        tokens = out.outputs[0].token_ids
        if tokens[0] == first:
            kept += 1
            drafted += out.metrics.drafted > 0
            counts[tokens[1]] += 1
    expected = law * kept
    buckets = [t for t in range(len(law)) if expected[t] >= 5]
    observed = [counts.get(t, 0) for t in buckets] + [kept - sum(counts.get(t, 0) for t in buckets)]
    wanted = [expected[t].item() for t in buckets] + [kept - sum(expected[t].item() for t in buckets)]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    dof = len(observed) - 1
    print(f"{args.model} {args.dtype}, {args.drafter} trees of {args.tree}, T = {args.temperature}: "
          f"{kept} of {args.samples} requests began with token {first} ({drafted} of them verified a draft), "
          f"{time.perf_counter() - start:.0f} s")
    print(f"second token against the target's softmax: chi-square {statistic:.1f} with {dof} degrees of freedom, "
          f"p = {chi2.sf(statistic, dof):.3f}")


if __name__ == "__main__":
    main()
