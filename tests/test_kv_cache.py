"""KV cache semantics on tiny random models (fast, fp32 unless stated): rollback, block vs incremental scoring
(also bit-identical in bf16), token trees + compaction, several slots in one forward, Gemma 3's sliding
window against a brute-force reference, and a full context. One slow test checks bf16 bit-exactness of
verification-sized blocks on the bundled models, whose shapes pick different matmul kernels than tiny ones.

Two tiny configs: a 2-layer Llama (GQA: 4 query heads on 2 KV heads) and a 2-layer Gemma 3 (qk-norm, scaled
embeddings, (1 + w) norms, one sliding layer with a window of 4 and one full layer).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from specdraft.errors import ContextOverflowError
from specdraft.runtime import ModelConfig, Transformer, cpu_kernels
from specdraft.runtime.model import apply_rope

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 32, 4, 2, 8, 4
FP32_ATOL = 1e-5


def tiny_config(family: str) -> ModelConfig:
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_layers=2, num_heads=HEADS,
                  num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, max_position_embeddings=1024,
                  attn_scale=HEAD_DIM**-0.5)
    if family == "llama":
        return ModelConfig(model_type="llama", layer_types=["full", "full"], tie_word_embeddings=False,
                           **common)
    return ModelConfig(model_type="gemma3_text", layer_types=["sliding", "full"], sliding_window=WINDOW,
                       rope_theta=1e6, rope_local_theta=1e4, qk_norm=True, hidden_act="gelu_pytorch_tanh",
                       embed_scale=HIDDEN**0.5, tie_word_embeddings=True, **common)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(family))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Llama norms scale by w (around 1), Gemma norms by 1 + w (w around 0)
                torch.nn.init.normal_(param, mean=0.0 if model.config.is_gemma else 1.0, std=0.1)
            else:
                torch.nn.init.normal_(param, std=0.1 if "embed" not in name else 1.0)
    return model.to(dtype).eval()  # the RoPE tables stay fp32 (Transformer.init_rope_tables)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request) -> Transformer:
    return tiny_model(request.param)


def seq(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def score(model, cache, ids: list[int], commit: bool = True, slot: int = 0) -> torch.Tensor:
    """Logits [T, V] of `ids` appended to `slot`, committing them unless told not to."""
    logits = model(torch.tensor([ids]), cache, slots=[slot])[0]
    if commit:
        cache.commit(slot, cache.length(slot) + len(ids))
    return logits


def incremental(model, cache, ids: list[int]) -> torch.Tensor:
    return torch.cat([score(model, cache, [t]) for t in ids])


def reference_forward(model: Transformer, ids: list[int]) -> torch.Tensor:
    """Brute force, no cache: every query position attends to keys 0..i (only the last `window` of them in
    sliding layers), written with explicit per-position softmaxes. Reuses the model's weights and layers for
    everything but the attention pattern."""
    cfg = model.config
    T = len(ids)
    pos = torch.arange(T)[None]
    x = model.embed(torch.tensor([ids]))
    if cfg.embed_scale is not None:
        x = x * cfg.embed_scale
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        kind = cfg.layer_types[i]
        h = layer.attn_norm(x)
        q, k, v = attn.wqkv(h).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k, v = q.view(T, HEADS, HEAD_DIM), k.view(T, KV_HEADS, HEAD_DIM), v.view(T, KV_HEADS, HEAD_DIM)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = model._rope(pos, kind)
        q, k = apply_rope(q[None], cos, sin)[0], apply_rope(k[None], cos, sin)[0]
        out = torch.zeros(T, HEADS, HEAD_DIM)
        for t in range(T):
            lo = max(0, t - cfg.sliding_window + 1) if kind == "sliding" else 0
            for head in range(HEADS):
                kv = head // (HEADS // KV_HEADS)
                weights = torch.softmax((k[lo:t + 1, kv] @ q[t, head]) * cfg.attn_scale, dim=0)
                out[t, head] = weights @ v[lo:t + 1, kv]
        h = attn.wo(out.reshape(1, T, HEADS * HEAD_DIM))
        if layer.post_attn_norm is not None:
            h = layer.post_attn_norm(h)
        x = x + h
        h = layer.mlp(layer.mlp_norm(x))
        if layer.post_mlp_norm is not None:
            h = layer.post_mlp_norm(h)
        x = x + h
    return model.lm_head(model.norm(x))[0]


# ---------------------------------------------------------------------------------------------------------
# Rollback


def test_rollback_hides_uncommitted_and_rolled_back_entries(model):
    a, b, c = seq(7, 1), seq(5, 2), seq(4, 3)
    fresh = model.new_cache(64)
    score(model, fresh, a)
    expected = score(model, fresh, c)

    # B scored but never committed.
    cache = model.new_cache(64)
    score(model, cache, a)
    score(model, cache, b, commit=False)
    torch.testing.assert_close(score(model, cache, c), expected, rtol=0, atol=FP32_ATOL)

    # B committed, then rolled back; then a second garbage block scored on top, also rolled back.
    cache = model.new_cache(64)
    score(model, cache, a)
    score(model, cache, b)
    score(model, cache, seq(9, 4), commit=False)
    cache.commit(0, len(a))
    torch.testing.assert_close(score(model, cache, c), expected, rtol=0, atol=FP32_ATOL)

    # The check is sensitive: with B really in the context the logits of C differ.
    seen_b = model.new_cache(64)
    score(model, seen_b, a + b)
    assert (score(model, seen_b, c) - expected).abs().max() > 1e-3


def test_rollback_to_zero_and_reset(model):
    a, b = seq(6, 5), seq(6, 6)
    expected = score(model, model.new_cache(64), b)
    cache = model.new_cache(64)
    score(model, cache, a)
    cache.commit(0, 0)
    torch.testing.assert_close(score(model, cache, b, commit=False), expected, rtol=0, atol=FP32_ATOL)
    cache.reset()
    assert cache.length(0) == 0
    torch.testing.assert_close(score(model, cache, b), expected, rtol=0, atol=FP32_ATOL)


# ---------------------------------------------------------------------------------------------------------
# Block vs incremental


@pytest.mark.parametrize("length", [10, 70], ids=["within-key-block", "across-key-blocks"])
def test_block_equals_incremental_fp32(model, length):
    ids = seq(length, 7)
    block = score(model, model.new_cache(length), ids)
    one_by_one = incremental(model, model.new_cache(length), ids)
    torch.testing.assert_close(block, one_by_one, rtol=0, atol=FP32_ATOL)
    # Mixed: prefill, then uneven blocks.
    cache = model.new_cache(length)
    cuts = [0, 3, 4, 9, length]
    mixed = torch.cat([score(model, cache, ids[s:e]) for s, e in zip(cuts, cuts[1:], strict=False)])
    torch.testing.assert_close(mixed, one_by_one, rtol=0, atol=FP32_ATOL)


def bf16_block_vs_incremental(model, ids: list[int], prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ids[prefix:] scored as one block and one token at a time, both after the same prefix."""
    cache = model.new_cache(len(ids))
    score(model, cache, ids[:prefix])
    block = score(model, cache, ids[prefix:])
    cache = model.new_cache(len(ids))
    score(model, cache, ids[:prefix])
    return block, incremental(model, cache, ids[prefix:])


