"""Token trees: the tree verifiers (greedy and multi-candidate rejection sampling), trees through the whole
engine (greedy identity with every drafter, the target's distribution at 20,000 samples per tree shape, a
planted broken tree verifier the test catches), the draft-tree builders and the shape chooser."""

from __future__ import annotations

import pytest
import torch
from test_engine import BATCH, FIXED, NUM_SAMPLES, PROMPT, VOCAB, matches, prompts
from tiny_models import ToyTokenizer, recycle_drafter, tiny_model

from specdraft.drafters.base import ROOT, DraftRequest, Proposal
from specdraft.drafters.draft_model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.drafters.quant import make_quant_drafter
from specdraft.drafters.self_draft import make_self_drafter
from specdraft.engine.adaptive import AdaptiveConfig, TreeShapeChooser
from specdraft.engine.core import MAX_TREE_NODES, Engine
from specdraft.errors import SpecdraftError
from specdraft.verify import batch as verify_batch_module
from specdraft.verify.sampling import SamplingParams, logits_to_probs, sample
from specdraft.verify.tree import greedy_tree_verify, tree_attention_mask, tree_depths, tree_rejection_verify


def tree_engine(model, drafter, k=3, tree=6, adaptive=FIXED, max_len=256, max_batch=1):
    return Engine(model, ToyTokenizer(VOCAB), drafter, k, adaptive, max_model_len=max_len, max_batch=max_batch,
                  tree=tree)


# ---------------------------------------------------------------- layout and greedy verification


def test_tree_layout():
    parents = [ROOT, 0, ROOT, 2, 0]
    assert tree_depths(parents) == [1, 2, 1, 2, 2]
    mask = tree_attention_mask(parents)
    # row 1 + i: node i sees the root, itself and its ancestors only.
    assert mask[1 + 1].tolist() == [True, True, True, False, False, False]
    assert mask[1 + 3].tolist() == [True, False, False, True, True, False]
    assert mask[1 + 4].tolist() == [True, True, False, False, False, True]
    chain = tree_attention_mask([ROOT, 0, 1])
    assert torch.equal(chain, torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="earlier node"):
        Proposal([1, 2], None, [ROOT, 1])


def test_greedy_tree_verify_walks_the_matching_branch():
    tokens, parents = [5, 6, 7, 8], [ROOT, ROOT, 1, 1]  # 5 | 6 -> (7 | 8)
    logits = torch.zeros(5, 10)
    logits[0, 6] = 1  # after the root the target wants 6 (second sibling)
    logits[1 + 1, 8] = 1  # after 6 it wants 8 (second child)
    logits[1 + 3, 2] = 1  # after 8 it wants 2 (bonus)
    assert greedy_tree_verify(tokens, parents, logits) == ([1, 3], [6, 8, 2])
    logits[0] = 0
    logits[0, 9] = 1  # nothing matches at the root: emit the target's own token
    assert greedy_tree_verify(tokens, parents, logits) == ([], [9])


def test_proposal_truncation_keeps_a_tree():
    p = Proposal([1, 2, 3, 4, 5], None, [ROOT, 0, 1, ROOT, 3])
    assert p.truncated(2).parents == [ROOT, 0, ROOT, 2] and p.truncated(2).tokens == [1, 2, 4, 5]
    assert p.truncated(3, 2).tokens == [1, 2]
    assert Proposal([1, 2, 3]).truncated(2).tokens == [1, 2]


# ---------------------------------------------------------------- the tree sampler on synthetic distributions

SMALL_V = 6


def random_dist(generator, sharp=2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(SMALL_V, generator=generator) * sharp, -1)


def draw_children(q: torch.Tensor, count: int, mode: str, generator) -> tuple[list[int], list[torch.Tensor] | None]:
    """Siblings from q: i.i.d. ('iid'), without replacement ('without'), or q's top-k ('topk', one-hot)."""
    if mode == "topk":
        return torch.topk(q, count).indices.tolist(), None
    tokens, rows, current = [], [], q.clone()
    for _ in range(count):
        token = int(sample(current, generator))
        tokens.append(token)
        rows.append(current / current.sum())
        if mode == "without":
            current = current.clone()
            current[token] = 0
    return tokens, rows


