"""`specdraft bench-runtime`: plain greedy decoding speed of our runtime against transformers `generate`, with
the memory-bandwidth floor measured in the same run.

Methods: `ours-bf16`, `ours-fp32` (our `Transformer`, no drafter), `ours-gguf` (the same on a GGUF model's own
quantized blocks, for GGUF models) and `hf-bf16`, `hf-fp32` (transformers on the same converted weights,
`do_sample=False`), all in one process with the same torch thread count. Every
prompt decodes exactly `max_tokens` tokens (EOS ignored) so all methods do the same work. Per prompt, each
method runs `repeats` times (interleaved: prompt -> repeat -> method); the medians are aggregated as total
tokens / total time.

- prefill: ours = the engine's `prefill_time` (prompt forward + first token); transformers = a separate
  `generate(max_new_tokens=1)`. prefill tok/s = prompt tokens / prefill time.
- decode: (tokens - 1) / (total time - prefill time).
- floor: every decoded token reads all weights once (every linear layer and the LM head; the embedding table
  only when it is the tied LM head, counted once); floor ms/token = those bytes / the bandwidth of summing a
  1 GiB tensor (median of 5). KV-cache reads are not counted, so the floor is slightly optimistic.

runtime.json schema (`schema_version` 1; null = not measured):

    {"schema_version": 1, "kind": "specdraft-bench-runtime",
     "header": {"machine": {...}, "versions": {...}, "model": str, "date": str, "command": str},
     "config": {"prompts": int, "suite": str, "max_tokens": int, "repeats": int, "threads": int,
                "chat_template": bool, "ignore_eos": true},
     "bandwidth": {"fp32_gb_s": float, "bf16_gb_s": float, "used_gb_s": float (the higher),
                   "tensor_bytes": int},
     "weights": {"bf16_bytes": int, "fp32_bytes": int, "parameters": int, "tied_embeddings": bool,
                 "bf16_resident_bytes": int,                       # weights held in memory after the run
                 "gguf_bytes": int, "gguf_layouts": {name: layout},   # these three for GGUF models
                 "gguf_resident_bytes": int},
     "native_kernels": {LAYOUT: {"layer": str, "shape": [out, in], "bytes": int, "ms": float, "gb_s": float,
                                 "x_of_floor": float, "bytes_per_weight": float}} | null,
     "methods": {METHOD: {"dtype": "bf16"|"fp32"|"gguf", "engine": "specdraft"|"transformers",
                          "decode_tokens_per_s": float, "ms_per_token": float, "prefill_tokens_per_s": float,
                          "vs_hf_bf16": float|null,    # decode tok/s / hf-bf16's decode tok/s
                          "floor_ms_per_token": float, "x_of_floor": float,  # ms_per_token / floor
                          "decode_tokens": int, "decode_s": float, "prompt_tokens": int, "prefill_s": float}},
     "samples": [{"question_id", "category", "prompt_tokens": int,
                  "methods": {METHOD: {"tokens": int, "total_s": float, "prefill_s": float, "decode_s": float,
                                       "totals_s": [float], "prefills_s": [float]}}}]}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdraft.bench import stats
from specdraft.verify.sampling import SamplingParams

SCHEMA_VERSION = 1
GIB = 1 << 30


def measure_bandwidth(dtype: torch.dtype, nbytes: int = GIB, repeats: int = 5) -> float:
    """Bytes/s of reading an nbytes tensor once (`x.sum()`), median of `repeats` after one warm-up."""
    elem = torch.empty((), dtype=dtype).element_size()
    x = torch.ones(nbytes // elem, dtype=dtype)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    read = x.numel() * elem
    del x
    return read / statistics.median(times)


def weight_bytes_per_token(params: Sequence[tuple[str, torch.Tensor]], embedding: torch.Tensor,
                           lm_head: torch.Tensor | None, dtype_bytes: int | None = None) -> int:
    """Bytes of weights one decoded token reads: every parameter once (shared tensors once), without the input
    embedding table unless it is also the LM head (a lookup reads one row of it, not the table).

    dtype_bytes: count every element at this size (the model's bytes in another dtype)."""
    seen: set[int] = set()
    total = 0
    tied = lm_head is not None and lm_head.data_ptr() == embedding.data_ptr()
    for _, p in params:
        key = p.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        if key == embedding.data_ptr() and not tied:
            continue
        total += p.numel() * (dtype_bytes or p.element_size())
    return total


def floor_ms(weight_bytes: int, bandwidth_bytes_per_s: float) -> float:
    return weight_bytes / bandwidth_bytes_per_s * 1000.0


def aggregate_runtime(samples: Sequence[dict]) -> dict:
    """Per-prompt medians of one method -> decode/prefill throughput (totals over prompts)."""
    decode_tokens = sum(max(0, s["tokens"] - 1) for s in samples)
    decode_s = sum(s["decode_s"] for s in samples)
    prompt_tokens = sum(s["prompt_tokens"] for s in samples)
    prefill_s = sum(s["prefill_s"] for s in samples)
    tps = stats.throughput(decode_tokens, decode_s)
    return {"decode_tokens": decode_tokens, "decode_s": decode_s, "decode_tokens_per_s": tps,
            "ms_per_token": 1000.0 / tps if tps else None, "prompt_tokens": prompt_tokens,
            "prefill_s": prefill_s, "prefill_tokens_per_s": stats.throughput(prompt_tokens, prefill_s)}


def summarize_runs(runs: Sequence[dict]) -> dict:
    """Repeats of one (prompt, method): medians of total and prefill time; decode = their difference."""
    total = statistics.median(r["total_s"] for r in runs)
    prefill = statistics.median(r["prefill_s"] for r in runs)
    return {"tokens": runs[0]["tokens"], "total_s": total, "prefill_s": prefill,
            "decode_s": max(total - prefill, 0.0), "totals_s": [r["total_s"] for r in runs],
            "prefills_s": [r["prefill_s"] for r in runs]}


# -------------------------------------------------------------------------------------------- runners


def ours_runner(engine) -> Callable[[list[int], int], dict]:
    def run(ids: list[int], max_tokens: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.restore_prefixes({})  # prefill the whole prompt every time (no entries left by a repeat)
        t0 = time.perf_counter()
        result = engine.generate(ids, params)
        total = time.perf_counter() - t0
        return {"tokens": len(result.token_ids), "total_s": total, "prefill_s": result.metrics.prefill_time}

    return run


def hf_runner(model) -> Callable[[list[int], int], dict]:
    model.generation_config.eos_token_id = None  # decode exactly max_new_tokens

    def generate(ids: torch.Tensor, n: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
        return out.shape[1] - ids.shape[1], time.perf_counter() - t0

    def run(ids: list[int], max_tokens: int) -> dict:
        x = torch.tensor([ids])
        _, prefill = generate(x, 1)
        tokens, total = generate(x, max_tokens)
        return {"tokens": tokens, "total_s": total, "prefill_s": prefill}

    return run


def build_runtime_results(header: dict, config: dict, bandwidth: dict, weights: dict, method_dtypes: dict,
                          samples: list[dict]) -> dict:
    """samples: [{question_id, category, prompt_tokens, methods: {name: summarize_runs(...)}}]."""
    methods: dict[str, dict] = {}
    for name, (engine, dtype) in method_dtypes.items():
        per = [dict(s["methods"][name], prompt_tokens=s["prompt_tokens"])
               for s in samples if name in s["methods"]]
        agg = aggregate_runtime(per)
        floor = floor_ms(weights[f"{dtype}_bytes"], bandwidth["used_gb_s"] * 1e9)
        agg.update(dtype=dtype, engine=engine, floor_ms_per_token=floor,
                   x_of_floor=agg["ms_per_token"] / floor if agg["ms_per_token"] else None)
        methods[name] = agg
    base = methods.get("hf-bf16", {}).get("decode_tokens_per_s")
    for agg in methods.values():
        agg["vs_hf_bf16"] = stats.speedup(agg["decode_tokens_per_s"], base)
    return {"schema_version": SCHEMA_VERSION, "kind": "specdraft-bench-runtime", "header": header,
            "config": config, "bandwidth": bandwidth, "weights": weights, "methods": methods,
            "samples": samples}


def native_kernel_rates(model, bandwidth_gb_s: float, repeats: int = 30) -> dict:
    """Per GGUF-native layout the kernels read (`GGUFLinear.kernel_layout`: q4, q8, q8h, each with fp32 or
    fp16 scales): one decoding row (M = 1) through the model's largest layer of that layout, median time, the
    bytes it reads and the fraction of the machine's bandwidth that reaches."""
    from specdraft.runtime import cpu_kernels
    from specdraft.runtime.gguf_native import FORMAT_NAMES, GGUFLinear

    largest: dict[int, tuple[str, GGUFLinear, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, GGUFLinear):
            nbytes, layout = module.kernel_layout()
            best = largest.get(layout)
            if best is None or nbytes > best[2]:
                largest[layout] = (name, module, nbytes)
    rates = {}
    for layout, (name, layer, nbytes) in sorted(largest.items()):
        x = torch.randn(1, layer.in_features).to(torch.bfloat16)
        for _ in range(3):
            layer(x)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        half = " fp16 scales" if layout & cpu_kernels.HALF else ""
        rates[FORMAT_NAMES[layout & ~cpu_kernels.HALF] + half] = {
            "layer": name, "shape": [layer.out_features, layer.in_features], "bytes": nbytes,
            "ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9,
            "x_of_floor": seconds / (nbytes / (bandwidth_gb_s * 1e9)),
            "bytes_per_weight": nbytes / (layer.out_features * layer.in_features)}
    return rates


def render_table(results: dict) -> str:
    from specdraft.bench.report import _f, _table

    rows = []
    for name, m in results["methods"].items():
        rows.append([name, _f(m["decode_tokens_per_s"], ".1f"), _f(m["ms_per_token"], ".2f"),
                     _f(m["vs_hf_bf16"], ".2f") + ("x" if m["vs_hf_bf16"] is not None else ""),
                     _f(m["floor_ms_per_token"], ".2f"), _f(m["x_of_floor"], ".1f") + "x",
                     _f(m["prefill_tokens_per_s"], ".0f")])
    bw, w = results["bandwidth"], results["weights"]
    lines = [f"memory bandwidth (sum of a 1 GiB tensor): fp32 {bw['fp32_gb_s']:.1f} GB/s, bf16 "
             f"{bw['bf16_gb_s']:.1f} GB/s; floor uses {bw['used_gb_s']:.1f} GB/s",
             f"weights read per token: bf16 {w['bf16_bytes'] / 1e6:.1f} MB, fp32 "
             f"{w['fp32_bytes'] / 1e6:.1f} MB ({w['parameters'] / 1e6:.1f}M parameters, tied embeddings: "
             f"{w['tied_embeddings']})", ""]
    if "gguf_bytes" in w:
        lines.insert(2, f"GGUF-native weights read per token: {w['gguf_bytes'] / 1e6:.1f} MB")
    if "bf16_resident_bytes" in w:
        held = f"bf16 {w['bf16_resident_bytes'] / 1e6:.1f} MB"
        if "gguf_resident_bytes" in w:
            held += f", GGUF-native {w['gguf_resident_bytes'] / 1e6:.1f} MB"
        lines.insert(3 if "gguf_bytes" in w else 2, f"weights held in memory (after the run): {held}")
    lines += _table(["method", "decode tok/s", "ms/token", "vs hf-bf16", "floor ms/token", "x of floor",
                     "prefill tok/s"], rows)
    if results.get("native_kernels"):
        lines += ["", "GGUF-native kernels, one row through the largest layer of each layout:"]
        lines += _table(["layout", "layer", "bytes/weight", "ms", "GB/s", "x of floor"],
                        [[fmt, k["layer"], f"{k['bytes_per_weight']:.3f}", f"{k['ms']:.3f}", f"{k['gb_s']:.1f}",
                          f"{k['x_of_floor']:.2f}x"] for fmt, k in results["native_kernels"].items()])
    return "\n".join(lines)


def run_runtime_bench(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    if args.verify_curve:
        from specdraft.bench.verify_curve import run_verify_curve

        return run_verify_curve(args, argv)
    from specdraft.bench.interleave import interleaved
    from specdraft.bench.machine import header as machine_header
    from specdraft.bench.machine import header_lines
    from specdraft.bench.specbench import PromptBuilder
    from specdraft.bench.suite import DEFAULT_SUITE, DEV_SUITE, load_suite, spread
    from specdraft.engine.core import Engine
    from specdraft.errors import SpecdraftError
    from specdraft.runtime.loader import gguf_source, load_model, load_tokenizer, resolve

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompts < 1 or args.repeats < 1 or args.max_tokens < 2:
        raise SpecdraftError("--prompts and --repeats must be >= 1, --max-tokens >= 2")
    suite = Path(args.suite) if args.suite else (DEV_SUITE if DEV_SUITE.exists() else DEFAULT_SUITE)
    questions = spread(load_suite(suite), args.prompts)
    header = machine_header(argv)
    header.update(model=args.model)
    for line in header_lines(header):
        print(line, file=sys.stderr)

    tokenizer = load_tokenizer(args.model)
    runners: dict[str, Callable] = {}
    method_dtypes: dict[str, tuple[str, str]] = {}
    ours = {}
    for dtype in ("bf16", "fp32"):
        model = load_model(args.model, dtype=dtype, device="cpu")
        ours[dtype] = model
        engine = Engine(model, tokenizer, None, 0)
        runners[f"ours-{dtype}"] = ours_runner(engine)
        method_dtypes[f"ours-{dtype}"] = ("specdraft", dtype)
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        for dtype, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            hf = AutoModelForCausalLM.from_pretrained(resolve(args.model, progress=False), dtype=tdt).eval()
            runners[f"hf-{dtype}"] = hf_runner(hf)
            method_dtypes[f"hf-{dtype}"] = ("transformers", dtype)
        hf_logging.enable_progress_bar()

    m = ours["bf16"]
    named = list(m.named_parameters())
    weights = {"bf16_bytes": weight_bytes_per_token(named, m.embed.weight, m.lm_head.weight, 2),
               "fp32_bytes": weight_bytes_per_token(named, m.embed.weight, m.lm_head.weight, 4),
               "parameters": sum(p.numel() for _, p in named),
               "tied_embeddings": m.lm_head.weight.data_ptr() == m.embed.weight.data_ptr()}
    native = None
    if not args.no_gguf and gguf_source(resolve(args.model, progress=False)) is not None:
        from specdraft.runtime.gguf_native import native_bytes

        native = load_model(args.model, dtype="gguf", device="cpu")
        runners["ours-gguf"] = ours_runner(Engine(native, tokenizer, None, 0))
        method_dtypes["ours-gguf"] = ("specdraft", "gguf")
        weights["gguf_bytes"] = native_bytes(native)
        weights["gguf_layouts"] = dict(native.native_report.native)

    print("measuring memory bandwidth (1 GiB tensors)", file=sys.stderr)
    bw_fp32 = measure_bandwidth(torch.float32)
    bw_bf16 = measure_bandwidth(torch.bfloat16)
    bandwidth = {"fp32_gb_s": bw_fp32 / 1e9, "bf16_gb_s": bw_bf16 / 1e9,
                 "used_gb_s": max(bw_fp32, bw_bf16) / 1e9, "tensor_bytes": GIB}

    kernels = native_kernel_rates(native, bandwidth["used_gb_s"]) if native is not None else None
    build = PromptBuilder(tokenizer)
    prompts = [build(q.turns[:1], []) for q in questions]
    for run in runners.values():  # warm-up
        run(prompts[0], min(8, args.max_tokens))
    methods = {name: (lambda item, _repeat, run=run: run(item[1], args.max_tokens)) for name, run in runners.items()}
    raw = interleaved(list(zip(questions, prompts, strict=True)), methods, args.repeats, "bench-runtime",
                      progress=not args.no_progress, label=lambda item: item[0].category)
    samples = [{"question_id": q.question_id, "category": q.category, "prompt_tokens": len(ids),
                "methods": {name: summarize_runs(rs) for name, rs in runs.items()}}
               for (q, ids), runs in zip(zip(questions, prompts), raw, strict=True)]

    config = {"prompts": len(prompts), "suite": str(suite), "max_tokens": args.max_tokens,
              "repeats": args.repeats, "threads": torch.get_num_threads(), "chat_template": build.chat,
              "ignore_eos": True}
    from specdraft.runtime.gguf_native import resident_bytes

    weights["bf16_resident_bytes"] = resident_bytes(ours["bf16"])  # after the run: its panels are built
    if native is not None:
        weights["gguf_resident_bytes"] = resident_bytes(native)
    results = build_runtime_results(header, config, bandwidth, weights, method_dtypes, samples)
    results["native_kernels"] = kernels
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(render_table(results))
    print(f"wrote {out / 'runtime.json'}", file=sys.stderr)
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="catalog name, HF directory or .gguf file")
    p.add_argument("--prompts", type=int, default=12, help="prompts, spread over the suite's categories")
    p.add_argument("--suite", default=None,
                   help="JSONL suite (default: ../shared/data/specbench-dev.jsonl if present, else the "
                        "bundled mini suite)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens decoded per prompt (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, help="runs per prompt and method; medians")
    p.add_argument("--threads", type=int, default=None, help="torch threads for every method")
    p.add_argument("--out", default="bench-out",
                   help="output directory for runtime.json (default: bench-out/)")
    p.add_argument("--no-hf", action="store_true", help="only our runtime (skip transformers)")
    p.add_argument("--no-gguf", action="store_true",
                   help="skip ours-gguf (a GGUF model on its own quantized blocks; run by default for GGUF models)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verify-curve", action="store_true",
                   help="instead: time one forward over M = 1..64 new tokens against one token, for each model "
                        "in --model (comma list; NAME@gguf: on its GGUF blocks), with the machine's bandwidth and "
                        "compute bounds; writes "
                        "verify_curve.json and verify_curve.png")
    p.add_argument("--prefix", type=int, default=128, help="--verify-curve: committed tokens before the block")
