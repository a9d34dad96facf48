"""The `recycle` drafter: its n-gram table, the target's recycled predictions, the trees it grows, and its
losslessness through the engine (greedy identity and the target's distribution when sampling)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from real_models import greedy_reference
from test_engine import BATCH, FIXED, NUM_SAMPLES, VOCAB, matches, prompts
from test_tree import exact_joint_2_3, sample_joint_2_3, tree_engine
from tiny_models import ToyTokenizer, recycle_drafter, tiny_model

from specdraft.drafters import make_drafter
from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified
from specdraft.drafters.recycle import (
    MATCH_CHANCE,
    RECYCLED_CHANCE,
    TABLE_FILE,
    TABLE_WEIGHT,
    NgramTable,
    RecycledPredictions,
    RecycleDrafter,
    context_keys,
    pack_key,
)
from specdraft.drafters.shipped import HEADS_DIR
from specdraft.engine.adaptive import CHEAP_DRAFT, AdaptiveConfig, DraftLengthController
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.verify.sampling import SamplingParams

# ------------------------------------------------------------------------------------------ the table


def brute_force_table(sequences, top, min_count):
    """{context tuple: [(token, count / (total + 1)), ...]} counted the obvious way."""
    counts: dict[tuple, Counter] = defaultdict(Counter)
    for seq, start in sequences:
        for i in range(start, len(seq)):
            for order in (1, 2, 3):
                if i - order >= 0:
                    counts[tuple(seq[i - order:i])][seq[i]] += 1
    table = {}
    for context, counter in counts.items():
        total = sum(counter.values())
        if total >= min_count:
            ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))[:top]
            table[context] = [(token, n / (total + 1)) for token, n in ranked]
    return table


def random_sequences(n=40, vocab=12, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 30))
        out.append((rng.integers(0, vocab, length).tolist(), int(rng.integers(0, 8))))
    return out


@pytest.mark.parametrize("top, min_count", [(1, 1), (3, 2), (4, 5)])
def test_table_counts_match_a_brute_force_count(top, min_count):
    sequences = random_sequences()
    expected = brute_force_table(sequences, top, min_count)
    table = NgramTable.build(sequences, top=top, min_count=min_count)
    assert len(table) == len(expected)
    for context, want in expected.items():
        row = table._rows[pack_key(context)]
        got = [(t, p) for t, p in zip(table.next_tokens[row].tolist(), table.next_probs[row].tolist()) if t >= 0]
        assert [t for t, _ in got] == [t for t, _ in want], context
        assert np.allclose([p for _, p in got], [p for _, p in want]), context


def test_table_counts_only_the_answers_and_looks_up_the_longest_context():
    # Prompt [5, 6, 7] (start 3) is not counted: 6 -> 7 never appears as an answer transition.
    table = NgramTable.build([([5, 6, 7, 1, 2, 1, 2, 1, 3], 3)], top=2, min_count=1)
    assert table.lookup([6]) == (0, [])
    order, found = table.lookup([9, 2, 1])
    assert order == 2 and [t for t, _ in found] == [2, 3]  # (2, 1) was followed by 2 once and 3 once
    assert table.lookup([1, 2, 1])[0] == 3
    assert table.lookup([4])[0] == 0


def test_context_keys_are_the_packed_suffixes_longest_first():
    for tail in ([], [5], [1, 2], [1, 2, 3], [9, 8, 7, 6]):
        want = [(order, pack_key(tail[len(tail) - order:])) for order in range(min(3, len(tail)), 0, -1)]
        assert context_keys(tail) == want
    assert len({pack_key(c) for c in ([0], [0, 0], [0, 0, 0], [1], [0, 1])}) == 5  # orders never collide


def test_table_save_load_round_trip(tmp_path):
    table = NgramTable.build(random_sequences(seed=3), top=3, min_count=1, meta={"model": "toy"})
    path = table.save(tmp_path / "t" / TABLE_FILE)
    loaded = NgramTable.load(path.parent)
    assert loaded.meta == {"model": "toy"} and len(loaded) == len(table)
    for tail in ([1], [2, 3], [4, 5, 6], [11, 0, 7]):
        got, want = loaded.lookup(tail), table.lookup(tail)
        assert got[0] == want[0] and [t for t, _ in got[1]] == [t for t, _ in want[1]]
        assert np.allclose([p for _, p in got[1]], [p for _, p in want[1]], atol=1e-3)  # stored as fp16


def test_bad_tables_are_clear_errors(tmp_path):
    with pytest.raises(SpecdraftError, match="no n-gram table"):
        NgramTable.load(tmp_path / "missing")
    (tmp_path / TABLE_FILE).write_bytes(b"not a table")
    with pytest.raises(SpecdraftError, match="not a specdraft n-gram table"):
        NgramTable.load(tmp_path)
    with pytest.raises(ValueError, match="token ids"):
        NgramTable.build([([1, -2, 3], 0)])
    with pytest.raises(ValueError, match="does not fit"):
        NgramTable.build([([1, 2], 0)], vocab_size=1 << 21)


# ------------------------------------------------------------------------------ recycled predictions


def test_recycled_predictions_longest_context_latest_wins_and_bounded():
    recycled = RecycledPredictions(capacity=8)
    recycled.record([1, 2, 3], [7, 8])
    assert recycled.lookup([9, 2, 3]) == (2, (7, 8))
    assert recycled.lookup([1, 2, 3]) == (3, (7, 8))
    recycled.record([5, 3], [4])
    assert recycled.lookup([0, 0, 3]) == (1, (4,))  # the latest prediction after 3
    assert recycled.lookup([9, 2, 3]) == (2, (7, 8))
    for t in range(20):
        recycled.record([100 + t], [t])
    assert len(recycled) <= 8 and recycled.lookup([119]) == (1, (19,))


# ------------------------------------------------------------------------------------------- drafting


def drafter_with(context, table=None, **kwargs):
    drafter = RecycleDrafter(table, **kwargs)
    drafter.add_request(DraftRequest(0, list(context), SamplingParams(temperature=0), None))
    return drafter


def test_candidates_combine_sources_as_independent_evidence():
    table = NgramTable.build([([1, 2, 3, 1, 2, 4], 0)], top=2, min_count=1)
    drafter = drafter_with([1, 2, 3, 9, 1, 2], table)
    drafter.recycled.record([1, 2], [3, 5])
    index = drafter._indexes[0]
    found = drafter.candidates(index, index.tokens)
    # 3: after the context's earlier (1, 2), the target's top prediction after (1, 2), and the table.
    p_table = TABLE_WEIGHT[2] * 1 / 3  # (1, 2) -> 3 once and -> 4 once in the table's data
    expected_3 = 1 - (1 - MATCH_CHANCE[2]) * (1 - RECYCLED_CHANCE[2][0]) * (1 - p_table)
    assert found[3] == pytest.approx(expected_3)
    assert found[5] == pytest.approx(RECYCLED_CHANCE[2][1])
    assert found[4] == pytest.approx(p_table)
    assert set(found) == {3, 4, 5}


def check_tree(proposal: Proposal, max_depth: int, max_nodes: int) -> None:
    assert len(proposal) <= max_nodes
    assert max(proposal.depths, default=0) <= max_depth
    siblings = defaultdict(list)
    for token, parent in zip(proposal.tokens, proposal.parents):
        siblings[parent].append(token)
    assert all(len(kids) == len(set(kids)) for kids in siblings.values()), "repeated sibling tokens"


@pytest.mark.parametrize("seed", range(5))
def test_trees_are_valid_best_first_and_chains_follow_the_best_child(seed):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, 6, (60,), generator=g).tolist()
    table = NgramTable.build([(torch.randint(0, 6, (200,), generator=g).tolist(), 0)], top=3, min_count=1)
    drafter = drafter_with(context, table)
    index = drafter._indexes[0]
    for max_depth, max_nodes in ((1, 4), (3, 7), (5, 15)):
        tree = drafter.grow(index, max_depth, max_nodes)
        check_tree(tree, max_depth, max_nodes)
        found = drafter.candidates(index, index.tokens)
        # Six tokens, every context has candidates: the budget is filled, at depth 1 by the root's candidates.
        assert len(tree) == (min(max_nodes, len(found)) if max_depth == 1 else max_nodes)
        # Best first: the first child of the root is the best candidate after the context.
        assert tree.tokens[0] == min(found, key=lambda t: (-found[t], t))
    chain = drafter.propose([0], [context], [4])[0]
    assert chain.is_chain and len(chain) == 4
    assert chain.tokens[0] == tree.tokens[0]
    assert drafter.propose([0], [context], [0])[0].tokens == []


def test_observe_recycles_the_targets_predictions_along_each_node_path():
    drafter = drafter_with([1, 2, 3])
    # Pending token 3; a tree 4 -> 5 and a sibling 6; the target accepted [4] and emitted 4, 9.
    scored, parents = [3, 4, 5, 6], [ROOT, 0, ROOT]
    top = torch.tensor([[4, 6], [9, 5], [7, 8], [2, 1]])
    context = [1, 2, 3, 4, 9]
    drafter.observe(0, Verified(scored, [3, 4, 5, 4], [0], [4, 9], context, {}, parents, top))
    recycled = drafter.recycled
    assert recycled.lookup([1, 2, 3]) == (3, (4, 6))  # after the committed context
    assert recycled.lookup([2, 3, 4]) == (3, (9, 5))  # after node 0 (token 4)
    assert recycled.lookup([3, 4, 5]) == (3, (7, 8))  # after node 1 (4 then 5), rejected but still exact
    assert recycled.lookup([2, 3, 6]) == (3, (2, 1))  # after the sibling 6
    assert drafter._indexes[0].tokens == context


# ------------------------------------------------------------------------------- through the engine


class TopKSpy:
    """Drafts nothing; checks what the engine hands to `observe` as the target's top-k."""

    name = "spy"
    hidden_layers = ()
    target_topk = 3

    def __init__(self):
        self.seen: list[Verified] = []

    def add_request(self, request):
        pass

    def propose(self, request_ids, contexts, max_ks, max_nodes=None):
        return [Proposal([]) for _ in request_ids]

    def observe(self, request_id, verified):
        self.seen.append((list(verified.context), verified))  # the engine's context list grows later

    def remove_request(self, request_id):
        pass