SHAPES = {"siblings": [3], "two levels": [2, 2], "deep": [1, 2, 2]}  # children per node at each depth


def synthetic_run(shape, mode, target_table, draft_table, generator, verify=tree_rejection_verify):
    """Grow a tree of the given shape from the draft's per-(previous token) distributions, verify it against
    the target's, and return the first two emitted tokens (the second drawn plainly if only one came)."""
    tokens, parents, rows = [], [], []
    level = [(ROOT, 0)]  # (node, token it ends with); the context ends with token 0
    for children in shape:
        nxt = []
        for node, last in level:
            kids, kid_rows = draw_children(draft_table[last], children, mode, generator)
            for j, token in enumerate(kids):
                tokens.append(token)
                parents.append(node)
                rows.append(None if kid_rows is None else kid_rows[j])
                nxt.append((len(tokens) - 1, token))
        level = nxt
    ends = [0] + tokens
    target_probs = torch.stack([target_table[t] for t in ends])
    draft_probs = None if mode == "topk" else torch.stack(rows)
    path, emitted = verify(tokens, parents, draft_probs, target_probs, generator)
    if len(emitted) < 2:
        emitted.append(int(sample(target_table[emitted[0]], generator)))
    return emitted[0], emitted[1]


def synthetic_counts(shape, mode, n, verify=tree_rejection_verify, seed=0):
    g = torch.Generator().manual_seed(seed)
    target_table = torch.stack([random_dist(g) for _ in range(SMALL_V)])
    draft_table = torch.stack([random_dist(g) for _ in range(SMALL_V)])
    counts = torch.zeros(SMALL_V * SMALL_V)
    for _ in range(n):
        a, b = synthetic_run(shape, mode, target_table, draft_table, g, verify)
        counts[a * SMALL_V + b] += 1
    exact = (target_table[0][:, None] * target_table).flatten()
    return counts, exact


@pytest.mark.parametrize("shape, mode", [("siblings", "iid"), ("two levels", "without"), ("deep", "topk"),
                                         ("two levels", "topk")])
def test_tree_sampler_keeps_the_target_distribution(shape, mode):
    counts, exact = synthetic_counts(SHAPES[shape], mode, 20_000)
    ok, p_value, tv = matches(counts, exact)
    assert ok, f"{shape}/{mode}: tree sampling differs from the target (p={p_value:.2e}, TV={tv:.4f})"


def no_residual_update_verify(tokens, parents, draft_probs, target_probs, generator=None):
    """Planted bug: after a rejected sibling, the next is judged against the same p (no residual update)."""
    from specdraft.verify.tree import children_of

    children, node, path = children_of(parents), ROOT, []
    while True:
        p = target_probs[1 + node]
        for child in children[node]:
            q = 1.0 if draft_probs is None else float(draft_probs[child, tokens[child]])
            if float(torch.rand((), generator=generator)) * q < float(p[tokens[child]]):
                path.append(child)
                node = child
                break
        else:
            return path, [tokens[i] for i in path] + [int(sample(p, generator))]


@pytest.mark.parametrize("mode", ["without", "topk"])
def test_distribution_test_catches_a_broken_tree_verifier(mode):
    counts, exact = synthetic_counts(SHAPES["siblings"], mode, 20_000, verify=no_residual_update_verify)
    ok, p_value, tv = matches(counts, exact)
    assert not ok and p_value < 1e-6, f"broken tree verifier not caught (p={p_value:.2e}, TV={tv:.4f})"


# ---------------------------------------------------------------- trees through the whole engine


