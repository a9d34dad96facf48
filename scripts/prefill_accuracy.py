"""How close a long prompt's last rows come to the model's fp32 forward, prefilled through the fused kernels'
chunks and through one GEMM over the prompt: KL(fp32 || each) and top-1 agreement over the last 200 rows, on the
dev suite's prompts joined into one text, per prompt length. The accuracy side of `CHUNKED_PREFILL_TOKENS`
(runtime/model.py); `scripts/bench_prefill.py` is its speed side.

    .venv/bin/python scripts/prefill_accuracy.py [--models gemma3-270m,smollm2-135m] [--lengths 1800,3000,5000]
"""

from __future__ import annotations

import argparse

import torch

from specdraft.bench.machine import machine_info
from specdraft.bench.suite import load_suite
from specdraft.runtime import model as model_module
from specdraft.runtime.loader import load_model, load_tokenizer

ROWS = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma3-270m,smollm2-135m")
    parser.add_argument("--lengths", default="1800,3000,5000")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    args = parser.parse_args()
    print(machine_info())
    text = " ".join(question.turns[0] for question in load_suite(args.suite))
    for name in args.models.split(","):
        ids = load_tokenizer(name, progress=False).encode(text)
        model = load_model(name, dtype="auto", progress=False)
        reference = load_model(name, dtype="fp32", progress=False)
        for n in (int(x) for x in args.lengths.split(",")):
            tokens = torch.tensor([ids[:n]])
            want = torch.log_softmax(reference(tokens, reference.new_cache(n + 8), logits_from=n - ROWS).float(), -1)
            for label, limit in (("chunks", 1 << 30), ("one GEMM", 0)):
                model_module.CHUNKED_PREFILL_TOKENS = limit
                got = torch.log_softmax(model(tokens, model.new_cache(n + 8), logits_from=n - ROWS).float(), -1)
                kl = (want.exp() * (want - got)).sum(-1).mean().item()
                agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
                print(f"{name} {n} tokens, {label}: KL(fp32 || it) {kl:.4f}, top-1 agreement {agree:.3f}", flush=True)


if __name__ == "__main__":
    main()