def test_engine_hands_the_targets_top_k_to_drafters_that_ask():
    target = tiny_model(seed=0, vocab=VOCAB)
    spy = TopKSpy()
    engine = Engine(target, ToyTokenizer(VOCAB), spy, 3, FIXED, max_model_len=128)
    result = engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=12))
    # Every round but the last (the request is finished then) is observed; the first token is the prefill's.
    assert len(spy.seen) == len(result.token_ids) - 2
    for context, verified in spy.seen:
        assert verified.target_topk.shape == (1, 3)
        # Greedy plain rounds: the target's best next token is the one it emitted.
        assert verified.target_topk[0, 0].item() == verified.emitted[0] == context[-1]
        logits = target(torch.tensor([context[:-1]]), target.new_cache(64))[0, -1]
        assert verified.target_topk[0].tolist() == logits.topk(3).indices.tolist()


@pytest.mark.parametrize("tree", [0, 7])
def test_recycle_learns_from_the_engine_and_gets_drafts_accepted(tree):
    """Greedy identity of chains and trees is checked with every drafter's (test_engine.py, test_tree.py);
    here: the drafter records the target's predictions through the engine, and its drafts are accepted."""
    target = tiny_model(seed=0, vocab=VOCAB)
    drafter = recycle_drafter(table_seed=5)
    spec = tree_engine(target, drafter, k=4, tree=tree, max_batch=3)
    batch = prompts() + [[1, 2, 3, 1, 2, 3, 1, 2]]
    spec.generate_many(batch, [SamplingParams(temperature=0, max_tokens=40)] * len(batch))
    assert spec.totals.accepted > 0 and len(drafter.recycled) > 0
    assert (spec.totals.tree_rounds > 0) == bool(tree)


