"""Medusa heads: drafting (chains and trees of choices, lossless), save/load, training, on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from test_eagle import PROMPTS, VOCAB, acceptance, engine, own_outputs
from test_engine import BATCH, NUM_SAMPLES, exact_joint, matches, sample_joint
from tiny_models import ToyTokenizer, tiny_model

from specdraft.drafters import make_drafter
from specdraft.drafters.base import DraftRequest
from specdraft.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from specdraft.errors import SpecdraftError
from specdraft.train.medusa import MedusaTrainConfig, train_medusa
from specdraft.verify.sampling import SamplingParams

DRAFT_VOCAB = torch.arange(2, 14)


def random_heads(target, heads=3, seed=0, std=0.3) -> MedusaHeads:
    m = MedusaHeads(MedusaConfig(target.config.hidden_size, VOCAB, len(DRAFT_VOCAB), heads))
    m.set_draft_vocab(DRAFT_VOCAB)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return m


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=VOCAB, layers=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [0, 8])
def test_greedy_identity_batch_of_three(dtype, tree):
    target = tiny_model(seed=0, vocab=VOCAB, layers=4, dtype=dtype)
    spec = engine(target, MedusaDrafter(random_heads(target), target), k=3, tree=tree, max_batch=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [engine(target).generate(p, params).token_ids for p in PROMPTS]
    assert [r.token_ids for r in spec.generate_many(PROMPTS, [params] * 3)] == expected
    assert spec.totals.drafted > 0 and spec.totals.accepted > 0
    if tree:
        assert spec.totals.draft_nodes > spec.totals.drafted  # trees were proposed


def test_proposals_follow_the_heads(target):
    """Head k's best token is the k-th chain token; a tree holds the chain as its first path, stays within
    the heads' depth and the node budget, and keeps parents before children."""
    heads = random_heads(target, heads=3)
    drafter = MedusaDrafter(heads, target)
    prompt = [1, 2, 3]
    with torch.no_grad():
        final = target.forward_sequence(torch.tensor([prompt])).hidden[0]
    drafter.add_request(DraftRequest(0, prompt, SamplingParams(temperature=0), None, None, 0, {-1: final}))
    chain = drafter.propose([0], [prompt + [4]], [5])[0]
    best = heads(final[-1].float()).argmax(-1)
    assert chain.tokens == DRAFT_VOCAB[best].tolist() and len(chain.tokens) == 3  # capped by the heads
    tree = drafter.propose([0], [prompt + [4]], [3], [10])[0]
    assert len(tree.tokens) == 10 and max(tree.depths) <= 3
    assert all(p < i for i, p in enumerate(tree.parents))
    path, node = [], 0
    while node is not None:  # follow first children from the root: the chain
        path.append(tree.tokens[node])
        node = next((j for j, p in enumerate(tree.parents) if p == node), None)
    assert path == chain.tokens


def test_sampled_distribution_matches_the_target():
    """Trees of the heads' top choices (chains are the same deterministic proposals, one path)."""
    tree, samples = 3, NUM_SAMPLES // 2
    target = tiny_model(seed=0, vocab=VOCAB, layers=1)
    drafter = MedusaDrafter(random_heads(target, heads=2, std=0.5), target)
    params = SamplingParams(temperature=1.0)
    spec = engine(target, drafter, k=1, tree=tree, max_batch=BATCH, max_len=64)
    counts = sample_joint(spec, params, samples)
    ok, p_value, tv = matches(counts, exact_joint(target, params))
    assert spec.totals.speculative_rounds == samples and 0 < spec.totals.accepted < samples
    assert ok, f"Medusa speculative sampling differs from the target (p={p_value:.2e}, TV={tv:.4f})"


