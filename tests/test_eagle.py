"""EAGLE-3 head and drafter, training and distillation, on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import BATCH, NUM_SAMPLES, PROMPT, exact_joint, matches, sample_joint
from tiny_models import ToyTokenizer, tiny_model

from specdraft.drafters import make_drafter
from specdraft.drafters.base import DraftRequest
from specdraft.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, aux_features, default_aux_layer_ids
from specdraft.engine.adaptive import AdaptiveConfig, BatchPlanner, DraftCostMemory
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.train.data import load_split, read_shard, train_val_split
from specdraft.train.distill import DistillConfig, distill
from specdraft.train.eagle import TrainConfig, train_eagle
from specdraft.verify.sampling import SamplingParams

VOCAB = 16
FIXED = AdaptiveConfig(enabled=False)
DRAFT_VOCAB = torch.arange(2, 14)  # a reduced draft vocabulary: 12 of the 16 target tokens


def random_head(target, seed=0, std=0.3, variant="eagle3") -> EagleHead:
    config = EagleConfig.for_target(target, draft_vocab_size=len(DRAFT_VOCAB), variant=variant)
    head = EagleHead(config).init_weights(seed, std)
    head.set_draft_vocab(DRAFT_VOCAB)
    return head


def engine(target, drafter=None, k=4, tree=0, max_batch=1, adaptive=FIXED, max_len=256):
    return Engine(target, ToyTokenizer(VOCAB), drafter, k, adaptive, max_model_len=max_len, max_batch=max_batch,
                  tree=tree)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=VOCAB, layers=4)


def test_default_layers_and_config_layout(target, tmp_path):
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(4) == [1, 2, 3] and default_aux_layer_ids(1) == [1, 1, 1]
    head = random_head(target)
    assert head.eagle.hidden_layers == [0, 1, 2]  # the streams leaving layers 0..2 enter layers 1..3
    head.save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 12
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["fc.weight"].shape == (32, 96)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # q/k/v read 2*dim
    assert tensors["lm_head.weight"].shape == (12, 32) and "embed_tokens.weight" not in tensors
    # vLLM's convention: target id = draft id + d2t[draft id].
    assert torch.equal(torch.arange(12) + tensors["d2t"], DRAFT_VOCAB)
    assert tensors["t2d"].sum() == 12 and tensors["t2d"][DRAFT_VOCAB].all()


def test_unroll_matches_drafting_with_a_cache(target):
    """Training-time test computes what drafting computes: step 0 on target features, step s on the head's
    own step s-1 hidden states, attending to the verified context and its own earlier draft positions."""
    head = random_head(target).float()
    seq = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    T = seq.shape[1]
    layers = head.eagle.hidden_layers
    with torch.no_grad():
        out = target.forward_sequence(seq, capture_layers=layers)
        aux = torch.cat(list(out.captured), dim=-1)[:, :T - 1]
        fused = head.fuse(aux)
        embeds = target.embed_tokens(seq[:, 1:])
        steps = 3
        padded = torch.cat([embeds, torch.zeros(1, steps - 1, embeds.shape[-1])], dim=1)
        unrolled, unrolled_hidden = head.unroll(padded, fused, steps)
    from specdraft.runtime.kv_cache import KVCache

    cfg = head.config
    for m in (0, 4, 7):  # the verified context ends at position m; two draft positions behind it
        cache = KVCache(1, cfg.num_kv_heads, cfg.head_dim, 64, 1, torch.float32)
        logits, hidden = head.step(embeds[:, :m + 1], fused[:, :m + 1], cache, [0])
        cache.commit(0, m + 1)
        torch.testing.assert_close(logits[0, m], unrolled[0][0, m], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[0, m], unrolled_hidden[0][0, m], atol=1e-4, rtol=1e-4)
        for s in (1, 2):
            logits, hidden = head.step(embeds[:, m + s:m + s + 1], hidden[:, -1:], cache, [0])
            cache.commit(0, m + 1 + s)
            torch.testing.assert_close(logits[0, 0], unrolled[s][0, m], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[0, 0], unrolled_hidden[s][0, m], atol=1e-4, rtol=1e-4)


def test_a_tree_block_scores_each_node_as_its_own_chain_would(target):
    """A tree block (nodes at their depths, each seeing the committed context and its ancestors) gives every
    node the logits and hidden state that stepping its own branch as a chain gives, in a batch of two slots
    with different committed lengths: the tree-masked attention against the one-query path."""
    from specdraft.runtime.kv_cache import KVCache

    head = random_head(target).float()
    cfg = head.config
    dim = cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    context = [torch.randn(1, n, dim, generator=g) for n in (5, 9)]  # fused features of two requests
    context_tokens = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (5, 9)]
    # nodes: 0 and 1 children of the root, 2 a child of 0, 3 a child of 2
    parents = [-1, -1, 0, 2]
    depth = [0, 0, 1, 2]
    tokens = torch.randint(0, VOCAB, (2, 4), generator=g)
    hidden = torch.randn(2, 4, dim, generator=g)
    tree_mask = torch.eye(4, dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            tree_mask[node, parent] = True
            parent = parents[parent]

    def cache_with_contexts() -> KVCache:
        cache = KVCache(1, cfg.num_kv_heads, cfg.head_dim, 64, 2, torch.float32)
        for slot in (0, 1):
            head.step(target.embed_tokens(context_tokens[slot]), context[slot], cache, [slot])
            cache.commit(slot, context[slot].shape[1])
        return cache

    with torch.no_grad():
        cache = cache_with_contexts()
        starts = torch.tensor([[5], [9]])
        positions = starts + torch.tensor(depth)[None, :]
        tree_logits, tree_hidden = head.step(target.embed_tokens(tokens), hidden, cache, [0, 1], positions=positions,
                                             tree_mask=tree_mask[None].expand(2, 4, 4))
        for slot in (0, 1):
            for node in range(4):
                branch = [node]
                while parents[branch[0]] >= 0:
                    branch.insert(0, parents[branch[0]])
                chain = cache_with_contexts()
                for n in branch:
                    logits, out = head.step(target.embed_tokens(tokens[slot:slot + 1, n:n + 1]),
                                            hidden[slot:slot + 1, n:n + 1], chain, [slot])
                    chain.commit(slot, chain.length(slot) + 1)
                torch.testing.assert_close(tree_logits[slot, node], logits[0, 0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(tree_hidden[slot, node], out[0, 0], atol=1e-4, rtol=1e-4)


def _proposals(drafter, target, greedy: bool, tree: int):
    """Proposals for two requests after their prefill, as the engine would hand them over."""
    eng = engine(target)
    out = []
    for rid, prompt in enumerate(PROMPTS[:2]):
        first = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=1)).token_ids
        with torch.no_grad():
            captured = target.forward_sequence(torch.tensor([prompt]), capture_layers=[0, 1, 2]).captured
        hidden = {layer: captured[layer, 0] for layer in (0, 1, 2)}
        params = SamplingParams(temperature=0 if greedy else 1.0)
        drafter.add_request(DraftRequest(rid, prompt, params, torch.Generator().manual_seed(rid), None, 0, hidden))
        out.append(prompt + first)
    proposals = drafter.propose([0, 1], out, [4, 4], [tree or 4, tree or 4])
    for rid in (0, 1):
        drafter.remove_request(rid)
    return proposals


@pytest.mark.parametrize("greedy,tree", [(True, 0), (False, 0), (True, 8)])
def test_save_load_round_trip_gives_identical_proposals(target, tmp_path, greedy, tree):
    head = random_head(target)
    head.save(tmp_path)
    loaded = make_drafter(f"eagle:{tmp_path}", target, ToyTokenizer(VOCAB), max_len=256, max_batch=2)
    original = EagleDrafter(head, target, max_len=256, max_batch=2)
    a = _proposals(original, target, greedy, tree)
    b = _proposals(loaded, target, greedy, tree)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and x.parents == y.parents and len(x.tokens) == (tree or 4)
        assert all(t in DRAFT_VOCAB.tolist() for t in x.tokens)
        if greedy:
            assert x.draft_probs is None
        else:  # rows over the TARGET vocabulary, zero outside the draft vocabulary
            assert x.draft_probs.shape == (4, VOCAB) and torch.equal(x.draft_probs, y.draft_probs)
            assert x.draft_probs[:, [0, 1, 14, 15]].sum() == 0
            torch.testing.assert_close(x.draft_probs.sum(-1), torch.ones(4))


def test_bad_head_paths_and_mismatched_targets(target, tmp_path):
    with pytest.raises(SpecdraftError):
        make_drafter(f"eagle:{tmp_path / 'missing'}", target, ToyTokenizer(VOCAB))
    with pytest.raises(SpecdraftError):
        make_drafter("eagle:", target, ToyTokenizer(VOCAB))
    random_head(target).save(tmp_path)
    with pytest.raises(SpecdraftError):
        make_drafter(f"eagle:{tmp_path}", tiny_model(seed=0, vocab=VOCAB, layers=4, hidden=64), ToyTokenizer(VOCAB))


@pytest.mark.parametrize("variant", ["eagle3", "eagle1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [0, 8])
def test_greedy_identity_batch_of_three(dtype, tree, variant):
    target = tiny_model(seed=0, vocab=VOCAB, layers=4, dtype=dtype)
    drafter = EagleDrafter(random_head(target, variant=variant), target, max_len=256, max_batch=3)
    plain, spec = engine(target), engine(target, drafter, k=4, tree=tree, max_batch=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [plain.generate(p, params).token_ids for p in PROMPTS]
    got = [r.token_ids for r in spec.generate_many(PROMPTS, [params] * 3)]
    assert got == expected
    assert spec.totals.drafted > 0 and spec.totals.accepted > 0


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("tree", [0, 8])
def test_quantized_heads_stay_lossless(weights, tree):
    """`weights` int8 / int4 quantize the head's linear layers for drafting (less memory read a step): the
    output stays the target's, and the quantized head's drafts are still accepted."""
    from specdraft.runtime.quant import Int4Linear, Int8Linear, quant_supported

    if not quant_supported(int(weights[3:])):
        pytest.skip(f"this torch build lacks the {weights} weight-only CPU kernel")
    target = tiny_model(seed=0, vocab=VOCAB, layers=4, dtype=torch.bfloat16)
    drafter = EagleDrafter(random_head(target), target, max_len=256, max_batch=3, weights=weights)
    kind = Int8Linear if weights == "int8" else Int4Linear
    assert drafter.head.quantized and drafter.weights == weights
    assert all(isinstance(m, kind) for m in (drafter.head.fc, drafter.head.attn.wqkv, drafter.head.lm_head))
    plain, spec = engine(target), engine(target, drafter, k=4, tree=tree, max_batch=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [plain.generate(p, params).token_ids for p in PROMPTS]
    assert [r.token_ids for r in spec.generate_many(PROMPTS, [params] * 3)] == expected
    assert spec.totals.drafted > 0 and spec.totals.accepted > 0
    with pytest.raises(SpecdraftError, match="quantized"):
        drafter.head.vllm_state_dict()


def test_head_weights_option(target, tmp_path):
    random_head(target).save(tmp_path)
    drafter = make_drafter(f"eagle:{tmp_path}", target, ToyTokenizer(VOCAB))
    assert not drafter.head.quantized and drafter.weights == "float"  # the default: the head as trained
    with pytest.raises(SpecdraftError, match="choose from"):
        make_drafter(f"eagle:{tmp_path}", target, ToyTokenizer(VOCAB), options={"weights": "int3"})
    with pytest.raises(SpecdraftError, match="choose from"):
        make_drafter(f"eagle:{tmp_path}", target, ToyTokenizer(VOCAB), options={"weights": ["int8"]})
    with pytest.raises(SpecdraftError, match="unknown option"):
        make_drafter(f"eagle:{tmp_path}", target, ToyTokenizer(VOCAB), options={"bits": 8})


def test_greedy_identity_through_fallback_rounds(target, monkeypatch):
    """With adaptation the engine stops drafting for a while (rounds that only `observe` the pending
    token's features) and probes again later: the head's features must stay in step with the context. (The
    batch's plan is set to let every request draft what its controller wants: a random head's drafts do not
    pay, and the plan would rightly leave them out, which is not what this test is about.)"""
    monkeypatch.setattr(BatchPlanner, "plan", lambda self, alphas, depths, context=0: list(depths))
    drafter = EagleDrafter(random_head(target), target, max_len=256, max_batch=3)
    spec = engine(target, drafter, k=4, max_batch=3, adaptive=AdaptiveConfig(reprobe_after=2))
    params = SamplingParams(temperature=0, max_tokens=60)
    expected = [engine(target).generate(p, params).token_ids for p in PROMPTS]
    assert [r.token_ids for r in spec.generate_many(PROMPTS, [params] * 3)] == expected
    assert spec.totals.fallback_rounds > 0 and spec.totals.drafted > 0


class CheckedEagleDrafter(EagleDrafter):
    """Checks every proposal against a fresh drafter given the target's features of the whole committed
    context at once: the incremental bookkeeping (features appended in `observe`, the head's cache rolled
    back after drafting) must give the head exactly the inputs it would have from scratch. Losslessness
    tests cannot see a misaligned feature (it only lowers acceptance); this one can."""

    checked = 0

    def propose(self, request_ids, contexts, max_ks, max_nodes=None):
        out = super().propose(request_ids, contexts, max_ks, max_nodes)
        layers = sorted(set(self.layers))
        for i, (context, proposal) in enumerate(zip(contexts, out)):
            with torch.no_grad():
                captured = self.target.forward_sequence(torch.tensor([context[:-1]]), capture_layers=layers).captured
            fresh = EagleDrafter(self.head, self.target, max_len=256)
            fresh.add_request(DraftRequest(0, list(context[:-1]), SamplingParams(temperature=0), None, None, 0,
                                           {layer: captured[j, 0] for j, layer in enumerate(layers)}))
            nodes = None if max_nodes is None else [max_nodes[i]]
            expected = fresh.propose([0], [context], [max_ks[i]], nodes)[0]
            assert (proposal.tokens, proposal.parents) == (expected.tokens, expected.parents)
            # The head's cache: keys and values of positions 0 .. n-2, all from target features.
            slot, n = self._states[request_ids[i]].slot, len(context)
            assert self.cache.length(slot) == fresh.cache.length(0) == n - 1
            for mine, theirs in ((self.cache.k[0], fresh.cache.k[0]), (self.cache.v[0], fresh.cache.v[0])):
                torch.testing.assert_close(mine[slot, :, :n - 1], theirs[0, :, :n - 1], atol=1e-4, rtol=1e-4)
            CheckedEagleDrafter.checked += 1
        return out


@pytest.mark.parametrize("tree,adaptive", [(0, FIXED), (8, FIXED), (0, AdaptiveConfig(reprobe_after=2))])
def test_incremental_features_match_a_fresh_start(target, tree, adaptive):
    drafter = CheckedEagleDrafter(random_head(target), target, max_len=256, max_batch=3)
    spec = engine(target, drafter, k=3, tree=tree, max_batch=3, adaptive=adaptive)
    CheckedEagleDrafter.checked = 0
    params = SamplingParams(temperature=0, max_tokens=40)
    if adaptive.enabled:  # one at a time: a batch of three would switch this random head's drafts off
        for prompt in PROMPTS:
            # Each request probes on its own: the engine would otherwise remember this random head's cost (in
            # tiny models often above a target forward's) and keep the later requests from drafting.
            spec.draft_costs = DraftCostMemory()
            spec.generate(prompt, params)
    else:
        spec.generate_many(PROMPTS, [params] * 3)
    assert CheckedEagleDrafter.checked > 10 and spec.totals.accepted > 0


@pytest.mark.parametrize("tree,samples,variant", [(0, NUM_SAMPLES, "eagle3"), (3, NUM_SAMPLES // 4, "eagle3"),
                                                  (0, NUM_SAMPLES // 4, "eagle1")])
def test_sampled_distribution_matches_the_target(tree, samples, variant):
    """Chains sample from the head's distribution (rows over the target vocabulary, zero outside the draft
    vocabulary); trees are the deterministic top-3 children, tried in order by multi-candidate verification."""
    target = tiny_model(seed=0, vocab=VOCAB, layers=1)
    drafter = EagleDrafter(random_head(target, std=0.5, variant=variant), target, max_len=64, max_batch=BATCH)
    params = SamplingParams(temperature=1.0)
    spec = engine(target, drafter, k=1, tree=tree, max_batch=BATCH, max_len=64)
    counts = sample_joint(spec, params, samples)
    ok, p_value, tv = matches(counts, exact_joint(target, params))
    assert spec.totals.speculative_rounds == samples and 0 < spec.totals.accepted < samples
    assert ok, f"EAGLE speculative sampling differs from the target (p={p_value:.2e}, TV={tv:.4f})"
    assert PROMPT == [3, 7, 1]


# ---------------------------------------------------------------------------------------------- training


def own_outputs(target, n: int, seed: int, length: int = 40) -> list[list[int]]:
    """The target's own continuations of random prompts (half greedy, half sampled)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (4,), generator=g).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 0.7, max_tokens=length, seed=seed + i)
              for i in range(n)]
    results = engine(target, max_batch=16).generate_many(prompts, params)
    return [p + r.token_ids for p, r in zip(prompts, results)]


