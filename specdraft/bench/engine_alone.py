"""What the engine-alone option benchmarks (`scripts/bench_logprobs.py`, `scripts/bench_penalties.py`) share:
their flags, the header, the target and tokenizer, and the dev suite's prompts taken evenly across it."""

from __future__ import annotations

import argparse
from typing import Any

from specdraft.bench.machine import header, header_lines
from specdraft.bench.suite import load_suite
from specdraft.config import target_dtype
from specdraft.runtime.loader import load_model, load_tokenizer


def add_engine_alone_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--passes", type=int, default=4)


def load_engine_alone(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]]]:
    """Print the header; return the target, its tokenizer and `--prompts` prompts' token ids (every
    len(suite) // n-th question: across the suite's categories, in the chat template where there is one)."""
    print("\n".join(header_lines({**header(), "model": args.model})))
    target = load_model(args.model, dtype=target_dtype(args.dtype, args.drafter), progress=False)
    tokenizer = load_tokenizer(args.model, progress=False)
    questions = load_suite(args.suite)
    step = max(1, len(questions) // args.prompts)
    prompts = [tokenizer.prompt_ids(q.turns[0], chat=tokenizer.has_chat_template)
               for q in questions[::step][:args.prompts]]
    print(f"{len(prompts)} prompts of {sum(map(len, prompts))} tokens, {args.max_tokens} greedy tokens each")
    return target, tokenizer, prompts