def test_recycle_trees_keep_the_target_distribution():
    """Deterministic trees from all three sources at temperature 0.8, 20,000 requests."""
    target = tiny_model(seed=0, vocab=VOCAB, layers=1)
    params = SamplingParams(temperature=0.8)
    engine = tree_engine(target, recycle_drafter(table_seed=7), k=2, tree=6, max_len=64, max_batch=BATCH)
    counts = sample_joint_2_3(engine, params, NUM_SAMPLES)
    assert engine.totals.tree_rounds >= NUM_SAMPLES // 2 and engine.totals.accepted > 0
    ok, p_value, tv = matches(counts, exact_joint_2_3(target, params))
    assert ok, f"recycle trees differ from the target (p={p_value:.2e}, TV={tv:.4f})"


# ------------------------------------------------------------------------------------ the controller


def test_a_cheap_draft_is_held_to_half_the_acceptance_bar():
    """Acceptance below `min_acceptance` stops a costly draft; a draft that costs next to nothing and still
    measures faster than plain decoding goes on down to half of it, and stops below that."""
    def run(draft_seconds, accepted_pattern):
        controller = DraftLengthController(5, AdaptiveConfig(min_acceptance=0.4))
        for _ in range(3):
            controller.update(0, 0, 0.0, 0.010)  # plain rounds: 10 ms each
        for i in range(24):
            if controller.next_k() == 0:
                controller.update(0, 0, 0.0, 0.010)
                continue
            # Depth 4; verifying 5 tokens costs 10% more than one.
            controller.update(4, accepted_pattern[i % len(accepted_pattern)], draft_seconds, 0.011)
        return controller

    cheap_seconds, costly_seconds = 0.2 * CHEAP_DRAFT * 0.010 * 4, 0.3 * 0.010 * 4
    # One of four right in two rounds of three: acceptance about 1/3, between the two bars.
    cheap, costly = run(cheap_seconds, [1, 0, 1]), run(costly_seconds, [1, 0, 1])
    assert cheap.cheap and not costly.cheap
    assert 0.2 < cheap.alpha < 0.4
    assert cheap.fallback_events == 0
    assert costly.fallback_events > 0
    hopeless = run(cheap_seconds, [0])  # never right: stops although it costs nothing
    assert hopeless.cheap and hopeless.fallback_events > 0


