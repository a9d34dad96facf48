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

from specdraft.config import arg_draft_length
from specdraft.drafters.base import DraftRequest, Proposal, Verified


class AlwaysWrongDrafter:
    name = "always-wrong"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, token: int) -> None:
        self.token = token

    def add_request(self, request: DraftRequest) -> None:
        pass

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]],
                max_ks: Sequence[int], max_nodes: Sequence[int | None] | None = None) -> list[Proposal]:
        return [Proposal([self.token] * k) for k in max_ks]

    def observe(self, request_id: int, verified: Verified) -> None:
        pass

    def remove_request(self, request_id: int) -> None:
        pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", "-k", dest="num_speculative_tokens", type=arg_draft_length,
                        default=5)
    parser.add_argument("--out", default="bench-out")


def run_fallback_bench(args: argparse.Namespace) -> dict:
    from specdraft.bench.interleave import interleaved
    from specdraft.bench.machine import header, header_lines
    from specdraft.bench.suite import load_suite
    from specdraft.engine.adaptive import AdaptiveConfig
    from specdraft.engine.core import Engine
    from specdraft.runtime.loader import load_model, load_tokenizer
    from specdraft.verify.sampling import SamplingParams

    target = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    wrong = AlwaysWrongDrafter(target.config.vocab_size - 1)
    k = args.num_speculative_tokens
    engines = {
        "plain": Engine(target, tokenizer, None, 0),
        "wrong+fallback": Engine(target, tokenizer, wrong, k, AdaptiveConfig()),
        "wrong, fixed K": Engine(target, tokenizer, wrong, k, AdaptiveConfig(enabled=False)),
    }
    suite = load_suite(None)[: args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [tokenizer.prompt_ids(q.turns[0], chat=tokenizer.has_chat_template) for q in suite]
    for engine in engines.values():
        engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8))
    def timed(engine):
        def run(ids, _repeat):
            t0 = time.perf_counter()
            tokens = engine.generate(ids, params).token_ids
            return time.perf_counter() - t0, tokens
        return run

    raw = interleaved(prompts, {name: timed(engine) for name, engine in engines.items()}, args.repeats,
                      "bench-fallback", label=lambda ids: f"{len(ids)}-token prompt")
    total = {name: sum(statistics.median(t for t, _ in runs[name]) for runs in raw) for name in engines}
    identical = {name: sum(tokens == runs["plain"][0][1] for runs in raw for _, tokens in runs[name])
                 for name in engines}
    out = {
        "header": {**header(), "model": args.model, "dtype": "bf16"},
        "config": {"max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats, "k": k},
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
