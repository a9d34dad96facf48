"""Prompt-cache reuse of multi-turn conversations served together: the dev suite's two-turn (MT-bench)
conversations, each turn's answer greedy, each second turn queued behind the first turns still waiting (as a
server sees them arrive), `--clients` at a time on an engine of `--max-batch` slots (a server has more slots
than it has clients most of the time: the free ones still hold finished requests' entries). Prints how many
second-turn prompt tokens came from the cache and the prefill time, for the engine's slot choice
(`Engine._take_slot`: a free slot whose entries all start the prompt, else the one released longest ago)
against taking the slot released last.

    .venv/bin/python scripts/bench_prefix_reuse.py [--model smollm2-135m] [--max-batch 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from specdraft.bench.suite import load_suite
from specdraft.engine.core import Engine, build_engine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams


def take_last_released(engine: Engine, prompt_ids: list[int]) -> int:
    """The policy before: a stack of free slots."""
    return engine._free_slots.pop()


def serve(engine: Engine, tokenizer, conversations: list[list[str]], params: SamplingParams,
          clients: int) -> dict[str, float]:
    """Every conversation's turns through the engine, `clients` requests at a time; a conversation's next turn
    joins the back of the queue when its last turn finishes."""
    queue = deque((i, [{"role": "user", "content": turns[0]}]) for i, turns in enumerate(conversations))
    running: dict[int, tuple[int, list[dict[str, str]], object]] = {}
    later = {"tokens": 0, "cached": 0}
    prefill_s = 0.0
    while queue or running:
        while queue and len(running) < clients:
            conv, messages = queue.popleft()
            request = engine.add_request(tokenizer.prompt_ids(messages, chat=True), params)
            running[request.id] = (conv, messages, request)
        for chunk in engine.step([r for _, _, r in running.values()]):
            if chunk.result is None:
                continue
            conv, messages, request = running.pop(chunk.request_id)
            m = chunk.result.metrics
            prefill_s += m.prefill_time
            turn = sum(1 for msg in messages if msg["role"] == "user")
            if turn > 1:
                later["tokens"] += m.prompt_tokens
                later["cached"] += m.prompt_tokens_cached
            if turn < len(conversations[conv]):
                queue.append((conv, [*messages, {"role": "assistant", "content": chunk.result.text},
                                     {"role": "user", "content": conversations[conv][turn]}]))
    return {"later_turn_prompt_tokens": later["tokens"], "reused": later["cached"], "prefill_s": prefill_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = load_model(args.model, progress=False)
    tokenizer = load_tokenizer(args.model)
    conversations = [list(q.turns) for q in load_suite(args.suite) if len(q.turns) > 1]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"{len(conversations)} two-turn conversations, {args.clients} at a time on {args.max_batch} slots, "
          f"{args.max_tokens} tokens a turn")
    for label, policy in (("slot released last", take_last_released), ("engine's choice", None)):
        engine = build_engine(model, tokenizer, None, 0, max_batch=args.max_batch)
        if policy is not None:
            engine._free_slots.reverse()  # the stack's order: slot 0 on top
            engine._take_slot = lambda ids, e=engine, take=policy: take(e, ids)
        start = time.perf_counter()
        out = serve(engine, tokenizer, conversations, params, min(args.clients, args.max_batch))
        wall = time.perf_counter() - start
        print(f"{label:20s}: second-turn prompt tokens from the cache {out['reused']} of "
              f"{out['later_turn_prompt_tokens']} ({out['reused'] / out['later_turn_prompt_tokens']:.0%}), "
              f"prefill {out['prefill_s']:.2f} s, all {wall:.2f} s")


if __name__ == "__main__":
    main()