# ----------------------------------------------------------------------------------- spec and shipping


def test_drafter_specs_and_options(tmp_path):
    target = tiny_model(seed=0, vocab=VOCAB)
    tokenizer = ToyTokenizer(VOCAB)
    drafter = make_drafter("recycle:none", target, tokenizer)
    assert isinstance(drafter, RecycleDrafter) and drafter.table is None
    table_dir = tmp_path / "table"
    NgramTable.build([([1, 2, 3, 1, 2], 0)], min_count=1).save(table_dir / TABLE_FILE)
    drafter = make_drafter(f"recycle:{table_dir}", target, tokenizer, options={"max_n": 3})
    assert len(drafter.table) > 0 and drafter.max_n == 3
    assert make_drafter("recycle", target, tokenizer).table is None  # nothing ships for a toy model
    with pytest.raises(SpecdraftError, match="no n-gram table"):
        make_drafter(f"recycle:{tmp_path / 'nope'}", target, tokenizer)
    with pytest.raises(SpecdraftError, match="unknown option"):
        make_drafter("recycle:none", target, tokenizer, options={"min_n": 2})
    with pytest.raises(SpecdraftError, match="max_n"):
        make_drafter("recycle:none", target, tokenizer, options={"max_n": 0})


def test_train_ngram_table_from_a_distillation(tmp_path):
    from specdraft.train.distill import DistillConfig, distill
    from specdraft.train.ngram_table import build_ngram_table

    target = tiny_model(seed=0, vocab=VOCAB)
    data = tmp_path / "data"
    distill(target, ToyTokenizer(VOCAB), ["abc", "defg", "hij", "klmn"], data, DistillConfig(max_tokens=12),
            {"model": "tiny"}, progress=False)
    table = build_ngram_table(target, data, tmp_path / "out", top=3, min_count=1, progress=False)
    assert len(table) > 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())["specdraft"]
    assert config["kind"] == "recycle" and config["target"]["signature"]["vocab_size"] == VOCAB
    assert config["target"]["contexts"] == len(table)
    assert len(NgramTable.load(tmp_path / "out")) == len(table)
    with pytest.raises(SpecdraftError, match="no manifest|manifest"):
        build_ngram_table(target, tmp_path / "empty", tmp_path / "out2", progress=False)


# ------------------------------------------------------------------------------------ the shipped tables

SHIPPED_TABLES = sorted(p.parent for p in HEADS_DIR.glob("*/recycle/config.json"))


def test_a_table_ships_for_each_bundled_model():
    assert {p.parent.name for p in SHIPPED_TABLES} >= {"smollm2-135m", "gemma3-270m"}


@pytest.mark.parametrize("table_dir", SHIPPED_TABLES, ids=lambda p: p.parent.name)
def test_shipped_table_is_small_documented_and_loads(table_dir):
    assert 0 < (table_dir / TABLE_FILE).stat().st_size <= 25 * 10**6
    card = (table_dir / "CARD.md").read_text()
    for section in ("## Data", "## Commands", "## Training", "## Measured"):
        assert section in card, f"{table_dir}/CARD.md lacks {section}"
    config = json.loads((table_dir / "config.json").read_text())["specdraft"]
    assert config["kind"] == "recycle" and config["target"]["model"] == table_dir.parent.name
    table = NgramTable.load(table_dir)
    assert len(table) == config["target"]["contexts"] > 1000
    assert int(table.next_tokens.max()) < config["target"]["signature"]["vocab_size"]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["smollm2-135m", "gemma3-270m"])
def test_shipped_table_drafts_losslessly_for_its_target(model_name, dev_prompts):
    target, tokenizer, prompts, expected, params = greedy_reference(model_name, dev_prompts, 32)
    drafter = make_drafter("recycle", target, tokenizer)
    assert drafter.table is not None and drafter.table.meta["model"] == model_name
    for tree in (0, 7):
        engine = Engine(target, tokenizer, drafter, 4, FIXED, max_model_len=512, tree=tree)
        assert [engine.generate(ids, params).token_ids for ids in prompts] == expected
        assert engine.totals.accepted > 0