@pytest.fixture(scope="module")
def dataset(target):
    return own_outputs(target, 48, seed=1), own_outputs(target, 8, seed=2)


def acceptance(target, drafter) -> float:
    spec = engine(target, drafter, k=3, max_batch=3)
    spec.generate_many(PROMPTS, [SamplingParams(temperature=0, max_tokens=40)] * 3)
    return spec.totals.accepted / spec.totals.drafted


def test_training_reduces_loss_and_beats_a_random_head(target, dataset, tmp_path):
    train, val = dataset
    config = TrainConfig(steps=80, batch_size=8, lr=1e-2, warmup=5, ttt_steps=2, draft_vocab=12,
                         checkpoint_every=40, eval_every=40)
    result = train_eagle(target, train, val, tmp_path, config, progress=False)
    loss = result.history["loss"]
    assert sum(loss[-10:]) / 10 < 0.85 * sum(loss[:10]) / 10  # measured: 3.94 against 4.95
    # Held-out top-1 agreement per draft step (a random 4-layer target is hard to predict one layer deep:
    # about 0.25 here, against 1/12 for a uniform guess).
    first, last = result.history["val_agreement"][0], result.history["val_agreement"][-1]
    assert len(last) == 2 and last[0] >= first[0] - 0.02 and min(last) > 0.15
    for name in ("config.json", "model.safetensors", "loss.png", "accuracy.png", "history.json"):
        assert (tmp_path / name).is_file()
    head = EagleHead.load(tmp_path)
    assert head.eagle.draft_vocab_size == 12
    trained = make_drafter(f"eagle:{tmp_path}", target, ToyTokenizer(VOCAB), max_len=256, max_batch=3)
    untrained = EagleDrafter(random_head(target, std=0.02), target, max_len=256, max_batch=3)
    trained_rate, untrained_rate = acceptance(target, trained), acceptance(target, untrained)
    assert trained_rate > 2 * untrained_rate and trained_rate > untrained_rate + 0.04