class ShapeDrafter:
    """Proposes trees of a fixed shape, children drawn from a draft distribution at their parent (a fixed
    random table by the parent's token, through the request's sampling params): i.i.d., without replacement,
    or the top-k (deterministic)."""

    name = "shape"
    hidden_layers = ()

    def __init__(self, parents, mode, seed=0):
        self.parents, self.mode = parents, mode
        self.generator = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(VOCAB, VOCAB, generator=self.generator) * 2
        self.params = {}

    def add_request(self, request: DraftRequest) -> None:
        self.params[request.request_id] = request.params

    def propose(self, request_ids, contexts, max_ks, max_nodes=None):
        out = []
        for request_id, context in zip(request_ids, contexts):
            tokens = [0] * len(self.parents)
            rows: list[torch.Tensor | None] = [None] * len(self.parents)
            for parent in [ROOT, *range(len(self.parents))]:
                kids = [i for i, p in enumerate(self.parents) if p == parent]
                if not kids:
                    continue
                last = context[-1] if parent == ROOT else tokens[parent]
                q = logits_to_probs(self.logits[last], self.params[request_id])
                drawn, drawn_rows = draw_children(q, len(kids), self.mode, self.generator)
                for j, i in enumerate(kids):
                    tokens[i] = drawn[j]
                    rows[i] = None if drawn_rows is None else drawn_rows[j]
            probs = None if self.mode == "topk" else torch.stack(rows)
            out.append(Proposal(tokens, probs, list(self.parents)))
        return out

    def observe(self, request_id, verified) -> None:
        pass

    def remove_request(self, request_id) -> None:
        self.params.pop(request_id, None)


# Through the engine: sampled children (without replacement) and deterministic top-k children; i.i.d.
# children are covered by the synthetic test above, and a draft model's own trees below.
ENGINE_SHAPES = {
    "three siblings then one": ([ROOT, ROOT, ROOT, 0], "without"),
    "top-3 then top-2": ([ROOT, ROOT, ROOT, 0, 0, 1], "topk"),
}


def exact_joint_2_3(model, params: SamplingParams) -> torch.Tensor:
    """P(second and third tokens) under plain sampling, exactly: [VOCAB * VOCAB] (the first marginalised)."""
    cache = model.new_cache(16, num_slots=VOCAB)
    first = logits_to_probs(model(torch.tensor([PROMPT]), model.new_cache(16))[0, -1], params)
    joint = torch.zeros(VOCAB, VOCAB)
    second = logits_to_probs(model(torch.tensor([PROMPT + [t] for t in range(VOCAB)]), cache)[:, -1], params)
    for t1 in range(VOCAB):
        cache = model.new_cache(16, num_slots=VOCAB)
        seqs = torch.tensor([PROMPT + [t1, t2] for t2 in range(VOCAB)])
        third = logits_to_probs(model(seqs, cache)[:, -1], params)
        joint += first[t1] * second[t1][:, None] * third
    return joint.flatten()


def sample_joint_2_3(eng: Engine, params: SamplingParams, n: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB * VOCAB)
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(99)).tolist()
    requests = [SamplingParams(temperature=params.temperature, top_p=params.top_p, max_tokens=4, seed=s)
                for s in seeds]
    for result in eng.generate_many([PROMPT] * n, requests):
        counts[result.token_ids[1] * VOCAB + result.token_ids[2]] += 1
    return counts


@pytest.fixture(scope="module")
def small_pair():
    return tiny_model(seed=0, vocab=VOCAB, layers=1), tiny_model(seed=1, vocab=VOCAB, layers=1)


