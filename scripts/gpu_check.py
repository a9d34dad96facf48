"""What specdraft's promises look like on a CUDA GPU (PyTorch ops: the runtime's C kernels are CPU-only).

The bit-for-bit guarantees on CPU rest on the fused kernels' row invariance: a token's logits do not depend on
the block, tree or batch it is scored in. On a GPU the runtime runs PyTorch ops (cuBLAS, SDPA), which promise
no such thing. This script measures, on a model of SmolLM2-135M's shape with random weights (the bundled
checkpoints do not travel to a GPU machine here; shapes, not weights, set the costs and the kernels cuBLAS
picks):
  1. row invariance: logits of tokens scored in blocks of M (and in a batch of 8 sequences) against the same
     tokens scored one at a time: bit-identical rows, max |difference|, rows whose argmax differs;
  2. greedy identity through the whole engine: speculative output against plain output (ngram chains and
     trees, the `self:N` early-exit draft), batched and alone;
  3. costs: plain decoding ms per token, and the verify curve (one forward over M new tokens against one).

    PYTHONPATH=. python scripts/gpu_check.py --out DIR        # cuda if present, else cpu (a dry run)

Writes gpu_check.json to DIR and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdraft.engine.core import build_engine
from specdraft.runtime.config import ModelConfig
from specdraft.runtime.model import Transformer
from specdraft.verify.sampling import SamplingParams

SMOLLM2_SHAPE = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 100000.0,
    "eos_token_id": None,
}


class NumberTokenizer:
    """Token i is the word 't<i> ': enough of a tokenizer for the engine (no EOS, no chat template)."""

    eos_token_ids = frozenset()
    has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids) -> str:
        return "".join(f"t{int(i)} " for i in ids)


def random_model(layers: int, dtype: torch.dtype, device: str, repetitive: bool, seed: int = 0) -> Transformer:
    """SmolLM2's shape with random weights. `repetitive`: large embeddings tied to the head, so the model
    repeats its input and drafts are accepted (for speed); else small embeddings and larger layers, so its
    next-token distributions are nearly flat and its outputs varied: near-ties everywhere, where any bit a
    row's logits owe to its block would show as a changed argmax (for identity)."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_hf_dict({**SMOLLM2_SHAPE, "num_hidden_layers": layers}))
    embed_std, layer_gain = (1.0, 0.5) if repetitive else (0.02, 1.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed" in name:
                p.normal_(0.0, embed_std)
            else:
                p.normal_(0.0, layer_gain / p.shape[-1] ** 0.5)
    model = model.to(device=device, dtype=dtype).eval()
    model.init_rope_tables(device)
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def row_invariance(model: Transformer, device: str, prefix: int = 64) -> dict:
    """Logits of the tokens of blocks of M (one sequence) and of 8 one-token sequences, against each token
    scored alone after the same committed keys."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    out = {}
    for M in (2, 8, 32):
        tokens = torch.randint(0, vocab, (1, prefix + M), generator=g).to(device)
        cache = model.new_cache(prefix + M + 8, 1)
        model.forward(tokens[:, :prefix], cache, logits_from=prefix - 1)
        cache.commit(0, prefix)
        block = model.forward(tokens[:, prefix:], cache)[0].float()
        alone = []
        for i in range(M):
            alone.append(model.forward(tokens[:, prefix + i:prefix + i + 1], cache)[0, 0].float())
            cache.commit(0, prefix + i + 1)
        alone = torch.stack(alone)
        out[f"block_{M}"] = _compare(block, alone)
    B = 8
    tokens = torch.randint(0, vocab, (B, prefix + 1), generator=g).to(device)
    cache = model.new_cache(prefix + 8, B)
    model.forward(tokens[:, :prefix], cache, logits_from=prefix - 1)
    for s in range(B):
        cache.commit(s, prefix)
    batched = model.forward(tokens[:, prefix:], cache)[:, 0].float()
    alone = torch.stack([model.forward(tokens[s:s + 1, prefix:], cache, slots=[s])[0, 0].float() for s in range(B)])
    out["batch_8"] = _compare(batched, alone)
    return out


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"rows": a.shape[0], "identical_rows": int((a == b).all(-1).sum()),
            "max_abs_diff": float((a - b).abs().max()), "argmax_differs": int((a.argmax(-1) != b.argmax(-1)).sum())}


def greedy_identity(model: Transformer, tokenizer: NumberTokenizer, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = build_engine(model, tokenizer, None, max_batch=len(prompts))
    alone = [plain.generate(p, params).token_ids for p in prompts]
    batched = [r.token_ids for r in plain.generate_many(prompts, [params] * len(prompts))]
    out = {"plain_batched_vs_alone": _identical(batched, alone)}
    for name, spec, tree in (("ngram_chains", "ngram", 0), ("ngram_tree8", "ngram", 8),
                             ("self8_chains", "self:8", 0), ("self8_tree8", "self:8", 8)):
        engine = build_engine(model, tokenizer, spec, num_speculative_tokens=5, adaptive=False,
                              max_batch=len(prompts), tree=tree)
        spec_alone = [engine.generate(p, params) for p in prompts]
        spec_batched = [r.token_ids for r in engine.generate_many(prompts, [params] * len(prompts))]
        drafted = sum(r.metrics.drafted for r in spec_alone)
        accepted = sum(r.metrics.accepted for r in spec_alone)
        out[name] = {"alone_vs_plain": _identical([r.token_ids for r in spec_alone], alone),
                     "batched_vs_plain": _identical(spec_batched, alone),
                     "drafted": drafted, "accepted": accepted}
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=7, ignore_eos=True)
    for name, spec, tree in (("plain", None, 0), ("ngram_chains", "ngram", 0), ("ngram_tree8", "ngram", 8)):
        engine = build_engine(model, tokenizer, spec, num_speculative_tokens=5, max_batch=len(prompts), tree=tree)
        once, again = (engine.generate_many(prompts, [sampled] * len(prompts)) for _ in range(2))
        out[f"sampled_{name}"] = {"tokens": sum(len(r.token_ids) for r in once),
                                  "same_seed_same_output": _identical([r.token_ids for r in again],
                                                                      [r.token_ids for r in once])}
    return out


def _identical(got: list[list[int]], want: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), None) for g, w in zip(got, want)]
    return {"identical": sum(f is None for f in first), "of": len(want),
            "first_divergence": [f for f in first if f is not None]}


def costs(model: Transformer, device: str, repeats: int = 20) -> dict:
    g = torch.Generator().manual_seed(2)
    vocab, prefix = model.config.vocab_size, 128
    cache = model.new_cache(prefix + 80, 1)
    model.forward(torch.randint(0, vocab, (1, prefix), generator=g).to(device), cache, logits_from=prefix - 1)
    cache.commit(0, prefix)
    curve = {}
    for M in (1, 2, 4, 8, 16, 32, 64):
        tokens = torch.randint(0, vocab, (1, M), generator=g).to(device)
        times = []
        for i in range(repeats + 3):
            sync(device)
            t = time.perf_counter()
            model.forward(tokens, cache)
            sync(device)
            if i >= 3:
                times.append(time.perf_counter() - t)
        curve[M] = statistics.median(times) * 1e3
    return {"forward_ms": curve, "verify_curve": {M: curve[M] / curve[1] for M in curve}}


def decode_rate(model: Transformer, tokenizer: NumberTokenizer, prompt: list[int], device: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    out = {}
    for name, spec, tree in (("plain", None, 0), ("ngram", "ngram", 0), ("ngram_tree16", "ngram", 16)):
        engine = build_engine(model, tokenizer, spec, num_speculative_tokens=5, tree=tree)
        engine.generate(prompt, params)
        rates = []
        for _ in range(3):
            sync(device)
            t = time.perf_counter()
            result = engine.generate(prompt, params)
            sync(device)
            rates.append(len(result.token_ids) / (time.perf_counter() - t))
        out[name] = {"tok_s": statistics.median(rates), "tokens_per_forward": result.metrics.mean_accepted_length}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--layers", type=int, default=SMOLLM2_SHAPE["num_hidden_layers"])
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"torch": torch.__version__, "platform": platform.platform(), "device": device,
              "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "runs": {}}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    tokenizer = NumberTokenizer()
    g = torch.Generator().manual_seed(3)
    phrases = [torch.randint(0, 49152, (12,), generator=g).tolist() for _ in range(8)]
    prompts = [p * 3 for p in phrases]  # repetition, so that the n-gram drafter finds something
    dtypes = [torch.bfloat16, torch.float32] if device == "cuda" else [torch.bfloat16]
    for dtype in dtypes:
        varied = random_model(args.layers, dtype, device, repetitive=False)
        repetitive = random_model(args.layers, dtype, device, repetitive=True)
        name = str(dtype).removeprefix("torch.")
        run = {}
        parts = (("row_invariance", row_invariance, (varied, device)),
                 ("greedy_identity", greedy_identity, (varied, tokenizer, prompts, args.max_tokens)),
                 ("costs", costs, (varied, device)),
                 ("decode_repetitive", decode_rate, (repetitive, tokenizer, prompts[0], device)))
        for part, fn, fn_args in parts:
            t = time.perf_counter()
            try:
                run[part] = fn(*fn_args)
            except Exception as exc:  # report and go on: the other parts still say something
                run[part] = {"error": f"{type(exc).__name__}: {exc}"}
            print(name, part, f"({time.perf_counter() - t:.1f} s)", json.dumps(run[part]), flush=True)
        report["runs"][name] = run
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print("wrote", args.out / "gpu_check.json")


if __name__ == "__main__":
    main()
