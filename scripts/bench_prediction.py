"""Predicted Outputs (`SamplingParams.prediction`) on editing tasks: plain decoding, `ngram`, and `ngram` with the
text being edited as the prediction, greedy, the three in turn within each pass (`bench.interleave`); medians of
the passes, tokens per target forward, and a check that the three give the same tokens.

The tasks ask the chat model to rewrite a piece of code with one change (rename a name, add type hints,
reword a docstring): their answers repeat most of the code, which the prediction holds from its first token
on, where prompt lookup must first see a piece of the answer to find it in the prompt. The code is this
package's own (a few small functions), so nothing is downloaded.

    .venv/bin/python scripts/bench_prediction.py [--model smollm2-135m] [--dtype auto] [--max-tokens 160]
        [--passes 3]
"""

from __future__ import annotations

import argparse
import inspect
import time

from specdraft.bench.interleave import alternated_medians, print_rates
from specdraft.bench.machine import header, header_lines
from specdraft.config import target_dtype
from specdraft.engine.core import build_engine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.smoothing import ema, geometric_ema, timing_ema
from specdraft.verify.sampling import SamplingParams

TASKS = [
    (ema, "Rename the parameter `weight` to `alpha` in this Python function and change nothing else."),
    (timing_ema, "Rewrite this Python function with the docstring shortened to one line."),
    (geometric_ema, "Rename the function to `log_ema` and change nothing else."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    print("\n".join(header_lines({**header(), "model": args.model})))
    target = load_model(args.model, dtype=target_dtype(args.dtype, "ngram"), progress=False)
    tokenizer = load_tokenizer(args.model, progress=False)
    tasks = []
    for fn, instruction in TASKS:
        code = inspect.getsource(fn)
        messages = [{"role": "user", "content": f"{instruction}\n\n```python\n{code}```"}]
        tasks.append((tokenizer.prompt_ids(messages, chat=True), f"```python\n{code}```"))
    engines = {"plain": build_engine(target, tokenizer, None, 0), "ngram": build_engine(target, tokenizer, "ngram", 5)}
    engines["ngram + prediction"] = engines["ngram"]
    outputs: dict[str, list[list[int]]] = {}
    forwards = {name: [0, 0] for name in engines}  # tokens, target forwards
    predicted = [0, 0]  # the prediction's draft tokens accepted, rejected (OpenAI's usage figures)

    def decode(name: str) -> float:
        engine = engines[name]
        engine.restore_prefixes({})
        start, tokens, got = time.perf_counter(), 0, []
        for ids, code in tasks:
            prediction = code if name == "ngram + prediction" else None
            result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                         prediction=prediction))
            tokens += len(result.token_ids)
            got.append(result.token_ids)
            forwards[name][0] += result.metrics.produced_tokens
            forwards[name][1] += result.metrics.target_forwards
            predicted[0] += result.metrics.prediction_accepted
            predicted[1] += result.metrics.prediction_drafted - result.metrics.prediction_accepted
        if outputs.setdefault(name, got) != got or got != outputs.get("plain", got):
            raise SystemExit(f"{name}: the output differs from plain decoding's")
        return tokens / (time.perf_counter() - start)

    rates = alternated_medians({name: lambda name=name: decode(name) for name in engines}, args.passes, "decoding")
    print_rates("greedy decoding of the editing tasks", rates, "tok/s")
    print("tokens per target decode forward: " + ", ".join(
        f"{name} {tokens / count:.2f}" for name, (tokens, count) in forwards.items() if count))
    print(f"the prediction's draft tokens, all passes: {predicted[0]} accepted, {predicted[1]} rejected")
    print(f"outputs identical to plain decoding's in every pass ({sum(len(o) for o in outputs['plain'])} tokens)")


if __name__ == "__main__":
    main()