# Blocks of up to SMALL_BATCH_ROWS (32) tokens: what verification and token trees use. Longer blocks are
# prefill, which runs the fused attention kernel and is never compared bit for bit with decoding.
BF16_CASES = [(5, 7), (60, 8), (40, 32)]
BF16_CASE_IDS = ["7-tokens", "8-tokens-across-key-block", "32-tokens-across-key-block"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize(("prefix", "length"), BF16_CASES, ids=BF16_CASE_IDS)
def test_block_equals_incremental_bf16_bit_identical(family, prefix, length):
    """The engine's losslessness in bf16 rests on this: a token's logits do not depend on how many tokens
    (up to 32) share its forward pass, nor on a block crossing a KEY_BLOCK boundary of the padded attention.

    oneDNN is disabled so every matmul is torch's native kernel, which computes each row the same way
    whatever the row count: what is checked is the runtime (padding, masks, softmax, cache), not the BLAS.
    (With oneDNN on, torch's CPU bf16 matmul runs its native kernel when rows*K*N <= 16**3 and oneDNN above,
    so on these tiny shapes a decode and a block may take different kernels and differ in the last bit; real
    model shapes always take one: see test_bf16_block_equals_incremental_real_model.)
    """
    with torch.backends.mkldnn.flags(enabled=False):
        for seed in range(3):
            model = tiny_model(family, torch.bfloat16, seed=seed)
            block, one_by_one = bf16_block_vs_incremental(model, seq(prefix + length, 8 + seed), prefix)
            assert block.dtype == torch.bfloat16
            worst = (block.float() - one_by_one.float()).abs().max().item()
            assert torch.equal(block, one_by_one), f"seed {seed}: bf16 block vs incremental differ by {worst}"


REAL_BLOCK_PREFIX = 50  # blocks of 16 and 32 tokens cross the 64-key boundary of the padded attention
REAL_BLOCK_MAX = 64


@pytest.fixture(scope="module", params=["kernels", "pytorch"])
def ops_path(request) -> str:
    """bf16 on CPU runs the fused C kernels when they build, else PyTorch ops: both must be bit-exact."""
    if request.param == "kernels" and not cpu_kernels.available():
        pytest.skip("fused CPU kernels unavailable")
    return request.param


def ops(path: str):
    return contextlib.nullcontext() if path == "kernels" else cpu_kernels.disabled()


@pytest.fixture(scope="module")
def real_decoded(bf16_model, ops_path) -> tuple[list[int], torch.Tensor]:
    """Random tokens and the bf16 logits of the last REAL_BLOCK_MAX of them decoded one at a time."""
    vocab = bf16_model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (REAL_BLOCK_PREFIX + REAL_BLOCK_MAX,), generator=gen).tolist()
    cache = bf16_model.new_cache(len(ids))
    with ops(ops_path):
        score(bf16_model, cache, ids[:REAL_BLOCK_PREFIX])
        return ids, incremental(bf16_model, cache, ids[REAL_BLOCK_PREFIX:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "length",
    [2, 3, 4, 8, 16, 32],
)
def test_bf16_block_equals_incremental_real_model(model_name, bf16_model, real_decoded, ops_path, length):
    """Verification-sized blocks on the bundled models in bf16 (real shapes), through the fused kernels and
    through PyTorch ops: bit-identical to decoding the same tokens one at a time."""
    ids, decoded = real_decoded
    cache = bf16_model.new_cache(len(ids))
    with ops(ops_path):
        score(bf16_model, cache, ids[:REAL_BLOCK_PREFIX])
        block = score(bf16_model, cache, ids[REAL_BLOCK_PREFIX:REAL_BLOCK_PREFIX + length])
    one_by_one = decoded[:length]
    rows = (block != one_by_one).any(-1).nonzero().flatten().tolist()
    assert torch.equal(block, one_by_one), f"{model_name} ({ops_path}): {length}-token block differs at rows {rows}"


# ---------------------------------------------------------------------------------------------------------
# Token trees

# Root r, then two branches of depth 2: r -> a1 -> a2 and r -> b1 -> b2 (offsets 0..4 in the tree block).
TREE_PARENTS = [-1, 0, 1, 0, 3]


def tree_paths(parents: list[int]) -> list[list[int]]:
    paths = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        paths.append(path)
    return paths


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, path in enumerate(tree_paths(parents)):
        mask[node, path] = True
    return mask


def test_tree_mask_matches_linear_paths_and_compaction(model):
    prefix, tree_tokens = seq(6, 9), seq(len(TREE_PARENTS), 10)
    paths = tree_paths(TREE_PARENTS)
    depths = torch.tensor([len(p) - 1 for p in paths])

    cache = model.new_cache(64)
    score(model, cache, prefix)
    positions = (len(prefix) + depths)[None]
    tree_logits = model(torch.tensor([tree_tokens]), cache, positions=positions,
                        tree_mask=ancestor_mask(TREE_PARENTS))[0]
    assert cache.length(0) == len(prefix)  # scoring a tree commits nothing

    for node, path in enumerate(paths):
        linear = model.new_cache(64)
        score(model, linear, prefix)
        expected = score(model, linear, [tree_tokens[i] for i in path])[-1]
        torch.testing.assert_close(tree_logits[node], expected, rtol=0, atol=FP32_ATOL,
                                   msg=lambda m, node=node: f"tree node {node}: {m}")

    # Accept the second branch r -> b1 -> b2 (not contiguous in the block) and keep generating.
    accepted = paths[4]
    assert accepted == [0, 3, 4]
    cache.compact(0, accepted)
    assert cache.length(0) == len(prefix) + len(accepted)
    linear = model.new_cache(64)
    score(model, linear, prefix + [tree_tokens[i] for i in accepted])
    rest = seq(8, 11)
    torch.testing.assert_close(incremental(model, cache, rest), incremental(model, linear, rest),
                               rtol=0, atol=FP32_ATOL)


def test_tree_with_batched_mask_and_partial_acceptance(model):
    """A [B, T, T] tree mask, then accepting only the root and one child (a shorter path)."""
    prefix, tree_tokens = seq(3, 12), seq(len(TREE_PARENTS), 13)
    depths = torch.tensor([len(p) - 1 for p in tree_paths(TREE_PARENTS)])
    cache = model.new_cache(64)
    score(model, cache, prefix)
    model(torch.tensor([tree_tokens]), cache, positions=(len(prefix) + depths)[None],
          tree_mask=ancestor_mask(TREE_PARENTS)[None])
    cache.compact(0, [0, 1])
    linear = model.new_cache(64)
    score(model, linear, prefix + tree_tokens[:2])
    rest = seq(6, 14)
    torch.testing.assert_close(score(model, cache, rest), score(model, linear, rest), rtol=0, atol=FP32_ATOL)


# ---------------------------------------------------------------------------------------------------------
# Several slots


@pytest.mark.parametrize("slots", [[0, 1], [1, 0], [2, 0]], ids=["in-order", "reversed", "gapped"])
def test_batched_slots_match_each_alone(model, slots):
    prefixes = {0: seq(5, 15), 1: seq(9, 16), 2: seq(2, 17)}
    new = [seq(4, 20 + s) for s in slots]

    cache = model.new_cache(64, num_slots=3)
    for slot, prefix in prefixes.items():
        score(model, cache, prefix, slot=slot)
    batched = model(torch.tensor(new), cache, slots=slots)

    for row, slot in enumerate(slots):
        alone = model.new_cache(64)
        score(model, alone, prefixes[slot])
        torch.testing.assert_close(batched[row], score(model, alone, new[row]), rtol=0, atol=FP32_ATOL)
    # Nothing committed by the batched call, and other slots untouched.
    assert [cache.length(s) for s in range(3)] == [len(prefixes[s]) for s in range(3)]


def test_slots_are_independent(model):
    """Writing, committing and rolling back one slot never changes another slot's results."""
    a, b, c = seq(5, 30), seq(7, 31), seq(3, 32)
    cache = model.new_cache(64, num_slots=2)
    score(model, cache, a, slot=0)
    before = score(model, cache, c, commit=False, slot=0)
    score(model, cache, b, slot=1)
    score(model, cache, seq(20, 33), slot=1)
    cache.commit(1, 2)
    torch.testing.assert_close(score(model, cache, c, commit=False, slot=0), before, rtol=0, atol=FP32_ATOL)


# ---------------------------------------------------------------------------------------------------------
# Sliding window (and full attention) against brute force


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_matches_brute_force_reference(family):
    model = tiny_model(family)
    ids = seq(20, 40)  # five times the window of 4
    reference = reference_forward(model, ids)
    block = score(model, model.new_cache(len(ids)), ids)
    one_by_one = incremental(model, model.new_cache(len(ids)), ids)
    torch.testing.assert_close(block, reference, rtol=0, atol=FP32_ATOL)
    torch.testing.assert_close(one_by_one, reference, rtol=0, atol=FP32_ATOL)
    cache = model.new_cache(len(ids))
    chunked = torch.cat([score(model, cache, ids[s:s + 3]) for s in range(0, len(ids), 3)])
    torch.testing.assert_close(chunked, reference, rtol=0, atol=FP32_ATOL)

    if family == "gemma3":  # the window matters: without it the logits past position 4 change
        model.config.sliding_window = 10**6
        no_window = reference_forward(model, ids)
        model.config.sliding_window = WINDOW
        assert torch.allclose(no_window[:WINDOW], reference[:WINDOW], rtol=0, atol=FP32_ATOL)
        assert (no_window[WINDOW:] - reference[WINDOW:]).abs().max() > 1e-3


def test_sliding_window_tree_past_the_window():
    """Tree nodes deeper than the window must drop the oldest committed keys by *position*, not offset."""
    model = tiny_model("gemma3")
    prefix = seq(10, 41)
    parents = [-1, 0, 1, 2, 3, 0, 5]  # a 5-node chain (longer than the window of 4) + a 3-node branch
    tree_tokens = seq(len(parents), 42)
    paths = tree_paths(parents)
    depths = torch.tensor([len(p) - 1 for p in paths])
    cache = model.new_cache(64)
    score(model, cache, prefix)
    tree_logits = model(torch.tensor([tree_tokens]), cache, positions=(len(prefix) + depths)[None],
                        tree_mask=ancestor_mask(parents))[0]
    for node, path in enumerate(paths):
        reference = reference_forward(model, prefix + [tree_tokens[i] for i in path])[-1]
        torch.testing.assert_close(tree_logits[node], reference, rtol=0, atol=FP32_ATOL)


# ---------------------------------------------------------------------------------------------------------
# Full context


def test_context_overflow_raises(model):
    cache = model.new_cache(60)
    max_len = cache.max_len  # rounded up to a whole key block
    assert max_len >= 60
    score(model, cache, seq(max_len - 2, 50))
    score(model, cache, seq(2, 51), commit=False)  # exactly fills the cache: fine
    with pytest.raises(ContextOverflowError, match="context full"):
        score(model, cache, seq(3, 52), commit=False)
    score(model, cache, seq(2, 51))
    with pytest.raises(ContextOverflowError):
        score(model, cache, [1], commit=False)
    with pytest.raises(ContextOverflowError):
        cache.commit(0, max_len + 1)
    with pytest.raises(ContextOverflowError):
        score(model, model.new_cache(8), seq(max_len + 1, 53))
    # A batched call where only one slot is full fails too, and commits nothing.
    two = model.new_cache(60, num_slots=2)
    score(model, two, seq(max_len - 1, 54), slot=1)
    with pytest.raises(ContextOverflowError, match="slot 1"):
        model(torch.tensor([[1, 2], [3, 4]]), two, slots=[0, 1])
    assert [two.length(0), two.length(1)] == [0, max_len - 1]


@pytest.mark.slow
def test_prefill_sized_blocks_agree_with_decoding_up_to_bf16_rounding(model_name, bf16_model, real_decoded,
                                                                       ops_path):
    """Blocks of more than 32 tokens are prompts: they run PyTorch's GEMMs and SDPA, which round differently
    from one row at a time, so they are not bit-exact with decoding (nothing compares them bit for bit). What
    must hold: the logits agree to bf16 precision and the top-1 token only differs at near-ties."""
    ids, decoded = real_decoded
    cache = bf16_model.new_cache(len(ids))
    with ops(ops_path):
        score(bf16_model, cache, ids[:REAL_BLOCK_PREFIX])
        block = score(bf16_model, cache, ids[REAL_BLOCK_PREFIX:REAL_BLOCK_PREFIX + REAL_BLOCK_MAX])
    block, decoded = block.float(), decoded.float()
    scale = decoded.abs().amax(-1, keepdim=True)
    # Measured on AMD Zen 3 (prompt GEMMs in fp32): at most 0.051 of the row's largest |logit| (gemma3, random
    # tokens, logits near -40 where bf16 steps are 0.25). CPUs with native bf16 GEMMs round differently, so
    # the bound leaves 4x room; an error in the prompt path (mask, positions, cache writes) changes the
    # logits by their own size.
    assert ((block - decoded).abs() / scale).max() < 0.2
    top2 = decoded.topk(2).values
    flipped = block.argmax(-1) != decoded.argmax(-1)
    assert ((top2[:, 0] - top2[:, 1])[flipped] < 2.0).all()


def test_tree_grown_level_by_level_with_branch_mask(model):
    """A drafter grows a tree one level per forward, committing each level: `branch_mask` hides the
    committed nodes that are not a new token's ancestors, so every node gets its path's logits."""
    prefix = seq(7, 15)
    cache = model.new_cache(64)
    score(model, cache, prefix)
    base = len(prefix)
    level1 = seq(3, 16)  # three siblings after the prefix
    model(torch.tensor([level1]), cache, positions=torch.full((1, 3), base), tree_mask=torch.eye(3, dtype=torch.bool))
    cache.commit(0, base + 3)
    # Level 2: a child of sibling 2 and a child of sibling 0, each seeing only its own parent.
    level2 = seq(2, 17)
    branch = torch.tensor([[[False, False, True], [True, False, False]]])
    logits = model(torch.tensor([level2]), cache, positions=torch.full((1, 2), base + 1),
                   tree_mask=torch.eye(2, dtype=torch.bool), branch_mask=branch)[0]
    for row, parent in ((0, 2), (1, 0)):
        linear = model.new_cache(64)
        score(model, linear, prefix)
        expected = score(model, linear, [level1[parent], level2[row]])[-1]
        torch.testing.assert_close(logits[row], expected, rtol=0, atol=FP32_ATOL)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from Linux's /proc")
def test_a_large_cache_reads_zero_and_costs_memory_only_where_written():
    """A cache sized for many slots' full contexts starts as zeros (stale entries are multiplied by 0 and must
    never be NaN) and becomes resident only where keys and values are written."""
    import gc

    from specdraft.runtime.kv_cache import KVCache

    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    gc.collect()
    before = resident_mib()
    cache = KVCache(num_layers=8, num_kv_heads=4, head_dim=64, max_len=4096, num_slots=16)  # 1 GiB of keys/values
    assert resident_mib() - before < 64
    assert cache.k[0].shape == (16, 4, 4096, 64) and cache.k[0].dtype == torch.bfloat16
    cache.k[3][5, :, :100] = 1.5
    cache.v[7][15, 3, -1] = -2.0
    assert float(cache.k[3][5, :, :100].float().mean()) == 1.5 and float(cache.v[7][15, 3, -1, 0]) == -2.0
    assert int(torch.count_nonzero(cache.k[3])) == 4 * 100 * 64 and int(torch.count_nonzero(cache.k[0])) == 0
    assert resident_mib() - before < 128
