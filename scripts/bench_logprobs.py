"""What logprobs cost on the engine alone: decoding with `logprobs` None / 0 / N (plain and with a drafter), and
prompt forwards with and without `prompt_logprobs` (every prompt row through the output layer and scored).
Settings take turns within each pass (`bench.interleave`, the measuring loop every benchmark shares); medians of
the passes, each setting's throughput and its ratio to the one without logprobs.

    .venv/bin/python scripts/bench_logprobs.py [--model smollm2-135m] [--dtype auto] [--drafter ngram]
        [--prompts 8] [--max-tokens 64] [--top 5] [--passes 4]
"""

from __future__ import annotations

import argparse
import time

from specdraft.bench.engine_alone import add_engine_alone_arguments, load_engine_alone
from specdraft.bench.interleave import alternated_medians, print_rates
from specdraft.engine.core import build_engine
from specdraft.verify.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_alone_arguments(parser)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    target, tokenizer, prompts = load_engine_alone(args)

    for drafter in (None, args.drafter):
        engine = build_engine(target, tokenizer, drafter, 5 if drafter else 0)

        def decode(logprobs: int | None, engine=engine) -> float:
            engine.restore_prefixes({})
            start, tokens = time.perf_counter(), 0
            for ids in prompts:
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=logprobs)
                tokens += len(engine.generate(ids, params).token_ids)
            return tokens / (time.perf_counter() - start)

        rates = alternated_medians({"none": lambda: decode(None), "logprobs=0": lambda: decode(0),
                                    f"logprobs={args.top}": lambda: decode(args.top)}, args.passes,
                                   drafter or "plain")
        print_rates(f"decoding, {drafter or 'plain'}", rates, "tok/s")

    engine = build_engine(target, tokenizer, None, 0)

    def prefill(prompt_logprobs: int | None) -> float:
        engine.restore_prefixes({})
        start = time.perf_counter()
        for ids in prompts:
            engine.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=prompt_logprobs))
        return sum(map(len, prompts)) / (time.perf_counter() - start)

    rates = alternated_medians({"first token only": lambda: prefill(None), "prompt_logprobs=1": lambda: prefill(1)},
                               args.passes, "prompt forwards")
    print_rates("prompt forwards", rates, "prompt tok/s")


if __name__ == "__main__":
    main()
