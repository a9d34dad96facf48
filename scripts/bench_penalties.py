"""What penalties cost on the engine alone, and what they do to speculation: greedy decoding without penalties,
with `repetition_penalty`, and with all three (repetition, frequency, presence), plain and with a drafter.
Settings take turns within each pass (`bench.interleave`); medians of the passes, each setting's throughput
and its ratio to the one without penalties, then each drafter's acceptance per setting (penalties steer the
output away from repeating itself, which is what n-gram drafts guess).

    .venv/bin/python scripts/bench_penalties.py [--model smollm2-135m] [--dtype auto] [--drafter ngram]
        [--prompts 8] [--max-tokens 64] [--passes 4]
"""

from __future__ import annotations

import argparse
import time

from specdraft.bench.engine_alone import add_engine_alone_arguments, load_engine_alone
from specdraft.bench.interleave import alternated_medians, print_rates
from specdraft.engine.core import build_engine
from specdraft.verify.sampling import SamplingParams

SETTINGS = {
    "none": {},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "all three": {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.3},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_engine_alone_arguments(parser)
    args = parser.parse_args()
    target, tokenizer, prompts = load_engine_alone(args)

    for drafter in (None, args.drafter):
        engine = build_engine(target, tokenizer, drafter, 5 if drafter else 0)
        accepted = {name: [0, 0] for name in SETTINGS}  # drafted, accepted

        def decode(name: str, engine=engine, accepted=accepted) -> float:
            engine.restore_prefixes({})
            start, tokens = time.perf_counter(), 0
            for ids in prompts:
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, **SETTINGS[name])
                result = engine.generate(ids, params)
                tokens += len(result.token_ids)
                accepted[name][0] += result.metrics.drafted
                accepted[name][1] += result.metrics.accepted
            return tokens / (time.perf_counter() - start)

        rates = alternated_medians({name: lambda name=name: decode(name) for name in SETTINGS}, args.passes,
                                   drafter or "plain")
        print_rates(f"decoding, {drafter or 'plain'}", rates, "tok/s")
        if drafter:
            print(f"{drafter} acceptance (accepted / drafted): " + ", ".join(
                f"{name} {a / d:.3f} of {d // args.passes}" if d else f"{name} nothing drafted"
                for name, (d, a) in accepted.items()))


if __name__ == "__main__":
    main()
