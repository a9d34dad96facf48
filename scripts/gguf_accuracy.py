"""How close each runtime's logits are to the fp32 reference dequantization of a GGUF model.

For each of N dev prompts (chat template), the fp32 model's greedy continuation of 48 tokens fixes a sequence;
every runtime then scores the whole sequence, and at every position we compare its logits with fp32's:
max |difference| (median and worst over prompts) and top-1 agreement. Runtimes: ours in bf16, ours on the
GGUF blocks (`gguf`), and llama.cpp on the same file (llama-cpp-python, if installed). A whole sequence in
one forward takes the GGUF runtime's prompt path (a GEMM); `gguf, blocks of 8` scores it 8 tokens a forward,
the integer kernels decoding and verification use, with the 8-bit output layer (Q8_0 in both bundled models)
on 16-bit and on int8 activations (`cpu_kernels.q8_int8_activations`, where the CPU has VNNI).

    python scripts/gguf_accuracy.py --model smollm2-135m --prompts 6
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from specdraft.bench.machine import machine_info
from specdraft.bench.suite import load_suite
from specdraft.runtime import cpu_kernels
from specdraft.runtime.loader import gguf_source, load_model, load_tokenizer, resolve
from specdraft.verify.sampling import SamplingParams


def sequences(fp32, tokenizer, prompts: list[str], new_tokens: int) -> list[list[int]]:
    from specdraft.engine.core import build_engine

    engine = build_engine(fp32, tokenizer, None)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = []
    for prompt in prompts:
        chat = tokenizer.has_chat_template
        ids = tokenizer.prompt_ids([{"role": "user", "content": prompt}] if chat else prompt, chat=chat)
        out.append(ids + engine.generate(ids, params).token_ids)
    return out


def ours(model, seq: list[int]) -> torch.Tensor:
    return model(torch.tensor([seq]), model.new_cache(len(seq) + 32)).float()[0]


def ours_in_blocks(model, seq: list[int], block: int = 8) -> torch.Tensor:
    cache = model.new_cache(len(seq) + 32)
    out = []
    for start in range(0, len(seq), block):
        out.append(model(torch.tensor([seq[start:start + block]]), cache).float()[0])
        cache.commit(0, min(len(seq), start + block))
    return torch.cat(out)


def llamacpp_logits(path: Path, seqs: list[list[int]]) -> list[torch.Tensor] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_ctx=1024, logits_all=True, verbose=False, n_threads=torch.get_num_threads())
    out = []
    for seq in seqs:
        llm.reset()
        llm.eval(seq)
        out.append(torch.tensor(llm.scores[:len(seq)], dtype=torch.float32))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args()
    print(machine_info())
    torch.manual_seed(0)
    suite = load_suite(args.suite)
    step = max(1, len(suite) // args.prompts)
    prompts = [suite[i].turns[0] for i in range(0, step * args.prompts, step)]
    tokenizer = load_tokenizer(args.model, progress=False)
    fp32 = load_model(args.model, dtype="fp32", progress=False)
    seqs = sequences(fp32, tokenizer, prompts, args.new_tokens)
    reference = [ours(fp32, s) for s in seqs]
    del fp32
    runs: dict[str, list[torch.Tensor] | None] = {}
    for dtype in ("bf16", "gguf"):
        model = load_model(args.model, dtype=dtype, progress=False)
        runs[dtype] = [ours(model, s) for s in seqs]
        if dtype == "gguf" and cpu_kernels.available():
            before = cpu_kernels.q8_int8_activations()
            for int8 in (False, True):
                cpu_kernels.q8_int8_activations(int8)
                if cpu_kernels.q8_int8_activations() == int8:
                    name = f"gguf, blocks of 8, output layer on {'int8' if int8 else '16-bit'} activations"
                    runs[name] = [ours_in_blocks(model, s) for s in seqs]
            cpu_kernels.q8_int8_activations(before)
        del model
    source = gguf_source(resolve(args.model, progress=False))
    runs["llama.cpp"] = llamacpp_logits(Path(source), seqs) if source else None
    report = {}
    for name, logits in runs.items():
        if logits is None:
            continue
        worst = [(got - want).abs().max().item() for got, want in zip(logits, reference)]
        agree = sum(int((got.argmax(-1) == want.argmax(-1)).sum()) for got, want in zip(logits, reference))
        report[name] = {"max_abs_median": statistics.median(worst), "max_abs_worst": max(worst),
                        "top1_agreement": agree / sum(len(s) for s in seqs)}
        print(f"{name:10s}: max |logit - fp32| median {report[name]['max_abs_median']:.2f} worst "
              f"{report[name]['max_abs_worst']:.2f}; top-1 agreement {100 * report[name]['top1_agreement']:.1f}%")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "prompts": len(seqs), "report": report}, indent=1))


if __name__ == "__main__":
    main()
