"""Forward time of a GGUF-native SmolLM2 at long contexts: B sequences x 1 new token after C committed tokens
each (medians of 31). The figures behind the key panels (runtime/kv_cache.py `enable_key_panels`).

    python scripts/bench_attention_context.py LABEL
"""
import time, torch, sys
from specdraft.runtime.loader import load_model
m = load_model("smollm2-135m", dtype="gguf", progress=False)
g = torch.Generator().manual_seed(0)
res = []
for ctx in (1000, 2000):
    cache = m.new_cache(ctx + 64, 8)
    for s in range(8):
        m.forward(torch.randint(100, 20000, (1, ctx), generator=g), cache, slots=[s], logits_from=ctx-1); cache.commit(s, ctx)
    for B, T in ((1, 1), (4, 1), (8, 1)):
        tok = torch.randint(100, 20000, (B, T), generator=g)
        for _ in range(3): m.forward(tok, cache, slots=list(range(B)))
        ts = []
        for _ in range(31):
            t = time.perf_counter(); m.forward(tok, cache, slots=list(range(B))); ts.append(time.perf_counter() - t)
        ts.sort(); res.append(f"c{ctx}:{B}x{T}={ts[15]*1e3:.1f}")
print(sys.argv[1], " ".join(res), flush=True)
