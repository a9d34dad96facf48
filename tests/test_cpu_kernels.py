"""The fused bf16 CPU kernels (specdraft/runtime/cpu_kernels.c) against PyTorch, on tiny models whose shapes
the kernels accept: the linear kernel against an fp32 reference, the fused forward against the PyTorch ops
path (Llama, Qwen-style qkv bias, Gemma 3 with sliding window, q/k norm and soft-capping), and the property
speculative decoding rests on: a token's bf16 logits do not depend on how many tokens share its forward
pass, for linear blocks and token trees. Also: the fallback when the library cannot be built.
"""

from __future__ import annotations

import os
import platform
import random
import shutil

import pytest
import torch

from specdraft.runtime import ModelConfig, Transformer, cpu_kernels
from specdraft.runtime.fused import ThreadGovernor

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: kernels not built")
FAMILIES = ["llama", "qwen", "gemma3", "llama_hd64", "gemma3_hd32"]


def test_kernels_build_where_a_compiler_exists():
    """A compiler on PATH must give working kernels: otherwise every kernel test below would quietly skip."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


def kernel_config(family: str) -> ModelConfig:
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024,
                  attn_scale=16 ** -0.5)
    # Heads of 64 dims (3 sharing a kv head) and of 32 (with softcapping and sliding windows): the AMX
    # attention's two tile loops; 16-dim heads fall back to the vector attention.
    if family == "llama_hd64":
        common.update(num_heads=6, head_dim=64, attn_scale=64 ** -0.5)
        return ModelConfig(model_type="llama", layer_types=["full"] * 3, tie_word_embeddings=False, **common)
    if family == "gemma3_hd32":
        common.update(head_dim=32, attn_scale=32 ** -0.5)
    if family == "llama":
        return ModelConfig(model_type="llama", layer_types=["full"] * 3, tie_word_embeddings=False, **common)
    if family == "qwen":
        return ModelConfig(model_type="qwen2", layer_types=["full"] * 3, attention_bias=True,
                           tie_word_embeddings=True, **common)
    return ModelConfig(model_type="gemma3_text", layer_types=["sliding", "sliding", "full"], sliding_window=6,
                       rope_theta=1e6, rope_local_theta=1e4, qk_norm=True, hidden_act="gelu_pytorch_tanh",
                       embed_scale=64 ** 0.5, tie_word_embeddings=True, attn_logit_softcapping=30.0,
                       final_logit_softcapping=20.0, **common)


def kernel_model(family: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(kernel_config(family))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(param, mean=0.0 if model.config.is_gemma else 1.0, std=0.1)
            else:
                torch.nn.init.normal_(param, std=1.0 if "embed" in name else 0.15)
    return model.to(torch.bfloat16).eval()  # the RoPE tables stay fp32 (Transformer.init_rope_tables)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 101, (1, n), generator=torch.Generator().manual_seed(seed))


def prefilled(model: Transformer, prompt: torch.Tensor, max_len: int = 256):
    cache = model.new_cache(max_len)
    model(prompt, cache)
    cache.commit(0, prompt.shape[1])
    return cache


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 32, 40])
def test_linear_kernel_matches_fp32_and_rows_are_independent(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 96, generator=gen).to(torch.bfloat16)  # 37 outputs: partial tiles at the end
    bias = torch.randn(37, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    y = cpu_kernels.linear(x, weight, bias, threads=2)
    reference = x.float() @ weight.float().T + bias.float()
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 37)
    # Only the summation order differs from the fp32 reference: at most one bf16 rounding step apart.
    assert ((y.float() - reference).abs() <= reference.abs() * 2 ** -7 + 1e-3).all()
    for r in range(rows):
        assert torch.equal(y[r], cpu_kernels.linear(x[r:r + 1], weight, bias, threads=1)[0])



@needs_kernels
def test_panels_hold_the_weight_and_follow_its_changes():
    """Where the kernels multiply bf16 weights in panels (AVX-512 without AMX), `panels` is the weight
    rearranged, not a copy that goes stale: remade when the weight changes in place (training a draft head
    between validations does that) or is replaced, and each output computed from the new values."""
    if not cpu_kernels.dense_panels():
        pytest.skip(f"the {cpu_kernels.simd_path()} path reads weight rows as they are")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 96, generator=gen).to(torch.bfloat16)
    packed = cpu_kernels.panels(weight)
    width = packed.shape[2]
    assert packed.shape == (-(-37 // width), 48, width, 2)
    rows = packed.transpose(1, 2).reshape(-1, 96)  # back to [padded outputs, inputs]
    assert torch.equal(rows[:37], weight) and not rows[37:].any()
    assert cpu_kernels.panels(weight) is packed  # made once
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    before = cpu_kernels.linear(x, weight, None, threads=2)
    with torch.no_grad():
        weight.mul_(-2)  # exact in bf16
    assert cpu_kernels.panels(weight) is not packed
    assert torch.equal(cpu_kernels.linear(x, weight, None, threads=2), -2 * before)

@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_models_take_the_kernel_path(family):
    """The tiny configs must be ones the kernels accept, or the tests below would compare PyTorch to itself."""
    model = kernel_model(family)
    cache = model.new_cache(64)
    assert model.fused.applies(model, 1, cache) and model.fused.applies(model, 32, cache)
    assert not model.fused.applies(model, 33, cache)
    with cpu_kernels.disabled():
        assert not model.fused.applies(model, 1, cache)


def fp32_copy(model: Transformer) -> Transformer:
    """The same bf16 weights in fp32: the reference both bf16 paths are measured against."""
    copy = Transformer(model.config)
    copy.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return copy.eval()


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_forward_as_accurate_as_pytorch_ops(family):
    """The C path and the PyTorch path round intermediate results at different places, so they are compared
    with an fp32 run of the same weights: the C path must be about as close to it as PyTorch's bf16 is, for a
    verification block, an early exit and the hidden states a trained drafter reads."""
    model = kernel_model(family)
    reference_model = fp32_copy(model)
    prompt, block = ids(40, 1), ids(6, 2)

    def run(m, **kwargs):
        cache = prefilled(m, prompt)
        return m(block, cache, return_hidden=True, capture_layers=(0,), **kwargs)

    for kwargs in ({}, {"exit_layer": 1}):
        fused, fused_hidden, fused_captured = run(model, **kwargs)
        with cpu_kernels.disabled():
            plain, plain_hidden, plain_captured = run(model, **kwargs)
        reference, reference_hidden, reference_captured = run(reference_model, **kwargs)
        fused_err = (fused.float() - reference).abs().max().item()
        plain_err = (plain.float() - reference).abs().max().item()
        assert fused_err <= 1.5 * plain_err + 1e-3, (kwargs, fused_err, plain_err)
        for got, torch_path, want in ((fused_hidden, plain_hidden, reference_hidden),
                                      (fused_captured, plain_captured, reference_captured)):
            assert got.shape == want.shape
            err = (got.float() - want).abs().max().item()
            assert err <= 1.5 * (torch_path.float() - want).abs().max().item() + 1e-3


@needs_kernels
def test_captured_hidden_states_do_not_depend_on_the_block():
    """What a feature-level drafter reads must be the same whether the token was decoded alone or verified in a
    block: the captured residual stream is row-invariant like the logits."""
    model = kernel_model("llama")
    prompt, block = ids(20, 1), ids(5, 2)
    cache = prefilled(model, prompt)
    together = model(block, cache, capture_layers=(0, 1)).captured
    cache = prefilled(model, prompt)
    for t in range(block.shape[1]):
        alone = model(block[:, t:t + 1], cache, capture_layers=(0, 1)).captured
        assert torch.equal(alone[:, :, 0], together[:, :, t])
        cache.commit(0, cache.length(0) + 1)


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_forward_writes_the_same_cache(family):
    """Keys and values the C path writes for a block are the ones the PyTorch path writes (up to rounding):
    both paths can serve one cache (prefill runs through PyTorch, decoding through the kernels)."""
    model = kernel_model(family)
    prompt, block = ids(40, 1), ids(6, 2)
    fused_cache, torch_cache = prefilled(model, prompt), prefilled(model, prompt)
    model(block, fused_cache)
    with cpu_kernels.disabled():
        model(block, torch_cache)
    new = slice(40, 46)
    for layer in range(3):
        pairs = ((fused_cache.k[layer], torch_cache.k[layer]), (fused_cache.v[layer], torch_cache.v[layer]))
        for fused, plain in pairs:
            fused, plain = fused[:, :, new].float(), plain[:, :, new].float()
            # Two bf16 paths that round differently drift apart by a few ulps over the layers (a bf16 ulp at
            # |x| = 4 is 0.03; measured on AMX tiles: 0.078 at layer 3, 1 element of 768): a layout or position
            # bug is off by O(1), and on average, which the mean catches.
            assert torch.allclose(fused, plain, atol=0.15, rtol=0.02)
            assert (fused - plain).abs().mean() < 0.05 * plain.abs().mean()
            assert fused.abs().amax(-1).gt(0).all()  # every new position written, none left at zero


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("prefix", "length"), [(5, 2), (5, 7), (60, 8), (40, 32)])
def test_fused_block_equals_incremental_bit_identical(family, prefix, length):
    """Verification-sized blocks (crossing a 64-key boundary too) give each token exactly the logits it gets
    when decoded alone."""
    assert_block_equals_incremental(kernel_model(family, seed=length), prefix, length)


def assert_block_equals_incremental(model: Transformer, prefix: int, length: int) -> None:
    """A block of `length` tokens after `prefix` gets, row for row, the bits of decoding them one by one."""
    tokens = ids(prefix + length, prefix)
    block_cache = prefilled(model, tokens[:, :prefix])
    block = model(tokens[:, prefix:], block_cache)[0]
    cache = prefilled(model, tokens[:, :prefix])
    singles = []
    for t in range(prefix, prefix + length):
        singles.append(model(tokens[:, t:t + 1], cache)[0])
        cache.commit(0, t + 1)
    assert torch.equal(block, torch.cat(singles))


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_token_tree_node_equals_its_path_decoded(family):
    """A token tree scored in one pass: each node gets the bits of its root-to-node path decoded token by
    token (ancestors' keys are found in cache order, so the sum runs in the same order)."""
    assert_tree_nodes_equal_their_paths(kernel_model(family, seed=3))


def assert_tree_nodes_equal_their_paths(model: Transformer) -> None:
    """A small fixed tree (0 -> 1 -> 3, 0 -> 2 -> 4), then random trees of up to 17 nodes after a longer
    prompt: many nodes whose ancestors lie apart in the block, so that a sum over a node's visible keys taken
    by key position, rather than in the order of the keys it sees, changes some bits (it did, on AMX)."""
    rng = random.Random(0)
    trees = [(20, [-1, 0, 0, 1, 2])] + [(45 + 6 * t, [-1] + [rng.randrange(i) for i in range(1, n)])
                                       for t, n in enumerate((9, 13, 17, 17))]
    for prompt_len, parents in trees:
        n = len(parents)
        paths = []
        for node in range(n):
            path, a = [], node
            while a >= 0:
                path.append(a)
                a = parents[a]
            paths.append(path[::-1])
        visible = torch.zeros(n, n, dtype=torch.bool)
        for node, path in enumerate(paths):
            visible[node, path] = True
        prompt, tree_tokens = ids(prompt_len, 3), ids(n, prompt_len)
        positions = torch.tensor([[prompt_len + len(path) - 1 for path in paths]])
        tree_logits = model(tree_tokens, prefilled(model, prompt), positions=positions, tree_mask=visible)[0]
        leaves = [node for node in range(n) if node not in parents]
        for leaf in leaves:
            path_logits = model(tree_tokens[:, paths[leaf]], prefilled(model, prompt))[0]
            assert torch.equal(tree_logits[paths[leaf]], path_logits), f"tree {parents}, leaf {leaf}"


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_blocks_get_the_bits_of_padded_blocks(family):
    """A batch of drafts is as wide as its longest; with `lengths` the kernels compute the real rows only
    (one entry per token). Each real row's logits, final hidden state, captured streams and cache entries
    are those of the padded forward, for chains and a tree, and the padding is really skipped."""
    assert_ragged_equals_padded(kernel_model(family, seed=5))


def assert_ragged_equals_padded(model: Transformer) -> None:
    prompts = [ids(n, 10 + n) for n in (30, 61, 9)]
    lengths = [1, 4, 6]
    width = max(lengths)
    parents = [-1, 0, 0, 1, 1]  # the third block holds a tree: the pending token, then 5 nodes
    visible = torch.ones(3, width, width, dtype=torch.bool).tril()
    positions = torch.tensor([[n + i for i in range(width)] for n in (30, 61, 9)])
    for node, parent in enumerate(parents, start=1):
        row = torch.zeros(width, dtype=torch.bool)
        row[0], row[node], depth, a = True, True, 1, parent
        while a >= 0:
            row[a + 1], depth, a = True, depth + 1, parents[a]
        visible[2, node], positions[2, node] = row, 9 + depth
    tokens = torch.cat([ids(width, 20 + b) for b in range(3)])

    def run(ragged: bool):
        cache = model.new_cache(128, num_slots=3)
        for slot, prompt in enumerate(prompts):
            model(prompt, cache, slots=[slot])
            cache.commit(slot, prompt.shape[1])
        entries.clear()
        out = model(tokens, cache, positions=positions, tree_mask=visible, return_hidden=True,
                    capture_layers=(0, 2), lengths=lengths if ragged else None)
        assert entries == [sum(lengths) if ragged else 3 * width]  # the rows the kernels computed
        return out, cache

    entries = []
    run_layers = model.fused.run_layers

    def counting(model_, x, *args, **kwargs):
        entries.append(x.shape[0] * x.shape[1])
        return run_layers(model_, x, *args, **kwargs)

    model.fused.run_layers = counting
    try:
        (padded, padded_cache), (ragged, ragged_cache) = run(False), run(True)
    finally:
        del model.fused.run_layers
    for b, n in enumerate(lengths):
        assert torch.equal(ragged.logits[b, :n], padded.logits[b, :n])
        assert torch.equal(ragged.hidden[b, :n], padded.hidden[b, :n])
        assert torch.equal(ragged.captured[:, b, :n], padded.captured[:, b, :n])
        start = prompts[b].shape[1]
        for layer in range(model.config.num_layers):
            for ragged_kv, padded_kv in ((ragged_cache.k, padded_cache.k), (ragged_cache.v, padded_cache.v)):
                assert torch.equal(ragged_kv[layer][b, :, start:start + n], padded_kv[layer][b, :, start:start + n])


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_short_prompts_prefill_in_fused_chunks(family, monkeypatch):
    """A prompt of up to CHUNKED_PREFILL_TOKENS runs through the fused kernels in causal chunks of
    PREFILL_CHUNK_TOKENS (here also of 32, a verified block's largest size): each row gets the bits of
    decoding it token by token (the GEMM path only agrees up to bf16 rounding), the cache ends with the
    prompt's keys written and nothing committed, and logits_from, the final hidden states and the captured
    streams cover the rows they do in one block."""
    check_prefill_chunks(kernel_model(family, seed=7), monkeypatch)


def counting_blocks(run_layers, blocks: list[int]):
    """run_layers, appending each call's block width to `blocks`."""
    def counting(model_, x, *args, **kwargs):
        blocks.append(x.shape[1])
        return run_layers(model_, x, *args, **kwargs)
    return counting


def check_prefill_chunks(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdraft.runtime import model as model_module

    default = model_module.PREFILL_CHUNK_TOKENS
    assert default > 32
    for chunk, n in ((32, 77), (default, default + 22)):
        monkeypatch.setattr(model_module, "PREFILL_CHUNK_TOKENS", chunk)
        prompt = ids(n, 8)
        cache = model.new_cache(n + 32)
        blocks: list[int] = []
        model.fused.run_layers = counting_blocks(model.fused.run_layers, blocks)
        try:
            out = model(prompt, cache, logits_from=40, return_hidden=True, capture_layers=(1,))
        finally:
            del model.fused.run_layers
        assert blocks == [chunk] * (n // chunk) + [n % chunk] and cache.length(0) == 0
        assert out.logits.shape[1] == out.hidden.shape[1] == n - 40 and out.captured.shape[2] == n
        cache.commit(0, n)
        decoded = model.new_cache(n + 32)
        for t in range(n):
            step = model(prompt[:, t:t + 1], decoded, capture_layers=(1,))
            if t >= 40:
                assert torch.equal(step.logits[0, 0], out.logits[0, t - 40])
            assert torch.equal(step.captured[0, 0, 0], out.captured[0, 0, t])
            decoded.commit(0, t + 1)
        for layer in range(model.config.num_layers):
            assert torch.equal(cache.k[layer][0, :, :n], decoded.k[layer][0, :, :n])
    monkeypatch.setattr(model_module, "CHUNKED_PREFILL_TOKENS", 0)  # the GEMM path, for comparison
    gemm = model(prompt, model.new_cache(n + 32), logits_from=40)
    assert torch.allclose(gemm.float(), out.logits.float(), atol=0.1 * out.logits.float().abs().max().item())


@needs_kernels
def test_argmax_and_topk_rows_give_torchs_answers_ties_nan_and_infinities_included():
    check_argmax_rows()


def check_argmax_rows() -> None:
    """The kernels' one-call argmax (greedy verification reads it) and top-k (drafters that recycle the
    target's predictions read it) against torch's, bf16 and fp32, over vocabularies in whole and partial
    chunks of 128."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (1, 5, 128, 129, 4099, 49152):
            logits = torch.randn(2, 4, vocab, generator=g).to(dtype)
            logits[0, 1] = 0.0  # all tied: the first
            logits[0, 2, vocab // 2:] = 50.0  # tied in several chunks: the first of them
            logits[0, 3] = float("-inf")
            logits[1, 0, -1] = float("inf")
            logits[1, 1, [vocab - 1, vocab // 3]] = float("nan")  # the first NaN, whatever the values
            logits[1, 2] = torch.randint(-2, 3, (vocab,), generator=g).to(dtype)
            got = cpu_kernels.argmax_rows(logits)
            assert got.dtype == torch.long and torch.equal(got, logits.argmax(-1)), (dtype, vocab)
            assert torch.equal(cpu_kernels.argmax_rows(logits[:, 1]), logits[:, 1].argmax(-1))  # strided input
            for k in (1, 4, 8):  # top-k: torch's values best first, equal values by lower index
                if k > vocab:
                    continue
                top = cpu_kernels.topk_rows(logits, k)
                values = logits.gather(-1, top).float().nan_to_num(nan=1e30)
                assert torch.equal(values, logits.topk(k, dim=-1).values.float().nan_to_num(nan=1e30)), (dtype, k)
                assert (top[0, 1] == torch.arange(k)).all() and top[1, 1, 0] == vocab // 3
    with pytest.raises(ValueError):
        cpu_kernels.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError):
        cpu_kernels.topk_rows(torch.zeros(2, 3), 4)


@needs_kernels
def test_fused_slots_are_independent():
    """Two sequences in one forward get the logits each gets alone (the server's batched decoding)."""
    assert_slots_independent(kernel_model("gemma3", seed=4))


def assert_slots_independent(model: Transformer) -> None:
    a, b = ids(30, 5), ids(30, 6)
    cache = model.new_cache(64, num_slots=2)
    for slot, prompt in enumerate((a, b)):
        model(prompt[:, :25], cache, slots=[slot])
        cache.commit(slot, 25)
    both = model(torch.cat([a[:, 25:], b[:, 25:]]), cache)
    for slot, prompt in enumerate((a, b)):
        alone = prefilled(model, prompt[:, :25], 64)
        assert torch.equal(both[slot], model(prompt[:, 25:], alone)[0])


def test_unbuildable_kernels_fall_back_with_a_warning(monkeypatch, tmp_path):
    """No working compiler: a warning, then the PyTorch ops path (same model, same outputs as disabled())."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_load_error", None)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.warns(UserWarning, match="fused CPU kernels unavailable"):
        assert not cpu_kernels.available()
    assert "failed" in cpu_kernels.unavailable_reason()
    model = kernel_model("llama")
    cache = model.new_cache(64)
    assert not model.fused.applies(model, 1, cache)
    logits = model(ids(5, 0), cache)
    assert torch.isfinite(logits.float()).all()


def test_thread_governor_picks_the_faster_mode_by_measurement():
    """Simulated timings: all threads 10 ms and one thread 16 ms on a quiet machine; then another process
    takes a core: all threads 500 ms, one thread 20 ms; then it leaves."""
    gov = ThreadGovernor(first_probe=3, interval=4, max_interval=16)
    quiet, busy = {2: 0.010, 1: 0.016}, {2: 0.5, 1: 0.020}

    def run(times: dict, steps: int) -> list[int]:
        used = []
        for _ in range(steps):
            threads = gov.threads(2)
            gov.record(threads, 2, times[threads])
            used.append(threads)
        return used

    # Quiet: one probe of a single thread after 3 forwards loses, and the next probes come ever later.
    assert run(quiet, 4) == [2, 2, 2, 1]
    assert run(quiet, 9 + 17) == [2] * 8 + [1] + [2] * 16 + [1]
    assert gov.switches == 0 and gov.interval == 16
    # Busy: the running estimate for all threads passes twice the single-thread time: probe at once, switch.
    assert run(busy, 6) == [2, 1, 1, 1, 1, 1] and gov.single and gov.switches == 1
    # While busy, retries of all threads keep losing and come ever later (4, 8, 16 forwards).
    used = run(busy, 40)
    assert used.count(2) == 3 and gov.single
    # Quiet again: the next retry wins.
    used = run(quiet, 17)
    assert used[-1] == 2 and not gov.single and gov.switches == 2
    # With one thread there is nothing to choose.
    assert gov.threads(1) == 1


def test_each_size_of_forward_has_its_own_thread_governor():
    """One thread may win for single-row steps (a busy moment) and lose badly for a batch's rounds: a mode
    chosen on one size of forward must not be applied to another it was never measured on."""
    from specdraft.runtime.fused import FusedCPUBackend

    backend = FusedCPUBackend()
    assert backend.governor is backend.governor_for(1)
    assert backend.governor_for(8) is backend.governor_for(15) and backend.governor_for(8) is not backend.governor
    backend.governor.single = True
    assert backend.governor.threads(2) == 1 and backend.governor_for(8).threads(2) == 2


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_thread_count_changes_no_bit(family):
    """The governor may switch to one thread mid-generation: outputs must not notice."""
    model = kernel_model(family, seed=5)
    prompt, block = ids(30, 7), ids(5, 8)
    many = model(block, prefilled(model, prompt))
    governors = [model.fused.governor_for(rows) for rows in (1, 5)]  # the prompt's last row, the block
    for governor in governors:
        governor.single = True
    try:
        assert all(governor.threads(torch.get_num_threads()) == 1 for governor in governors)
        one = model(block, prefilled(model, prompt))
    finally:
        for governor in governors:
            governor.single = False
    assert torch.equal(many, one)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# Every code path of the kernels this CPU can run, as the -march that selects it: the native build covers the
# best one (the rest of this file); these build the others. x86-64-v4 is AVX-512 without BF16; cooperlake is
# AVX512-BF16 without AMX (the path of AMD Zen 4, and of Intel CPUs whose kernel refuses the tile state).
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
SIMD_BUILDS = [("x86-64", "portable", set()), ("x86-64-v3", "avx2", {"avx2", "fma"}),
               ("x86-64-v4", "avx512", _AVX512),
               ("cooperlake", "avx512bf16", _AVX512 | {"avx512cd", "avx512_vnni", "avx512_bf16"})]


def skip_unless_a_variant_is_needed(path: str, needs: set[str]) -> None:
    """A variant build is tested where this CPU can execute it and the native build (which every other test
    runs) takes another path."""
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {path} path (needs {sorted(needs)})")
    if cpu_kernels.available() and cpu_kernels.simd_path() == path:
        pytest.skip(f"the native build takes the {path} path: the rest of the tests run it")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                    reason="the variants are built for x86-64 with cc")
@pytest.mark.parametrize(("march", "path", "needs"), SIMD_BUILDS, ids=[b[1] for b in SIMD_BUILDS])
def test_every_kernel_path_this_cpu_can_run(monkeypatch, tmp_path, march, path, needs):
    """Users' CPUs differ (AVX512-BF16 and AMX on Intel Sapphire Rapids, AVX512-BF16 on AMD Zen 4, AVX2 on
    Zen 2/3 and most laptops, none of these elsewhere): each path is checked for accuracy and for rows that
    do not depend on the block, on this machine whenever it can execute it."""
    skip_unless_a_variant_is_needed(path, needs)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_load_error", None)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECDRAFT_KERNEL_MARCH", march)
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    assert cpu_kernels.simd_path() == path
    assert cpu_kernels.k_multiple() == (32 if path == "avx512bf16" else 16)
    for rows in (1, 3, 5, 17):
        test_linear_kernel_matches_fp32_and_rows_are_independent(rows)
    check_argmax_rows()
    for family in FAMILIES:
        test_fused_block_equals_incremental_bit_identical(family, 60, 8)
        test_fused_forward_as_accurate_as_pytorch_ops(family)
        test_ragged_blocks_get_the_bits_of_padded_blocks(family)
    with pytest.MonkeyPatch.context() as patch:
        test_short_prompts_prefill_in_fused_chunks("gemma3", patch)


@needs_kernels
@pytest.mark.skipif(os.environ.get("SPECDRAFT_KERNEL_AMX") == "0", reason="AMX turned off by the environment")
def test_amx_tiles_are_used_where_the_cpu_has_them():
    """On Intel CPUs with AMX the native build multiplies on tiles (the rest of this file then tests that
    path); elsewhere it must not claim to."""
    has_amx = {"amx_tile", "amx_bf16"} <= _cpu_flags()
    assert (cpu_kernels.simd_path() == "amx") == has_amx


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_int8_linear_runs_in_the_kernel_with_rows_independent(rows, monkeypatch):
    """Int8Linear (a quant:int8 draft's LM head) takes the C kernel for a draft's few rows: as close to its
    dequantized weights as bf16 output allows, each row the same alone or in the block, and never through
    torch's int8 kernel (which is what it replaces)."""
    from specdraft.runtime.quant import Int8Linear

    gen = torch.Generator().manual_seed(rows)
    layer = Int8Linear.from_linear_weight(torch.randn(200, 64, generator=gen) * 0.1)
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", None)  # the kernel path must not need it
    y = layer(x)
    reference = x.float() @ layer.dequantize().T
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 200)
    assert ((y.float() - reference).abs() <= reference.abs() * 2 ** -7 + 1e-3).all()
    for r in range(rows):
        assert torch.equal(y[r], layer(x[r:r + 1])[0])


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_draft_runs_in_the_kernels(family):
    """The quant:int8 self-draft (int8 weights, one scale per output feature) also runs fused, as accurately
    as torch's int8 kernel with respect to the dequantized weights; it need not be bit-exact (it only
    drafts), but it is deterministic and row-invariant all the same."""
    from specdraft.drafters.quant import quantized_copy
    from specdraft.runtime.quant import quant_supported

    if not quant_supported(8):
        pytest.skip("torch lacks the int8 weight-only kernel")
    draft = quantized_copy(kernel_model(family), 8)
    cache = draft.new_cache(64)
    assert draft.fused.applies(draft, 1, cache)
    reference_model = fp32_copy(kernel_model(family))
    for layer, ref_layer in zip(draft.layers, reference_model.layers):  # the int8 weights, dequantized
        for name in ("wqkv", "wo"):
            getattr(ref_layer.attn, name).weight.copy_(getattr(layer.attn, name).dequantize())
        for name in ("w_gate_up", "w_down"):
            getattr(ref_layer.mlp, name).weight.copy_(getattr(layer.mlp, name).dequantize())
    # A parameter of its own: with tied embeddings, copying into lm_head.weight would change the embedding too.
    reference_model.lm_head.weight = torch.nn.Parameter(draft.lm_head.dequantize(), requires_grad=False)
    prompt, block = ids(40, 1), ids(6, 2)
    fused = draft(block, prefilled(draft, prompt))
    with cpu_kernels.disabled():
        plain = draft(block, prefilled(draft, prompt))
    reference = reference_model(block, prefilled(reference_model, prompt))
    fused_err = (fused.float() - reference).abs().max().item()
    assert fused_err <= 1.5 * (plain.float() - reference).abs().max().item() + 1e-3
    singles_cache = prefilled(draft, prompt)
    singles = []
    for t in range(6):
        singles.append(draft(block[:, t:t + 1], singles_cache))
        singles_cache.commit(0, 41 + t)
    assert torch.equal(torch.cat(singles, 1), fused)


@pytest.fixture
def fresh_bf16_choice():
    cpu_kernels.bf16_dot_pays.cache_clear()
    yield
    cpu_kernels.bf16_dot_pays.cache_clear()


def test_bf16_dot_products_are_left_out_where_they_are_slow(monkeypatch, fresh_bf16_choice):
    """Where VDPBF16PS retires at under half the rate of fp32 FMAs (an Intel Xeon whose AMX the hypervisor
    hides: 1.3 against 5.4 G/s per core), the native build leaves AVX512-BF16 out and multiplies in fp32;
    elsewhere it keeps them. The environment overrides the measurement."""
    monkeypatch.delenv("SPECDRAFT_KERNEL_BF16", raising=False)
    monkeypatch.delenv("SPECDRAFT_KERNEL_MARCH", raising=False)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    for dot, fma, pays in ((1.3e9, 5.4e9, False), (3.6e9, 3.7e9, True)):
        monkeypatch.setattr(cpu_kernels, "_measure_bf16_dot", lambda cpu, dot=dot, fma=fma: (dot, fma))
        cpu_kernels.bf16_dot_pays.cache_clear()
        assert cpu_kernels.bf16_dot_pays() is pays
        assert ("-mno-avx512bf16" in cpu_kernels._flags()) is not pays
    monkeypatch.setenv("SPECDRAFT_KERNEL_BF16", "1")
    cpu_kernels.bf16_dot_pays.cache_clear()
    assert cpu_kernels.bf16_dot_pays()  # forced, whatever the last measurement said
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile"})
    monkeypatch.setenv("SPECDRAFT_KERNEL_BF16", "auto")
    cpu_kernels.bf16_dot_pays.cache_clear()
    assert cpu_kernels.bf16_dot_pays()  # AMX tiles need them: never measured
    monkeypatch.setenv("SPECDRAFT_KERNEL_MARCH", "x86-64-v3")
    assert "-mno-avx512bf16" not in cpu_kernels._flags()  # a variant build is what it names


@pytest.mark.skipif("avx512_bf16" not in _cpu_flags() or shutil.which("cc") is None,
                    reason="the probe measures AVX512-BF16 dot products")
def test_bf16_probe_measures_this_cpu_once(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    dot, fma = cpu_kernels._measure_bf16_dot("this cpu")
    assert dot > 1e8 and fma > 1e8  # instructions per second on one core
    cached = list((tmp_path / "kernels").glob("bf16-probe-*.txt"))
    assert len(cached) == 1
    cached[0].write_text("1 2\n")
    assert cpu_kernels._measure_bf16_dot("this cpu") == (1.0, 2.0)  # read back, not measured again


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "gemma3_hd32"])
def test_key_panels_mirror_the_key_cache_whoever_writes_it(monkeypatch, family):
    """Where the kernels keep key panels (a second copy of the keys, in the layout their attention reads), every
    writer keeps them equal to the key cache: the kernels as they store keys, the PyTorch path (prompts past
    CHUNKED_PREFILL_TOKENS) and `compact` (a tree path) through `sync_key_panels`. Attention reading the panels
    gives the bits it gives transposing the key cache itself."""
    from specdraft.runtime import model as model_module

    if not cpu_kernels.key_panel_width(kernel_config(family).head_dim):
        pytest.skip("this kernel build reads the key cache itself (no key panels)")
    model = kernel_model(family)
    cache = model.new_cache(256, num_slots=2)
    model(ids(5, 1), cache, slots=[1])  # a fused forward first: the panels exist from here on
    cache.commit(1, 5)
    monkeypatch.setattr(model_module, "CHUNKED_PREFILL_TOKENS", 8)  # a 40-token prompt takes PyTorch's path
    model(ids(40, 2), cache, slots=[0])
    cache.commit(0, 40)
    block = ids(6, 3)
    model(block, cache, slots=[0])  # the kernels store 6 keys, then a tree path moves two of them up
    cache.compact(0, [0, 2, 5])

    def mirrored(slot: int, length: int) -> torch.Tensor:  # the panels, read back in the key cache's layout
        width = cache.k_panels[0].shape[-1]
        positions = torch.arange(length)
        return torch.stack([p[slot][:, positions // width, :, positions % width].transpose(0, 1).contiguous()
                            .view(torch.bfloat16) for p in cache.k_panels])

    for slot, length in ((0, 43), (1, 5)):
        assert torch.equal(mirrored(slot, length), torch.stack([k[slot, :, :length] for k in cache.k]))
    with_panels = model(ids(1, 4), cache, slots=[0])
    monkeypatch.setattr(cpu_kernels, "key_panel_width", lambda head_dim: 0)  # the attention transposes again
    without = model(ids(1, 4), cache, slots=[0])
    assert cache.k_panels is None
    assert torch.equal(with_panels, without)
