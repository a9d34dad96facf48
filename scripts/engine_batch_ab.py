"""Plain decoding against a drafter on the engine alone (no server), `--concurrency` requests at a time
through `Engine.generate_many`, alternated: output tok/s of each, their ratio per pass, and how many
requests of each batched round `plan_batch_drafts` let draft (and the tokens per second that
`BatchPlanner.check` measured of plain rounds, and of drafted rounds over them, per batch size). With
`--concurrency 1` as well, the engine's own scaling, the ceiling for `bench-serve`'s. `--no-batch-drafting`
adds the drafter held to plain rounds whenever two or more requests run (a lone request still drafts): what
drafting's choices cost or gain, apart from the drafter's bookkeeping. Each engine's time is also split into
prompt forwards (prefill) and decode rounds. `--q8-16bit` adds a twin of every engine whose GGUF-native 8-bit
output layer takes 16-bit activations (`cpu_kernels.q8_int8_activations(False)` while it runs), against the
int8 default where the CPU has VNNI and no AMX-INT8, and prints each twin's throughput over its original's.

    .venv/bin/python scripts/engine_batch_ab.py [--model smollm2-135m] [--dtype gguf] [--drafter ngram]
        [--prompts spread|first] [--concurrency 8] [--requests 16] [--passes 4] [--max-tokens 64]
        [--no-batch-drafting] [--one-context-class] [--q8-16bit]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from specdraft.bench.suite import first_turns, load_suite
from specdraft.engine import adaptive, core
from specdraft.engine.core import build_engine
from specdraft.runtime import cpu_kernels
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--prompts", choices=["spread", "first"], default="spread",
                        help="the suite's prompts spread over its categories (as bench-serve's), or its first ones")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None, help="default: 2 x --concurrency")
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="requests end at the end-of-sequence token, as a server's do, so batches are ragged "
                             "(default: every request runs --max-tokens, in waves of --concurrency)")
    parser.add_argument("--no-batch-drafting", action="store_true",
                        help="also run the drafter held to plain rounds whenever two or more requests run")
    parser.add_argument("--one-context-class", action="store_true",
                        help="also run the drafter with the batch planner's costs in one table for all contexts")
    parser.add_argument("--q8-16bit", action="store_true",
                        help="also run every engine with the 8-bit GGUF output layer on 16-bit activations")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=args.dtype)
    turns = first_turns(load_suite(args.suite), args.prompts)
    count = args.requests or 2 * args.concurrency
    chat = tokenizer.has_chat_template  # a base model (Gemma 3 270M) takes the plain text
    prompts = [tokenizer.prompt_ids(turns[i % len(turns)], chat=chat) for i in range(count)]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)] * len(prompts)
    engines = {"plain": build_engine(model, tokenizer, None, max_batch=args.concurrency),
               args.drafter: build_engine(model, tokenizer, args.drafter, 5, max_batch=args.concurrency)}
    if args.one_context_class:
        blind = build_engine(model, tokenizer, args.drafter, 5, max_batch=args.concurrency)
        one_context_class(blind)
        engines[f"{args.drafter}-1class"] = blind
    if args.no_batch_drafting:
        held = build_engine(model, tokenizer, args.drafter, 5, max_batch=args.concurrency)
        hold_batches(held)
        engines[f"{args.drafter}-cap0"] = held
    int8_of: dict[str, bool] = {}  # engines run with 8-bit layers' activations set so
    if args.q8_16bit:
        for name in list(engines):
            twin = build_engine(model, tokenizer, None if name == "plain" else args.drafter, 5,
                                max_batch=args.concurrency)
            if name.endswith("-cap0"):
                hold_batches(twin)
            engines[f"{name}-q8-16bit"] = twin
            int8_of[f"{name}-q8-16bit"] = False
    spent = {name: {"prefill": 0.0, "decode": 0.0} for name in engines}
    for name, engine in engines.items():
        for part, method in (("prefill", "_prefill"), ("decode", "_decode_round")):
            setattr(engine, method, timed(getattr(engine, method), spent[name], part))
    plans: Counter[tuple[int, int]] = Counter()  # (batch, requests drafting) -> rounds
    plan = adaptive.plan_batch_drafts

    def counted(*args: Any, **kwargs: Any) -> list[int]:
        planned = plan(*args, **kwargs)
        plans[len(planned), sum(depth > 0 for depth in planned)] += 1
        return planned

    adaptive.plan_batch_drafts = counted
    rates: dict[str, list[float]] = {name: [] for name in engines}
    walls = dict.fromkeys(engines, 0.0)
    for _ in range(args.passes):
        for name, engine in engines.items():
            engine.restore_prefixes({})  # no prompt cached by the pass before
            int8_before = cpu_kernels.q8_int8_activations(int8_of.get(name))
            start = time.perf_counter()
            results = engine.generate_many(prompts, params)
            wall = time.perf_counter() - start
            cpu_kernels.q8_int8_activations(int8_before)
            walls[name] += wall
            rates[name].append(sum(len(r.token_ids) for r in results) / wall)
    for name, runs in rates.items():
        print(f"{name:8} c={args.concurrency} output tok/s median {statistics.median(runs):.1f}  "
              f"runs {' '.join(f'{r:.0f}' for r in runs)}  (time in prompt forwards "
              f"{spent[name]['prefill'] / walls[name]:.0%}, decode rounds {spent[name]['decode'] / walls[name]:.0%}; "
              f"per pass {spent[name]['prefill'] / len(runs):.2f} s and {spent[name]['decode'] / len(runs):.2f} s)")
    for name in engines:
        if name != "plain" and name not in int8_of:
            ratios = [d / p for p, d in zip(rates["plain"], rates[name])]
            print(f"{name} / plain per pass: {' '.join(f'{r:.3f}' for r in ratios)}  "
                  f"median {statistics.median(ratios):.3f}")
    for name in int8_of:
        original = name.removesuffix("-q8-16bit")
        ratios = [t / o for o, t in zip(rates[original], rates[name])]
        print(f"{name} / {original} per pass: {' '.join(f'{r:.3f}' for r in ratios)}  "
              f"median {statistics.median(ratios):.3f}")
    planner = engines[args.drafter].planner
    if planner is not None:
        for bucket, table in sorted(planner.costs.tables.items()):
            entries = ", ".join(f"{rows}: {1000 * t:.1f}" for rows, t in sorted(table.items()))
            print(f"forward + verification by rows computed (ms, the drafter's engine, averages of recent rounds), "
                  f"context class {bucket}: {entries}")
        for batch, check in sorted(planner.checks.items()):
            gain = "-" if check.gain is None else f"{math.exp(check.gain):.3f}"
            plain = "-" if check.plain_rate is None else f"{check.plain_rate:.0f}"
            print(f"plan check, batches of {batch}: plain rounds {plain} tok/s, drafted rounds' rate over theirs "
                  f"{gain} ({check.rounds} rounds)")
    if plans:
        print("batched rounds planned (batch size, requests drafting): rounds  "
              + ", ".join(f"{batch},{drafting}: {n}" for (batch, drafting), n in sorted(plans.items())))


def one_context_class(engine: core.Engine) -> None:
    """The batch planner's cost table with every round in one context class (as before stop 56)."""
    planner = engine.planner
    plan, learn = planner.plan, planner.learn
    planner.plan = lambda alphas, depths, context=0: plan(alphas, depths)  # type: ignore[method-assign]
    planner.learn = lambda *args, context=0, **kwargs: learn(*args, **kwargs)  # type: ignore[method-assign]


def hold_batches(engine: core.Engine) -> None:
    """No drafting in a round of two or more requests (a lone request still drafts as it likes)."""
    decode_round, draft_budget = engine._decode_round, engine._draft_budget
    batch = [1]

    def round_of(requests: Any) -> Any:
        batch[0] = len(requests)
        return decode_round(requests)

    def budget(r: Any) -> tuple[int, int, int | None]:
        wanted = draft_budget(r)
        return wanted if batch[0] < 2 else (0, 0, None)

    engine._decode_round, engine._draft_budget = round_of, budget  # type: ignore[method-assign]


def timed(method: Callable[..., Any], spent: dict[str, float], part: str) -> Callable[..., Any]:
    """`method` (an engine's bound method), adding its wall time to spent[part]."""
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start
    return run


if __name__ == "__main__":
    main()