@pytest.mark.parametrize("shape", list(ENGINE_SHAPES))
def test_tree_speculative_sampling_through_the_engine(small_pair, shape):
    """20,000 requests each: the first token comes from the prefill, the second and third from one verified
    tree (depth 2), so their joint law must be the target's."""
    target, _ = small_pair
    parents, mode = ENGINE_SHAPES[shape]
    params = SamplingParams(temperature=0.8)
    eng = tree_engine(target, ShapeDrafter(parents, mode), k=2, tree=len(parents), max_len=64,
                      max_batch=BATCH)
    counts = sample_joint_2_3(eng, params, NUM_SAMPLES)
    # Every request verifies a tree right after its prefill (and another if the first emitted fewer than 3).
    assert eng.totals.tree_rounds >= NUM_SAMPLES and 0 < eng.totals.accepted < 2 * eng.totals.tree_rounds
    ok, p_value, tv = matches(counts, exact_joint_2_3(target, params))
    assert ok, f"{shape}: tree sampling through the engine differs (p={p_value:.2e}, TV={tv:.4f})"


def test_model_drafter_trees_keep_the_target_distribution(small_pair):
    """A draft model's top-k trees (deterministic children) at temperature 0.8, 20,000 requests."""
    target, draft = small_pair
    params = SamplingParams(temperature=0.8)
    eng = tree_engine(target, ModelDrafter(draft, max_len=64, max_batch=BATCH), k=2, tree=6, max_len=64,
                      max_batch=BATCH)
    counts = sample_joint_2_3(eng, params, NUM_SAMPLES)
    assert eng.totals.tree_rounds >= NUM_SAMPLES and eng.totals.accepted > 0
    ok, p_value, tv = matches(counts, exact_joint_2_3(target, params))
    assert ok, f"model-drafter trees differ from the target (p={p_value:.2e}, TV={tv:.4f})"


