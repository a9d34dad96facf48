"""`specdraft bench-fallback`: what an always-wrong drafter costs once automatic fallback kicks in.

The drafter proposes the vocabulary's last id (a padding/rare token) every time, so essentially every draft
is rejected. With adaptive fallback the engine should notice within a few rounds, decode plainly and only
re-probe now and then: the goal is to end no more than 10% slower than plain decoding. Plain, the wrong
drafter with fallback and (for contrast) the wrong drafter with a fixed K run interleaved on the same prompts;
medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from specdraft.drafters.base import Proposal


class AlwaysWrongDrafter:
    name = "always-wrong"

    def __init__(self, token: int) -> None:
        self.token = token

    def start(self, prompt_ids, params, generator, target_cache=None) -> None:
        pass

    def propose(self, context: Sequence[int], max_k: int) -> Proposal:
        return Proposal([self.token] * max_k)

    def accepted(self, num_accepted: int, context: Sequence[int]) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--out", default="bench-out")


def run_fallback_bench(args: argparse.Namespace) -> dict:
    from specdraft.bench.machine import header, header_lines
    from specdraft.bench.suite import load_suite
    from specdraft.engine.adaptive import AdaptiveConfig
    from specdraft.engine.generate import SpeculativeEngine
    from specdraft.runtime.loader import load_model, load_tokenizer
    from specdraft.verify.sampling import SamplingParams

    target = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    wrong = AlwaysWrongDrafter(target.config.vocab_size - 1)
    engines = {
        "plain": SpeculativeEngine(target, tokenizer, None, 0),
        "wrong+fallback": SpeculativeEngine(target, tokenizer, wrong, args.k, AdaptiveConfig()),
        "wrong, fixed K": SpeculativeEngine(target, tokenizer, wrong, args.k, AdaptiveConfig(enabled=False)),
    }
    suite = load_suite(None)[: args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q.turns[0]}])
               if tokenizer.has_chat_template else tokenizer.encode(q.turns[0]) for q in suite]
    for engine in engines.values():
        engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8))
    times: dict[str, list[float]] = {name: [] for name in engines}
    identical = {name: 0 for name in engines}
    for ids in prompts:
        reference = None
        per_method: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                t0 = time.perf_counter()
                result = engine.generate(ids, params)
                per_method[name].append(time.perf_counter() - t0)
                reference = result.token_ids if name == "plain" else reference
                identical[name] += int(result.token_ids == reference)
        for name in engines:
            times[name].append(statistics.median(per_method[name]))
    total = {name: sum(ts) for name, ts in times.items()}
    out = {
        "header": {**header(), "model": args.model, "dtype": "bf16"},
        "config": {"max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats, "k": args.k},
        "methods": {name: {"time_s": total[name], "slowdown_vs_plain": total[name] / total["plain"],
                           "identical_runs": identical[name],
                           "acceptance_rate": engines[name].totals.acceptance_rate,
                           "fallback_events": engines[name].totals.fallback_events}
                    for name in engines},
    }
    print("\n".join(header_lines(out["header"])))
    print(f"{'method':<16} {'time s':>8} {'vs plain':>9} {'identical':>9}")
    for name, row in out["methods"].items():
        print(f"{name:<16} {row['time_s']:8.2f} {row['slowdown_vs_plain']:8.3f}x "
              f"{row['identical_runs']:>4}/{len(prompts) * args.repeats}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fallback.json").write_text(json.dumps(out, indent=2))
    return out