def test_save_load_round_trip_and_bad_paths(target, tmp_path):
    heads = random_heads(target)
    heads.save(tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["medusa_num_heads"] == 3 and raw["draft_vocab_size"] == 12
    loaded = make_drafter(f"medusa:{tmp_path / 'h'}", target, ToyTokenizer(VOCAB))
    h = torch.randn(5, target.config.hidden_size)
    assert torch.equal(loaded.heads(h), MedusaDrafter(heads, target).heads(h))
    assert torch.equal(loaded.heads.draft_to_target, DRAFT_VOCAB)
    heads.save(tmp_path / "small", dtype=torch.bfloat16)
    assert (tmp_path / "small" / "model.safetensors").stat().st_size < 0.6 * (
        tmp_path / "h" / "model.safetensors").stat().st_size
    with pytest.raises(SpecdraftError):
        make_drafter(f"medusa:{tmp_path / 'missing'}", target, ToyTokenizer(VOCAB))
    with pytest.raises(SpecdraftError):
        make_drafter("medusa:", target, ToyTokenizer(VOCAB))
    with pytest.raises(SpecdraftError, match="hidden size"):
        make_drafter(f"medusa:{tmp_path / 'h'}", tiny_model(seed=0, vocab=VOCAB, hidden=64), ToyTokenizer(VOCAB))


@pytest.fixture(scope="module")
def dataset(target):
    return own_outputs(target, 48, seed=1), own_outputs(target, 8, seed=2)


def test_training_reduces_loss_and_beats_untrained_heads(target, dataset, tmp_path):
    train, val = dataset
    config = MedusaTrainConfig(steps=60, batch_size=8, lr=1e-2, warmup=5, heads=2, draft_vocab=12,
                               checkpoint_every=30, eval_every=30)
    heads, history = train_medusa(target, train, val, tmp_path, config, progress=False)
    loss = history["loss"]
    assert sum(loss[-10:]) / 10 < 0.9 * sum(loss[:10]) / 10
    assert len(history["val_agreement"][-1]) == 2
    for name in ("config.json", "model.safetensors", "loss.png", "accuracy.png", "history.json"):
        assert (tmp_path / name).is_file()
    trained = make_drafter(f"medusa:{tmp_path}", target, ToyTokenizer(VOCAB))
    untrained = MedusaDrafter(random_heads(target, heads=2, std=0.3), target)
    assert acceptance(target, trained) > acceptance(target, untrained) + 0.04


def test_interrupted_and_resumed_training_ends_with_the_same_weights(target, dataset, tmp_path):
    train, val = dataset
    config = MedusaTrainConfig(steps=8, batch_size=4, lr=3e-3, warmup=2, heads=2, draft_vocab=12,
                               checkpoint_every=3, eval_every=4)
    whole, whole_history = train_medusa(target, train, val, tmp_path / "whole", config, progress=False)
    train_medusa(target, train, val, tmp_path / "parts", config, stop_after=4, progress=False)
    with pytest.raises(SpecdraftError, match="--resume"):
        train_medusa(target, train, val, tmp_path / "parts", config, progress=False)
    resumed, history = train_medusa(target, train, val, tmp_path / "parts", config, resume=True, progress=False)
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert history == whole_history


def test_shipped_heads_are_found_by_the_targets_signature(target, tmp_path, monkeypatch):
    """`medusa` / `eagle` without a path take the head shipped for the loaded target (matched by its
    architecture, not its path); `auto` takes the one marked default, and `ngram` where none ships."""
    import json

    from specdraft.drafters import shipped
    from specdraft.drafters.ngram import NgramDrafter
    from specdraft.drafters.shipped import target_signature

    monkeypatch.setattr(shipped, "HEADS_DIR", tmp_path)
    assert isinstance(make_drafter("auto", target, ToyTokenizer(VOCAB)), NgramDrafter)
    with pytest.raises(SpecdraftError, match="no medusa head ships"):
        make_drafter("medusa", target, ToyTokenizer(VOCAB))
    heads = random_heads(target, heads=2)
    heads.medusa.target["signature"] = target_signature(target)
    heads.save(tmp_path / "tiny" / "medusa")
    other = random_heads(target, heads=2)
    other.medusa.target["signature"] = {**target_signature(target), "num_layers": 99}
    other.save(tmp_path / "other" / "medusa")
    drafter = make_drafter("medusa", target, ToyTokenizer(VOCAB))
    assert drafter.name == "medusa" and drafter.heads.medusa.num_heads == 2
    assert shipped.shipped_head("medusa", target) == tmp_path / "tiny" / "medusa"
    assert isinstance(make_drafter("auto", target, ToyTokenizer(VOCAB)), NgramDrafter)  # none marked default
    config = tmp_path / "tiny" / "medusa" / "config.json"
    raw = json.loads(config.read_text())
    raw["specdraft"]["default"] = True
    config.write_text(json.dumps(raw))
    assert make_drafter("auto", target, ToyTokenizer(VOCAB)).name == "medusa"