def test_interrupted_and_resumed_training_ends_with_the_same_weights(target, dataset, tmp_path):
    train, val = dataset
    config = TrainConfig(steps=10, batch_size=4, lr=3e-3, warmup=2, ttt_steps=2, draft_vocab=12,
                         checkpoint_every=3, eval_every=5)
    whole = train_eagle(target, train, val, tmp_path / "whole", config, progress=False)
    part = train_eagle(target, train, val, tmp_path / "parts", config, stop_after=4, progress=False)
    assert not (tmp_path / "parts" / "model.safetensors").exists()  # not finished: only the checkpoint
    with pytest.raises(SpecdraftError, match="--resume"):
        train_eagle(target, train, val, tmp_path / "parts", config, progress=False)
    assert part.history["step"] == [1, 2, 3, 4]
    resumed = train_eagle(target, train, val, tmp_path / "parts", config, resume=True, progress=False)
    for (name, a), (_, b) in zip(whole.head.state_dict().items(), resumed.head.state_dict().items()):
        assert torch.equal(a, b), name
    assert resumed.history == whole.history


def test_warm_start_continues_a_trained_head(target, dataset, tmp_path):
    """`--init HEAD`: training starts from the head's weights and draft vocabulary (its first loss is the
    trained head's, far below a fresh head's), records what the head was trained on before, and refuses
    another draft vocabulary size."""
    train, val = dataset
    config = TrainConfig(steps=30, batch_size=8, lr=1e-2, warmup=3, ttt_steps=2, draft_vocab=12,
                         checkpoint_every=30, eval_every=30)
    first = train_eagle(target, train, val, tmp_path / "first", config, progress=False,
                        target_info={"data_settings": {"run": 1}})
    warm = TrainConfig(steps=5, batch_size=8, lr=1e-3, warmup=2, ttt_steps=2, init_head=str(tmp_path / "first"),
                       checkpoint_every=5, eval_every=5)
    second = train_eagle(target, train, val, tmp_path / "second", warm, progress=False,
                         target_info={"data_settings": {"run": 2}})
    assert second.history["loss"][0] < 0.9 * first.history["loss"][0]
    assert torch.equal(second.head.draft_to_target, first.head.draft_to_target)
    saved = EagleHead.load(tmp_path / "second").eagle.target
    assert saved["data_settings"] == {"run": 2} and saved["warm_start"]["data_settings"] == {"run": 1}
    with pytest.raises(SpecdraftError, match="draft vocabulary|drafts over 12"):
        train_eagle(target, train, val, tmp_path / "third", TrainConfig(steps=2, draft_vocab=10,
                    init_head=str(tmp_path / "first")), progress=False)