def test_engine_distribution_test_catches_a_broken_tree_verifier(small_pair, monkeypatch):
    target, _ = small_pair
    monkeypatch.setattr(verify_batch_module, "tree_rejection_verify", no_residual_update_verify)
    parents, mode = ENGINE_SHAPES["top-3 then top-2"]
    eng = tree_engine(target, ShapeDrafter(parents, mode), k=2, tree=len(parents), max_len=64,
                      max_batch=BATCH)
    params = SamplingParams(temperature=0.8)
    ok, p_value, tv = matches(sample_joint_2_3(eng, params, NUM_SAMPLES // 4), exact_joint_2_3(target, params))
    assert not ok and p_value < 1e-6, f"broken tree verifier not caught (p={p_value:.2e}, TV={tv:.4f})"


def make_tree_drafters(target, draft):
    return {
        "ngram": lambda: NgramDrafter(),
        "draft": lambda: ModelDrafter(draft, max_len=256, max_batch=3),
        "self:1": lambda: make_self_drafter(target, 1, max_len=256, max_batch=3),
        "quant:int8": lambda: make_quant_drafter(target, 8, max_len=256, max_batch=3),
        "shape top-k": lambda: ShapeDrafter([ROOT, ROOT, 0, 1, 0, 2], "topk"),
        "recycle": lambda: recycle_drafter(),
        "recycle+table": lambda: recycle_drafter(table_seed=5),
    }


@pytest.mark.parametrize("name", ["ngram", "draft", "self:1", "quant:int8", "shape top-k", "recycle",
                                  "recycle+table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adaptive", [FIXED, AdaptiveConfig()])
def test_tree_greedy_identity(name, dtype, adaptive):
    """Every drafter's trees, alone and three requests at once: the tokens of plain greedy decoding."""
    target = tiny_model(seed=0, vocab=VOCAB, dtype=dtype)
    draft = tiny_model(seed=1, vocab=VOCAB, dtype=dtype)
    drafter = make_tree_drafters(target, draft)[name]()
    plain = Engine(target, ToyTokenizer(VOCAB), None, 0, FIXED, max_model_len=256)
    spec = tree_engine(target, drafter, k=4, tree=8, adaptive=adaptive, max_batch=3)
    params = SamplingParams(temperature=0, max_tokens=40)
    batch = prompts() + [[1, 2, 3, 1, 2, 3, 1, 2]]
    expected = [plain.generate(ids, params).token_ids for ids in batch]
    results = spec.generate_many(batch, [params] * len(batch))
    for ids, want, got in zip(batch, expected, results):
        assert got.token_ids == want, f"{name} tree diverged from plain greedy for prompt {ids}"
    assert spec.totals.tree_rounds > 0, "no tree was verified: the test would prove nothing"


def test_model_drafter_grows_a_best_first_tree(small_pair):
    """The first path of the tree follows the draft's own greedy chain, siblings are distinct, and the tree
    respects its budget and depth."""
    _, draft = small_pair
    drafter = ModelDrafter(draft, max_len=64)
    drafter.add_request(DraftRequest(0, PROMPT, SamplingParams(temperature=0), None))
    tree = drafter.propose([0], [PROMPT], [3], [10])[0]
    assert 3 < len(tree) <= 10 and max(tree.depths) <= 3 and not tree.is_chain
    siblings = {}
    for token, parent in zip(tree.tokens, tree.parents):
        siblings.setdefault(parent, []).append(token)
    assert all(len(set(s)) == len(s) for s in siblings.values())
    chain = ModelDrafter(draft, max_len=64)
    chain.add_request(DraftRequest(0, PROMPT, SamplingParams(temperature=0), None))
    greedy = chain.propose([0], [PROMPT], [3])[0].tokens
    node, path = ROOT, []
    while node in tree.parents:  # follow first children: the draft's best token after each node
        node = tree.parents.index(node)
        path.append(tree.tokens[node])
    assert len(path) >= 2 and path == greedy[:len(path)]
    # The drafter's cache is back to the context: the tree's keys are gone.
    assert drafter.cache.length(drafter._states[0].slot) == len(PROMPT)


def test_tree_size_is_validated():
    model = tiny_model(seed=0, vocab=VOCAB)
    for bad in (-1, MAX_TREE_NODES + 1, 2.5, True):
        with pytest.raises(SpecdraftError, match="tree must be an integer"):
            tree_engine(model, NgramDrafter(), tree=bad)


def test_shape_chooser_prefers_the_measured_faster_shape():
    chooser = TreeShapeChooser(16, window=4, explore_every=8, max_wait=64)
    assert chooser.arms == [15, 7, 3, 0]
    assert [TreeShapeChooser(n).arms for n in (1, 2, 3, 8, 12)] == [[0], [2, 0], [3, 0], [7, 3, 0], [7, 3, 0]]
    # Trees: more tokens per round but slower rounds; the chain is fastest per second.
    speed = {15: (3, 0.060), 7: (2.8, 0.040), 3: (2.5, 0.025), 0: (2, 0.010)}
    picks = []
    for _ in range(400):
        arm = chooser.choose()
        picks.append(arm)
        chooser.update(arm, *speed[arm])
    assert picks[:4] == [15, 7, 3, 0]  # each shape tried once, the largest tree first
    later = picks[200:]
    assert set(later) == {0, 3, 7, 15}  # the losers are still re-measured now and then...
    assert later.count(0) > 0.9 * len(later)  # ...but rarely: their wait doubles while they lose
    assert chooser.wait[15] == 64
    # When trees become faster (the text turned repetitive), the choice follows within one wait.
    speed[15] = (8, 0.020)
    for _ in range(200):
        chooser.update(arm := chooser.choose(), *speed[arm])
    assert chooser.best() == 15 and chooser.choose() == 15


def test_a_new_request_starts_from_the_shapes_measured_so_far():
    chooser = TreeShapeChooser(16, explore_every=8, max_wait=64)
    speed = {15: (3, 0.060), 7: (2.8, 0.040), 3: (2.5, 0.025), 0: (2, 0.010)}
    for _ in range(100):
        chooser.update(arm := chooser.choose(), *speed[arm])
    child = chooser.fork()
    assert child.choose() == 0  # no shape is re-measured from scratch: the chain is already known best
    assert child.rate(15) == chooser.rate(15) and child.wait == chooser.wait
    child.update(0, 1, 0.010)
    assert chooser.rate(0) != child.rate(0) or chooser.tokens[0] != child.tokens[0]  # independent copies
