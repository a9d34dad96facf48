"""How large an EAGLE head's draft vocabulary should be: what each size covers against what it costs a step.

    python scripts/draft_vocab_sweep.py --model smollm2-135m --data DATA [--sizes 4096,6144,8192,12288,16384,all]
        [--suite ../shared/data/specbench-dev.jsonl] [--prompts 8] [--max-tokens 128] [--repeats 1]

A head drafts only tokens of its draft vocabulary (the N most frequent target tokens of the distillation data,
`draft_vocabulary`), so the share of the target's tokens inside it bounds every draft position's acceptance,
while its lm_head rows (N x hidden size) are read from memory at every draft step. For each size this prints:
- coverage: the share of tokens inside the vocabulary, in DATA's training sequences (prompts and responses, as
  the vocabulary was counted), in DATA's held-out responses and in the target's greedy answers to dev-suite
  prompts (other text: what drafting meets);
- the head's size in bf16 (the package ships heads of at most 25 MB) and one chain draft step against one
  target step, timed as `specdraft bench-draft` times them (K = 3, the same prompts, interleaved; a head
  with random weights: a step's time does not depend on what the weights are).
"""

from __future__ import annotations

import argparse

import torch

from specdraft.bench.draft_cost import measure_draft_cost
from specdraft.bench.machine import header, header_lines
from specdraft.bench.suite import load_suite, spread
from specdraft.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.train.data import load_split, read_shard, split_shards
from specdraft.train.loop import draft_vocabulary
from specdraft.verify.sampling import SamplingParams


def held_out_responses(data_dir: str) -> list[list[int]]:
    """The response tokens (after each prompt) of DATA's validation split."""
    out = []
    for path in split_shards(data_dir, "val"):
        seqs, prompt_lens = read_shard(path)
        out += [seq[n:] for seq, n in zip(seqs, prompt_lens)]
    return out


def coverage(vocab: torch.Tensor, sequences: list[list[int]]) -> float:
    inside = set(vocab.tolist())
    tokens = [t for seq in sequences for t in seq]
    return sum(t in inside for t in tokens) / max(1, len(tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", required=True, help="a `specdraft distill` output directory")
    parser.add_argument("--sizes", default="4096,6144,8192,12288,16384,all")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print("\n".join(header_lines(header())))
    target, tokenizer = load_model(args.model, progress=False), load_tokenizer(args.model)
    full = target.config.vocab_size
    sizes = [full if s == "all" else min(int(s), full) for s in args.sizes.split(",")]
    train = load_split(args.data, "train")
    held_out = held_out_responses(args.data)
    prompts = [tokenizer.prompt_ids(q.turns[0], chat=tokenizer.has_chat_template)
               for q in spread(load_suite(args.suite), args.prompts)]
    plain = Engine(target, tokenizer, None, 0, AdaptiveConfig())
    answers = [plain.generate(ids, SamplingParams(temperature=0, max_tokens=args.max_tokens)).token_ids
               for ids in prompts]
    vocabs = {n: draft_vocabulary(train, n, full) for n in sizes}
    drafters = {}
    for n in sizes:
        head = EagleHead(EagleConfig.for_target(target, draft_vocab_size=n)).init_weights(0)
        head.set_draft_vocab(vocabs[n])
        drafters[n] = EagleDrafter(head, target, name=f"eagle-{n}")
    cost = measure_draft_cost(target, tokenizer, prompts, drafters, 3, args.max_tokens, args.repeats)
    print(f"{len(train)} training sequences, {sum(map(len, held_out))} held-out response tokens, "
          f"{sum(map(len, answers))} dev-suite answer tokens ({len(prompts)} prompts); plain step "
          f"{cost['plain_step_ms']:.2f} ms")
    print("| draft vocabulary | covers, training sequences | held-out responses | dev-suite answers | head, bf16 | "
          "draft step / target step |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        head_mb = sum(p.numel() for p in drafters[n].head.parameters()) * 2 / 1e6
        step = cost["drafters"][n]["step_ratio"]
        print(f"| {n:,} | {coverage(vocabs[n], train):.4f} | {coverage(vocabs[n], held_out):.4f} | "
              f"{coverage(vocabs[n], answers):.4f} | {head_mb:.1f} MB | {step:.3f} |")


if __name__ == "__main__":
    main()
