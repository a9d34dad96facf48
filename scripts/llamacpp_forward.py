"""Our GGUF-native forward against llama.cpp's on the same file, without either engine around it: prefill of
one prompt, then single-token decoding after a short and a long context (ms, best of 2 for prefill, mean of 64
tokens for decoding), and where a decoded token's time goes (head against layers).

    python scripts/llamacpp_forward.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import time

import torch

from specdraft.bench.machine import machine_info
from specdraft.runtime import fused
from specdraft.runtime.loader import gguf_source, load_model, resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--prompts", default="300,1000,1500")
    parser.add_argument("--contexts", default="100,1500")
    args = parser.parse_args()
    from llama_cpp import Llama

    print(machine_info())
    model = load_model(args.model, dtype="gguf", progress=False)
    llm = Llama(model_path=gguf_source(resolve(args.model, progress=False)), n_ctx=4096,
                n_threads=torch.get_num_threads(), n_batch=512, verbose=False)
    g = torch.Generator().manual_seed(0)
    for length in (int(n) for n in args.prompts.split(",")):
        tokens = torch.randint(1000, 30000, (1, length), generator=g)
        ours, theirs = [], []
        for _ in range(2):
            cache = model.new_cache(length + 8)
            start = time.perf_counter()
            model.forward(tokens, cache, logits_from=length - 1)
            ours.append(time.perf_counter() - start)
            llm.reset()
            start = time.perf_counter()
            llm.eval(tokens[0].tolist())
            theirs.append(time.perf_counter() - start)
        print(f"prefill {length} tokens: ours {min(ours) * 1e3:.0f} ms, llama.cpp {min(theirs) * 1e3:.0f} ms",
              flush=True)
    layers_s = [0.0]
    run_layers = fused.FusedCPUBackend.run_layers

    def timed(self, *a, **k):
        start = time.perf_counter()
        out = run_layers(self, *a, **k)
        layers_s[0] += time.perf_counter() - start
        return out

    fused.FusedCPUBackend.run_layers = timed
    for length in (int(n) for n in args.contexts.split(",")):
        tokens = torch.randint(1000, 30000, (1, length), generator=g)
        cache = model.new_cache(length + 80)
        model.forward(tokens, cache, logits_from=length - 1)
        cache.commit(0, length)
        one = torch.tensor([[5]])
        layers_s[0] = 0.0
        start = time.perf_counter()
        for i in range(64):
            model.forward(one, cache)
            cache.commit(0, length + i + 1)
        ours = (time.perf_counter() - start) / 64
        llm.reset()
        llm.eval(tokens[0].tolist())
        start = time.perf_counter()
        for _ in range(64):
            llm.eval([5])
        theirs = (time.perf_counter() - start) / 64
        print(f"decode after {length} tokens: ours {ours * 1e3:.2f} ms/token (layers {layers_s[0] / 64 * 1e3:.2f}, "
              f"head and the rest {(ours - layers_s[0] / 64) * 1e3:.2f}), llama.cpp {theirs * 1e3:.2f}", flush=True)
    head = model.lm_head
    head_bytes = head.kernel_layout()[0]
    print(f"head: {head_bytes / 1e6:.0f} MB ({type(head).__name__}), read once a decoded token")


if __name__ == "__main__":
    main()