def test_eagle1_variant_learns_the_targets_next_feature(target, dataset, tmp_path):
    """`--variant eagle1`: one stream in (the last layer's), fc the identity and the target's own final norm
    and lm_head rows, all three left as they were by training; the head learns the target's next feature
    (its output moves towards it) and drafts that are accepted, losslessly, from a checkpoint that says
    what it is and refuses the speculators export."""
    from specdraft.train.eagle import _Batch, feature_loss
    from specdraft.train.features import draft_readout

    train, val = dataset
    config = TrainConfig(steps=60, batch_size=8, lr=1e-2, warmup=5, ttt_steps=2, draft_vocab=12,
                         checkpoint_every=60, eval_every=30, variant="eagle1")
    result = train_eagle(target, train, val, tmp_path, config, progress=False)
    head = EagleHead.load(tmp_path)
    assert head.eagle.variant == "eagle1" and head.eagle.hidden_layers == [3]  # the stream leaving layer 3
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["SpecdraftEagle1Head"] and raw["specdraft"]["variant"] == "eagle1"
    assert head.fc.weight.shape == (32, 32) and torch.equal(head.fc.weight, torch.eye(32))
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[head.draft_to_target].float())
    assert torch.equal(head.norm.weight, target.norm.weight.float())
    untrained = TrainConfig(steps=1, draft_vocab=12, variant="eagle1")
    from specdraft.train.eagle import new_head

    fresh = new_head(target, untrained, train)
    batch = _Batch(target, fresh, val, 2, draft_readout(target, fresh.draft_to_target))

    def distance(h: EagleHead, offset: int = 1) -> float:
        """From the head's outputs at rows t to the target's features at t + offset."""
        with torch.no_grad():
            outputs = h.unroll(batch.embeds, h.fuse(batch.aux), 1, valid=batch.valid(0))[1][0]
        return float(feature_loss(outputs, batch.features[:, offset:offset + batch.rows], batch.valid(0)))

    # A fresh head copies the feature it reads (fc the identity, a small residual layer); trained, it moves
    # towards the next one (measured 0.522 against 0.561; 0.264 from the current one).
    assert distance(fresh, offset=0) < 1e-3 and distance(head, offset=0) > 0.1
    assert distance(head) < 0.97 * distance(fresh)
    loss = result.history["loss"]
    assert sum(loss[-10:]) / 10 < 0.95 * sum(loss[:10]) / 10  # measured: 1.376 against 1.579
    assert min(result.history["val_agreement"][-1]) > 0.15  # measured: 0.28
    trained = make_drafter(f"eagle:{tmp_path}", target, ToyTokenizer(VOCAB), max_len=256, max_batch=3)
    plain, spec = engine(target), engine(target, trained, k=3, tree=4, max_batch=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    assert [r.token_ids for r in spec.generate_many(PROMPTS, [params] * 3)] == \
        [plain.generate(p, params).token_ids for p in PROMPTS]
    assert spec.totals.accepted > 0
    with pytest.raises(SpecdraftError, match="only EAGLE-3"):
        head.save(tmp_path / "export", format="speculators", verifier="tiny")
    with pytest.raises(SpecdraftError, match="eagle1 head"):
        train_eagle(target, train, val, tmp_path / "warm", TrainConfig(steps=1, init_head=str(tmp_path)),
                    progress=False)


@pytest.mark.parametrize("gemma", [False, True])
def test_eagle1_head_reads_a_feature_as_the_target_does(gemma):
    """An EAGLE-1 head starts with the target's own readout: its final norm and lm_head rows turn any
    feature into the target's logits over the draft vocabulary (Gemma's norm scales by 1 + w, the head's by
    w: the copy adds the one)."""
    from specdraft.train.eagle import new_head

    target = tiny_model(seed=3, vocab=VOCAB, layers=2, gemma=gemma)
    with torch.no_grad():
        target.norm.weight.normal_(0.0, 0.5)
    head = new_head(target, TrainConfig(draft_vocab=12, variant="eagle1"), [list(range(VOCAB))] * 2)
    features = torch.randn(5, target.config.hidden_size) * 3
    with torch.no_grad():
        expected = target.lm_head(target.norm(features))[:, head.draft_to_target]
        torch.testing.assert_close(head.lm_head(head.norm(head.fuse(features))), expected, atol=1e-5, rtol=1e-5)
    assert not any(p.requires_grad for p in (head.fc.weight, head.norm.weight, head.lm_head.weight))
    assert head.attn.wqkv.weight.requires_grad and head.mlp.w_down.weight.requires_grad


def test_eagle_config_checks_its_variant(target):
    with pytest.raises(SpecdraftError, match="choose from"):
        EagleConfig.for_target(target, variant="eagle2")
    with pytest.raises(SpecdraftError, match="reads 1 target streams"):
        EagleConfig.for_target(target, aux_layer_ids=[1, 2, 3], variant="eagle1")
    assert EagleConfig.for_target(target, variant="eagle1").aux_layer_ids == [4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (`specdraft train eagle --device cuda`)")
def test_training_on_a_gpu_follows_the_cpu_run(target, dataset, tmp_path):
    """The same seeded run on a GPU: the same batches and a loss curve that tracks the CPU's (both in bf16
    mixed precision or fp32, so not bit for bit), and a head that loads and drafts on the CPU afterwards."""
    train, val = dataset
    config = TrainConfig(steps=12, batch_size=8, lr=1e-2, warmup=3, ttt_steps=2, draft_vocab=12,
                         checkpoint_every=6, eval_every=6)
    on_cpu = train_eagle(target, train, val, tmp_path / "cpu", config, progress=False)
    gpu_target = tiny_model(seed=0, vocab=VOCAB, layers=4).to("cuda")
    on_gpu = train_eagle(gpu_target, train, val, tmp_path / "gpu", config, progress=False)
    assert on_gpu.history["step"] == on_cpu.history["step"]
    first_cpu, first_gpu = on_cpu.history["loss"][0], on_gpu.history["loss"][0]
    assert abs(first_gpu - first_cpu) < 0.05 * first_cpu
    assert on_gpu.history["loss"][-1] < first_gpu
    assert len(on_gpu.history["val_agreement"]) == 2
    head = EagleHead.load(tmp_path / "gpu")
    assert next(head.parameters()).device.type == "cpu"
    drafter = make_drafter(f"eagle:{tmp_path / 'gpu'}", target, ToyTokenizer(VOCAB), max_len=256, max_batch=3)
    assert acceptance(target, drafter) > 0


# ---------------------------------------------------------------------------------------------- distill


def test_distill_writes_shards_and_resumes(target, tmp_path, monkeypatch):
    prompts = ["abc", "defg", "hij", "k", "lmno", "pab"]
    config = DistillConfig(max_tokens=8, shard_size=2, max_batch=4)
    identity = {"model": "tiny", "prompts_sha256": "x"}
    steps = []
    original = Engine.step

    def interrupted(self, requests):
        if len(steps) == 12:
            raise KeyboardInterrupt
        steps.append([r.prompt_ids for r in requests])
        return original(self, requests)

    monkeypatch.setattr(Engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(target, ToyTokenizer(VOCAB), prompts, tmp_path, config, identity, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert not manifest["complete"] and len(manifest["shards"]) == 2  # 4 slots: the first two shards ran first
    # Stopped before its validation prompts: training holds out the last training sequences instead.
    with pytest.warns(UserWarning, match="holding out its last 1"):
        early_train, early_val = train_val_split(tmp_path)
    assert len(early_train) == 3 and len(early_val) == 1
    steps.clear()
    monkeypatch.setattr(Engine, "step", lambda self, requests: steps.append([r.prompt_ids for r in requests])
                        or original(self, requests))
    manifest = distill(target, ToyTokenizer(VOCAB), prompts, tmp_path, config, identity, progress=False)
    admitted = {tuple(p) for batch in steps for p in batch}
    assert admitted == {tuple(ord(c) - 97 for c in p) for p in prompts[4:]}  # finished shards do not run again
    assert manifest["complete"] and manifest["train_sequences"] == 5 and manifest["val_sequences"] == 1
    train = load_split(tmp_path, "train")
    val = load_split(tmp_path, "val")
    assert len(train) == 5 and len(val) == 1 and train_val_split(tmp_path) == (train, val)
    for i, seq in enumerate(train + val):
        ids = [ord(c) - 97 for c in prompts[i]]
        assert seq[:len(ids)] == ids and len(seq) == len(ids) + 8
        if i % 2 == 0:  # every other prompt is the target's greedy answer
            assert seq[len(ids):] == engine(target).generate(ids, SamplingParams(temperature=0, max_tokens=8)).token_ids
    seqs, prompt_lens = read_shard(tmp_path / "train-00000.safetensors")
    assert prompt_lens == [3, 4] and seqs == train[:2]
    with pytest.raises(SpecdraftError, match="other settings"):
        distill(target, ToyTokenizer(VOCAB), prompts, tmp_path, DistillConfig(max_tokens=9, shard_size=2), identity,
                progress=False)


def test_distill_records_the_targets_own_features(target, tmp_path):
    """The features kept while generating are the target's features of the finished sequence, position by
    position (checked against one cache-free forward over it), for the prompt and every decoded token."""
    prompts = ["abcdefg", "hi", "jklmn", "opo", "a"]  # the first is over max_prompt_tokens
    layers = [0, 2, -1]
    config = DistillConfig(max_tokens=10, shard_size=2, max_batch=3, hidden_layers=layers, val_fraction=0.2,
                           max_prompt_tokens=5)
    manifest = distill(target, ToyTokenizer(VOCAB), prompts, tmp_path, config, {"model": "tiny"}, progress=False)
    assert manifest["skipped_prompts"] == 1 and manifest["settings"]["hidden_layers"] == [-1, 0, 2]
    train, val = train_val_split(tmp_path, layers=[-1, 0, 2])
    assert len(train) == 3 and len(val) == 1
    for seq, feats in train + val:
        assert {layer: f.shape for layer, f in feats.items()} == {layer: (len(seq) - 2, 32) for layer in layers}
        out = target.forward_sequence(torch.tensor([seq]), capture_layers=[0, 2])
        expect = {0: out.captured[0, 0], 2: out.captured[1, 0], -1: out.hidden[0]}
        for layer in layers:
            torch.testing.assert_close(feats[layer].float(), expect[layer][:len(seq) - 2].float(), atol=0.03,
                                       rtol=0.02)
    with pytest.raises(SpecdraftError, match="no recorded target features"):
        train_val_split(tmp_path, layers=[1])


def test_training_data_can_be_several_distillations(target, tmp_path, capsys):
    """`--data A,B`: the sequences of each, concatenated in order, split as each was; recorded features are
    read only where every one recorded them; a directory that is not a distillation is named."""
    from specdraft.train.cli import _data_settings, _recorded
    from specdraft.train.data import data_dirs, train_val_splits

    layers = [-1, 0]
    a, b = tmp_path / "a", tmp_path / "b"
    distill(target, ToyTokenizer(VOCAB), ["abc", "defg", "hij", "kl"], a,
            DistillConfig(max_tokens=6, shard_size=2, max_batch=2, hidden_layers=layers, val_fraction=0.25),
            {"model": "tiny", "run": "a"}, progress=False)
    distill(target, ToyTokenizer(VOCAB), ["mno", "pa"], b, DistillConfig(max_tokens=5, shard_size=2, val_fraction=0.5),
            {"model": "tiny", "run": "b"}, progress=False)
    dirs = data_dirs(f"{a},{b}")
    assert dirs == [str(a), str(b)]
    train, val = train_val_splits(dirs)
    assert train == load_split(a, "train") + load_split(b, "train") and len(train) == 4
    assert val == load_split(a, "val") + load_split(b, "val") and len(val) == 2
    assert _recorded([str(a)], layers) == layers
    assert _recorded(dirs, layers) == []  # b recorded none: recompute for all
    assert "no recorded features for layers [-1, 0]" in capsys.readouterr().out
    assert [s["run"] for s in _data_settings(dirs)] == ["a", "b"] and _data_settings([str(a)])["run"] == "a"
    with pytest.raises(SpecdraftError, match="no manifest.json"):
        data_dirs(f"{a},{tmp_path / 'missing'}")
    with pytest.raises(SpecdraftError, match="names no directory"):
        data_dirs(" , ")


def test_training_on_recorded_features_matches_recomputing_them(target, tmp_path):
    """One batch from recorded features gives the head the inputs and soft labels a target forward gives."""
    from specdraft.train.eagle import _Batch
    from specdraft.train.features import draft_readout

    prompts = ["bcde", "fg", "hij"]
    layers = sorted({*random_head(target).eagle.hidden_layers, -1})
    config = DistillConfig(max_tokens=12, shard_size=4, max_batch=3, hidden_layers=layers, val_fraction=0)
    distill(target, ToyTokenizer(VOCAB), prompts, tmp_path, config, {"model": "tiny"}, progress=False)
    items, _ = train_val_split(tmp_path, layers=layers)
    head = random_head(target)
    readout = draft_readout(target, head.draft_to_target)
    recorded = _Batch(target, head, items, 2, readout)
    recomputed = _Batch(target, head, [seq for seq, _ in items], 2, readout)
    assert recorded.lengths.tolist() == [len(seq) - 2 for seq, _ in items]
    rows = recorded.rows
    for b, n in enumerate(recorded.lengths.tolist()):
        torch.testing.assert_close(recorded.aux[b, :n - 1], recomputed.aux[b, :n - 1], atol=0.03, rtol=0.02)
        torch.testing.assert_close(recorded.embeds[b, :n], recomputed.embeds[b, :n])
        assert float((recorded.soft[b, :n] - recomputed.soft[b, :n]).abs().max()) < 0.02
    for s in range(2):  # a recorded step trains only where its label is known
        assert (recorded.valid(s) <= recomputed.valid(s)[:, :rows]).all()


def test_cli_registers_train_and_distill(capsys):
    from specdraft.cli import main

    for argv in (["distill", "--help"], ["train", "eagle", "--help"], ["train", "medusa", "--help"],
                 ["export", "eagle", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--ttt-steps" in out and "--device" in out and "{eagle3,eagle1}" in out
    assert "{auto,bf16,fp32,gguf}" in out  # distill: a GGUF target may generate on its own quantized blocks


def test_train_options_reach_the_configs():
    """`specdraft train eagle|medusa` share their loop's options; each reaches its config field, and an
    option left out gives the config's own default (Medusa's higher learning rate included)."""
    import argparse

    from specdraft.train.cli import _add_training_arguments, _loop_settings
    from specdraft.train.medusa import MedusaTrainConfig

    eagle, medusa = argparse.ArgumentParser(), argparse.ArgumentParser()
    _add_training_arguments(eagle, "head", lr=3e-4)
    _add_training_arguments(medusa, "heads", lr=1e-3)
    base = ["--model", "m", "--data", "d", "--out", "o"]
    args = eagle.parse_args(base + ["--steps", "7", "--batch-size", "3", "--seq-len", "64", "--lr", "0.01",
                                    "--draft-vocab", "99", "--seed", "5", "--checkpoint-every", "2",
                                    "--eval-every", "3"])
    config = TrainConfig(**_loop_settings(args), ttt_steps=2)
    assert config == TrainConfig(steps=7, batch_size=3, seq_len=64, lr=0.01, draft_vocab=99, seed=5,
                                 checkpoint_every=2, eval_every=3, ttt_steps=2)
    assert TrainConfig(**_loop_settings(eagle.parse_args(base))) == TrainConfig()
    assert MedusaTrainConfig(**_loop_settings(medusa.parse_args(base))) == MedusaTrainConfig()
    assert MedusaTrainConfig().lr == 1e-3 and TrainConfig().lr == 3e-4


def test_aux_features_order():
    hidden = {0: torch.zeros(3, 2), 1: torch.ones(3, 2), 2: torch.full((3, 2), 2.0)}
    out = aux_features(hidden, [2, 0, 1], rows=[0, 2])
    assert out.shape == (2, 6) and out[0].tolist() == [2, 2, 0, 0, 1, 1]


def test_speculators_export_loads_back_with_identical_proposals(target, tmp_path):
    """The export vLLM and SGLang read: every field they look at, typed as they expect, tensors under the
    speculators names, and the same proposals when specdraft loads it back."""
    head = random_head(target)
    head.save(tmp_path / "spec", format="speculators", verifier="org/target",
              verifier_architectures=["LlamaForCausalLM"], speculative_tokens=4)
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    assert raw["draft_vocab_size"] == 12 and raw["norm_before_residual"] is False
    assert raw["target_hidden_size"] == 32 and raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    layer = raw["transformer_layer_config"]
    assert isinstance(layer, dict) and layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "max_position_embeddings"):
        assert isinstance(layer[key], int), key
    assert isinstance(layer["rms_norm_eps"], float) and isinstance(layer["rope_theta"], float)
    spec = raw["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["verifier"]["name_or_path"] == "org/target"
    method = spec["proposal_methods"][0]
    assert method["speculative_tokens"] == 4 and spec["default_proposal_method"] == method["proposal_type"]
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "spec" / "model.safetensors"))
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"layers.0.{name}.weight" for name in (
            "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert set(tensors) == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    loaded = make_drafter(f"eagle:{tmp_path / 'spec'}", target, ToyTokenizer(VOCAB), max_len=256, max_batch=2)
    original = EagleDrafter(head, target, max_len=256, max_batch=2)
    for tree in (0, 8):
        for x, y in zip(_proposals(original, target, True, tree), _proposals(loaded, target, True, tree)):
            assert x.tokens == y.tokens and x.parents == y.parents
    with pytest.raises(SpecdraftError, match="format"):
        head.save(tmp_path / "bad", format="medusa")


def test_export_command_writes_the_speculators_layout_for_a_bundled_target(tmp_path):
    from specdraft.cli import main
    from specdraft.runtime import load_model

    real = load_model("smollm2-135m", dtype="bf16", progress=False)
    head = EagleHead(EagleConfig.for_target(real, draft_vocab_size=64)).init_weights(0)
    head.set_draft_vocab(torch.arange(64))
    head.save(tmp_path / "head")
    assert main(["export", "eagle", "--model", "smollm2-135m", "--head", f"eagle:{tmp_path / 'head'}",
                 "--out", str(tmp_path / "out")]) == 0
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert raw["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert torch.equal(EagleHead.load(tmp_path / "out").lm_head.weight, head.lm_head.weight)
    assert main(["export", "eagle", "--model", "smollm2-135m", "--head", str(tmp_path / "head"),
                 "--out", str(tmp_path / "head")]) == 2  # would overwrite its input


@pytest.mark.slow
def test_distill_cli_names_the_weights_that_generated(tmp_path, capsys):
    """`specdraft distill` on the bundled GGUF model: by default (`--dtype auto`) it generates on the model's
    own blocks where the kernels build, as `specdraft serve` runs it, and the manifest says which weights
    generated (a resumed run must use the same)."""
    from specdraft.cli import main
    from specdraft.runtime import cpu_kernels

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name a colour."}\n{"prompt": "Count to three."}\n')
    common = ["distill", "--model", "smollm2-135m", "--prompts", str(prompts), "--max-tokens", "4",
              "--features", "none", "--max-batch", "2"]
    for dtype, expect in ((None, "gguf" if cpu_kernels.available() else "bf16"), ("bf16", "bf16")):
        out = tmp_path / f"data-{dtype}"
        assert main(common + ["--out", str(out)] + (["--dtype", dtype] if dtype else [])) == 0
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["complete"] and manifest["settings"]["dtype"] == expect
    if cpu_kernels.available():  # the auto run's data, resumed with the dense weights: refused, clearly
        capsys.readouterr()
        assert main(common + ["--out", str(tmp_path / "data-None"), "--dtype", "bf16"]) == 2
        assert "other settings" in capsys.readouterr().err
