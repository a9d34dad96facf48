"""Engine losslessness and edge cases on tiny random models (fast; the real-model checks live elsewhere)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from scipy import stats
from tiny_models import ToyTokenizer, recycle_drafter, tiny_model

from specdraft.drafters.base import DraftRequest, Proposal
from specdraft.drafters.draft_model import ModelDrafter
from specdraft.drafters.ngram import NgramDrafter
from specdraft.drafters.quant import make_quant_drafter
from specdraft.drafters.self_draft import make_self_drafter
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import BONUS, CORRECTION, DRAFT, Engine
from specdraft.engine.metrics import SpecMetrics
from specdraft.errors import ContextOverflowError, SpecdraftError
from specdraft.verify import batch as verify_batch_module
from specdraft.verify.rejection import one_hot_probs
from specdraft.verify.sampling import SamplingParams

VOCAB = 16
FIXED = AdaptiveConfig(enabled=False)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(seed=1, vocab=VOCAB)


def engine(model, drafter=None, k=4, adaptive=FIXED, eos=None, max_len=256, max_batch=1):
    return Engine(model, ToyTokenizer(VOCAB, eos), drafter, k, adaptive, max_model_len=max_len, max_batch=max_batch)


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


class OracleDrafter:
    """Proposes a known continuation (the plain greedy output): always right."""

    name = "oracle"
    hidden_layers = ()

    def __init__(self, prompt_len: int, continuation: list[int], wrong: bool = False) -> None:
        self.prompt_len, self.continuation, self.wrong = prompt_len, continuation, wrong
        self.observed: list = []

    def add_request(self, request: DraftRequest) -> None:
        pass

    def propose(self, request_ids, contexts, max_ks, max_nodes=None) -> list[Proposal]:
        proposals = []
        for context, max_k in zip(contexts, max_ks):
            done = len(context) - self.prompt_len
            tokens = self.continuation[done:done + max_k]
            if self.wrong:
                tokens = [(t + 1) % VOCAB for t in tokens]
            proposals.append(Proposal(tokens))
        return proposals

    def observe(self, request_id, verified) -> None:
        self.observed.append(verified)

    def remove_request(self, request_id) -> None:
        pass


class SilentDrafter(OracleDrafter):
    def propose(self, request_ids, contexts, max_ks, max_nodes=None) -> list[Proposal]:
        return [Proposal([]) for _ in request_ids]


def make_drafters(target, draft):
    return {
        "ngram": lambda: NgramDrafter(),
        "draft": lambda: ModelDrafter(draft, max_len=256),
        "self:1": lambda: make_self_drafter(target, 1, max_len=256),
        "quant:int8": lambda: make_quant_drafter(target, 8, max_len=256),
        "draft=target": lambda: ModelDrafter(target, max_len=256),
        "recycle": lambda: recycle_drafter(),
        "recycle+table": lambda: recycle_drafter(table_seed=5),
    }


@pytest.mark.parametrize("name", ["ngram", "draft", "self:1", "quant:int8", "draft=target", "recycle",
                                  "recycle+table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adaptive", [FIXED, AdaptiveConfig()])
def test_greedy_identity(name, dtype, adaptive):
    target = tiny_model(seed=0, vocab=VOCAB, dtype=dtype)
    draft = tiny_model(seed=1, vocab=VOCAB, dtype=dtype)
    drafter = make_drafters(target, draft)[name]()
    plain, spec = engine(target), engine(target, drafter, k=4, adaptive=adaptive)
    params = SamplingParams(temperature=0, max_tokens=40)
    for ids in prompts():
        expected = plain.generate(ids, params).token_ids
        got = spec.generate(ids, params)
        assert got.token_ids == expected, f"{name} diverged from plain greedy for prompt {ids}"
        if name == "draft=target" and adaptive is FIXED:
            assert got.metrics.acceptance_rate == 1.0
    assert spec.totals.drafted > 0, "the drafter never drafted: the test would prove nothing"


@pytest.mark.parametrize("tree", [0, 6])
def test_a_prediction_speeds_up_the_output_it_predicts_and_changes_no_token(target, tree):
    """Predicted Outputs through the ngram drafter: the plain output as the prediction is accepted almost
    whole; an edited or a random prediction changes nothing either; token ids are checked, chains and trees."""
    plain = engine(target)
    spec = Engine(target, ToyTokenizer(VOCAB), NgramDrafter(), 4, FIXED, max_model_len=256, tree=tree)
    g = torch.Generator().manual_seed(5)
    for ids in prompts(4, seed=3):
        expected = plain.generate(ids, SamplingParams(temperature=0, max_tokens=40)).token_ids
        edited = expected[:10] + [(t + 1) % VOCAB for t in expected[10:14]] + expected[14:]
        noise = torch.randint(0, VOCAB, (40,), generator=g).tolist()
        accepted, from_prediction = {}, {}
        for name, prediction in (("none", None), ("exact", expected), ("edited", edited), ("noise", noise)):
            got = spec.generate(ids, SamplingParams(temperature=0, max_tokens=40, prediction=prediction))
            assert got.token_ids == expected, f"prediction {name} changed the output for prompt {ids}"
            m = got.metrics
            accepted[name] = m.accepted
            from_prediction[name] = m.prediction_accepted
            assert m.prediction_accepted <= min(m.prediction_drafted, m.accepted)
        assert accepted["exact"] >= 30 and accepted["exact"] > accepted["none"]
        assert accepted["edited"] >= 20
        # the prediction's own drafts: none without one, most of the output with the output itself
        assert from_prediction["none"] == 0 and from_prediction["exact"] >= 30
        assert from_prediction["edited"] >= 15 and from_prediction["edited"] > from_prediction["noise"]


def test_merged_metrics_add_up_every_counter():
    """`SpecMetrics.merge` (totals over requests) sums every count and time, the prediction's included."""
    first, second = SpecMetrics(), SpecMetrics()
    first.record_round(3, 2)
    second.record_round(4, 1, num_nodes=6)
    for i, name in enumerate(("prompt_tokens", "prediction_drafted", "prediction_accepted", "total_time")):
        setattr(first, name, i + 1)
        setattr(second, name, 10 * (i + 1))
    total = first.merge(second)
    assert (total.prompt_tokens, total.prediction_drafted, total.prediction_accepted, total.total_time) == (
        11, 22, 33, 44)
    assert (total.drafted, total.accepted, total.draft_nodes, total.tree_rounds) == (7, 3, 9, 1)
    assert total.drafted_per_position == [2, 2, 2, 1] and total.accepted_per_position == [2, 1, 0, 0]


def test_a_prediction_out_of_the_vocabulary_is_refused(target):
    with pytest.raises(SpecdraftError, match="prediction token ids"):
        engine(target, NgramDrafter()).generate([1, 2], SamplingParams(max_tokens=2, prediction=[VOCAB]))
    with pytest.raises(SpecdraftError, match="prediction must be"):
        SamplingParams(prediction=[-1])


def test_metrics_with_an_always_right_drafter(target):
    ids = [1, 2, 3]
    plain = engine(target).generate(ids, SamplingParams(temperature=0, max_tokens=21))
    spec = engine(target, OracleDrafter(3, plain.token_ids), k=4)
    result = spec.generate(ids, SamplingParams(temperature=0, max_tokens=21))
    assert result.token_ids == plain.token_ids
    m = result.metrics
    # 1 token from prefill, then 4 rounds of 4 drafts + bonus.
    assert m.target_forwards == 4 and m.drafted == 16 and m.accepted == 16
    assert m.mean_accepted_length == 5.0 and m.acceptance_rate == 1.0
    assert m.per_position_acceptance == [1.0] * 4
    assert result.origins == ["target"] + ([DRAFT] * 4 + [BONUS]) * 4
    assert plain.metrics.mean_accepted_length == 1.0


def test_always_wrong_drafter_is_lossless_and_falls_back(target):
    ids = [4, 5, 6]
    params = SamplingParams(temperature=0, max_tokens=120)
    plain = engine(target).generate(ids, params)
    wrong = OracleDrafter(3, plain.token_ids, wrong=True)
    result = engine(target, wrong, k=4, adaptive=AdaptiveConfig(reprobe_after=16)).generate(ids, params)
    assert result.token_ids == plain.token_ids
    m = result.metrics
    assert m.accepted == 0
    assert m.fallback_events >= 1 and m.fallback_rounds > 0.6 * m.target_forwards
    assert all(o in ("target", CORRECTION) for o in result.origins)
    assert any("fallback" in line for line in result.adaptation_log)


def test_eos_inside_accepted_block(target):
    ids = [7, 8, 9]
    plain = engine(target).generate(ids, SamplingParams(temperature=0, max_tokens=30))
    eos = plain.token_ids[6]  # the 7th generated token plays EOS
    first = plain.token_ids.index(eos)
    expected = plain.token_ids[:first + 1]
    for drafter in (None, OracleDrafter(3, plain.token_ids)):
        result = engine(target, drafter, k=5, eos=eos).generate(ids, SamplingParams(temperature=0, max_tokens=30))
        assert result.token_ids == expected and result.finish_reason == "stop"
        # The toy tokenizer writes token i as chr(97 + i) and EOS as nothing: the text stops at EOS.
        assert result.text == "".join(chr(97 + t) for t in expected[:first])


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_inside_accepted_block(target, max_tokens):
    ids = [1, 1, 2]
    plain = engine(target).generate(ids, SamplingParams(temperature=0, max_tokens=30))
    result = engine(target, OracleDrafter(3, plain.token_ids), k=5).generate(
        ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert result.token_ids == plain.token_ids[:max_tokens]
    assert result.finish_reason == "length"


def test_stop_string_inside_accepted_block(target):
    ids = [3, 1, 4]
    plain = engine(target).generate(ids, SamplingParams(temperature=0, max_tokens=30))
    stop = plain.text[5:7]
    cut = plain.text.find(stop)
    result = engine(target, OracleDrafter(3, plain.token_ids), k=5).generate(
        ids, SamplingParams(temperature=0, max_tokens=30, stop=[stop]))
    assert result.text == plain.text[:cut] and result.finish_reason == "stop"
    assert len(result.token_ids) == cut + len(stop)


def test_drafter_proposing_nothing_equals_plain(target):
    params = SamplingParams(temperature=0, max_tokens=25)
    for ids in prompts(3):
        plain = engine(target).generate(ids, params)
        result = engine(target, SilentDrafter(0, []), k=4).generate(ids, params)
        assert result.token_ids == plain.token_ids and result.metrics.drafted == 0


def test_k_larger_than_budget_and_context(target, draft):
    spec = engine(target, ModelDrafter(draft, max_len=64), k=16, max_len=64)
    plain = engine(target, max_len=64)
    ids = list(range(10))
    params = SamplingParams(temperature=0, max_tokens=64 - len(ids))  # fills the context exactly
    assert spec.generate(ids, params).token_ids == plain.generate(ids, params).token_ids
    with pytest.raises(ContextOverflowError):
        spec.generate(ids, SamplingParams(max_tokens=64 - len(ids) + 1))


def test_bad_requests_leave_engine_usable(target, draft):
    spec = engine(target, ModelDrafter(draft, max_len=256), k=3)
    with pytest.raises(SpecdraftError):
        spec.generate([], SamplingParams())
    with pytest.raises(SpecdraftError):
        spec.generate([VOCAB + 5], SamplingParams())
    params = SamplingParams(temperature=0, max_tokens=10)
    assert spec.generate([1, 2], params).token_ids == engine(target).generate([1, 2], params).token_ids


def test_seed_reproducible(target, draft):
    spec = engine(target, ModelDrafter(draft, max_len=256), k=3)
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=123)
    assert spec.generate([1, 2], params).token_ids == spec.generate([1, 2], params).token_ids


# ---------------------------------------------------------------- distribution (speculative sampling)

NUM_SAMPLES = 20_000
BATCH = 64  # requests per engine step: the samples are independent requests, batched for speed
PROMPT = [3, 7, 1]


def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(first two tokens) under plain sampling from the target, computed exactly: [VOCAB * VOCAB]."""
    from specdraft.verify.sampling import logits_to_probs

    cache = model.new_cache(16, num_slots=VOCAB)
    seqs = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
    logits = model(seqs, cache)
    first = logits_to_probs(logits[0, len(PROMPT) - 1], params)
    second = logits_to_probs(logits[:, -1], params)
    return (first[:, None] * second).flatten()


def sample_joint(eng: Engine, params: SamplingParams, n: int) -> torch.Tensor:
    """n independent seeded requests, run `eng.max_batch` at a time through the batched engine."""
    counts = torch.zeros(VOCAB * VOCAB)
    generator = torch.Generator().manual_seed(1234)
    seeds = torch.randint(0, 2**62, (n,), generator=generator).tolist()
    # max_tokens 3: the round after prefill drafts one token, so token 2 passes through verification.
    requests = [replace(params, max_tokens=3, seed=seed) for seed in seeds]
    for result in eng.generate_many([PROMPT] * n, requests):
        first, second = result.token_ids[:2]
        counts[first * VOCAB + second] += 1
    return counts


def matches(counts: torch.Tensor, probs: torch.Tensor) -> tuple[bool, float, float]:
    """Chi-square (bins with expected count < 5 pooled) and total variation against the exact joint."""
    n = counts.sum().item()
    expected = probs * n
    if (counts[probs == 0] > 0).any():
        return False, 0.0, 1.0
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    scale = obs[keep].sum().item() / exp[keep].sum().item()
    p_value = stats.chisquare(obs[keep].numpy(), exp[keep].numpy() * scale).pvalue
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    tv_bound = 0.5 * math.sqrt(big.sum().item() / n) + math.sqrt(math.log(1e6) / (2 * n))
    return bool(p_value > 1e-4 and tv < tv_bound), float(p_value), tv


SETTINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7 + top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 4": SamplingParams(temperature=1.0, top_k=4),
}


@pytest.fixture(scope="module")
def small_pair():
    """One-layer target and draft: the distribution tests run 20,000 generations each."""
    return tiny_model(seed=0, vocab=VOCAB, layers=1), tiny_model(seed=1, vocab=VOCAB, layers=1)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_matches_target_distribution(small_pair, setting):
    target, draft = small_pair
    params = SETTINGS[setting]
    spec = engine(target, ModelDrafter(draft, max_len=64, max_batch=BATCH), k=1, max_len=64, max_batch=BATCH)
    counts = sample_joint(spec, params, NUM_SAMPLES)
    ok, p_value, tv = matches(counts, exact_joint(target, params))
    assert spec.totals.drafted == NUM_SAMPLES and 0 < spec.totals.accepted < NUM_SAMPLES
    assert ok, f"{setting}: speculative sampling differs from the target (p={p_value:.2e}, TV={tv:.4f})"


@pytest.mark.parametrize("broken", [False, True], ids=["verifier", "planted-bug"])
def test_sampling_with_a_prediction_keeps_the_target_distribution(small_pair, monkeypatch, broken):
    """A prediction holding every token twice: the round after prefill always finds the first token in it and
    drafts what follows there, so token 2 always passes through a deterministic draft's verification. The
    planted bug (the residual ignored after a rejection, on one-hot drafts) must be caught."""
    target, _ = small_pair
    if broken:
        monkeypatch.setattr(verify_batch_module, "rejection_verify", broken_verify_any_draft)
    params = SamplingParams(temperature=0.8, prediction=list(range(VOCAB)) * 2)
    spec = engine(target, NgramDrafter(), k=1, max_len=64, max_batch=BATCH)
    assert_law_or_caught(spec, target, params, NUM_SAMPLES // 4 if broken else NUM_SAMPLES, broken,
                         "sampling with a prediction")


def assert_law_or_caught(spec: Engine, target, params: SamplingParams, n: int, broken: bool, what: str) -> None:
    """n requests, each drafting once: the first two tokens' law is the target's, or, with a planted bug in
    the verifier (`broken`), the check rejects it."""
    ok, p_value, tv = matches(sample_joint(spec, params, n), exact_joint(target, params))
    assert spec.totals.drafted == n and 0 < spec.totals.accepted < n
    if broken:
        assert not ok and p_value < 1e-6, f"broken verifier not caught (p={p_value:.2e}, TV={tv:.4f})"
    else:
        assert ok, f"{what} differs from the target (p={p_value:.2e}, TV={tv:.4f})"


def broken_residual_verify(draft_tokens, draft_probs, target_probs, generator=None):
    """Planted bug: resample from target_probs instead of norm(max(0, target - draft)) after a rejection."""
    from specdraft.verify.sampling import sample, uniforms

    batch, k = draft_tokens.shape
    if k == 0:
        return torch.zeros(batch, dtype=torch.long), sample(target_probs[:, 0], generator)[:, None]
    picked_target = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
    picked_draft = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    u = uniforms(picked_target.shape, generator)
    accept = (u * picked_draft < picked_target).long()
    accepted_len = accept.cumprod(-1).sum(-1)
    out = torch.cat([draft_tokens, torch.zeros(batch, 1, dtype=torch.long)], dim=1)
    rows = target_probs[torch.arange(batch), accepted_len]
    out[torch.arange(batch), accepted_len] = sample(rows, generator)
    return accepted_len, out


def broken_verify_any_draft(draft_tokens, draft_probs, target_probs, generator=None):
    """`broken_residual_verify` for deterministic drafts too (a lookup's, a prediction's: one-hot)."""
    if draft_probs is None:
        draft_probs = one_hot_probs(draft_tokens, target_probs.shape[-1])
    return broken_residual_verify(draft_tokens, draft_probs, target_probs, generator)


def test_distribution_test_catches_a_broken_verifier(small_pair, monkeypatch):
    """The same check, on a planted bug; a quarter of the samples already rejects it by a wide margin."""
    target, draft = small_pair
    monkeypatch.setattr(verify_batch_module, "rejection_verify", broken_residual_verify)
    params = SETTINGS["temperature 1"]
    spec = engine(target, ModelDrafter(draft, max_len=64, max_batch=BATCH), k=1, max_len=64, max_batch=BATCH)
    ok, p_value, tv = matches(sample_joint(spec, params, NUM_SAMPLES // 4), exact_joint(target, params))
    assert not ok and p_value < 1e-6, f"broken verifier not caught (p={p_value:.2e}, TV={tv:.4f})"


def test_exact_joint_is_a_distribution(small_pair):
    target, _ = small_pair
    for params in SETTINGS.values():
        joint = exact_joint(target, params)
        assert abs(joint.sum().item() - 1) < 1e-5
    # top-k 4 leaves 4 first tokens, each followed by 4 second tokens.
    assert (exact_joint(target, SETTINGS["top_k 4"]) > 0).sum().item() == 16


def test_low_confidence_stops_drafting_early(target, draft):
    params = SamplingParams(temperature=0, max_tokens=30)
    ids = [2, 4, 6]
    cautious = engine(target, ModelDrafter(draft, max_len=256, min_confidence=0.9), k=4)
    eager = engine(target, ModelDrafter(draft, max_len=256), k=4)
    expected = engine(target).generate(ids, params).token_ids
    assert cautious.generate(ids, params).token_ids == expected == eager.generate(ids, params).token_ids
    # Fewer tokens drafted per round: the draft stops at its first low-confidence token (after the first).
    per_round = lambda e: e.totals.drafted / e.totals.speculative_rounds  # noqa: E731
    assert per_round(cautious) < per_round(eager)


def test_failed_probes_back_off_and_a_paying_probe_resets_the_wait():
    """Simulated rounds (no model): a plain forward takes 10 ms, verification 11 ms. While a draft step costs
    8 ms and every draft is rejected, the wait before each probe doubles up to the cap; once a probe pays
    (2 ms drafts, all accepted), the next fallback waits the base time again."""
    from specdraft.engine.adaptive import DraftLengthController

    # window=1: estimates follow the last round, so one paying probe is enough to resume speculation.
    controller = DraftLengthController(4, AdaptiveConfig(reprobe_after=4, max_reprobe_after=16, window=1))
    waits: list[int] = []

    def rounds(n: int, accept: bool) -> None:
        for _ in range(n):
            k = controller.next_k()
            if k == 0:
                controller.update(0, 0, 0.0, 0.010)
                continue
            controller.update(k, k if accept else 0, (0.002 if accept else 0.008) * k, 0.011)
            if controller.in_fallback:
                waits.append(controller.fallback_left)

    rounds(120, accept=False)
    assert waits[:5] == [4, 8, 16, 16, 16]
    assert any("for 16 rounds" in line for line in controller.log)
    waits.clear()
    rounds(20, accept=True)  # the next probe pays: speculation goes on
    assert not controller.in_fallback and controller.reprobe_after == 4
    rounds(10, accept=False)
    assert waits[0] == 4


def test_a_draft_that_cannot_pay_is_remembered_across_requests():
    """Simulated rounds: a plain forward takes 10 ms and every draft token 20 ms (a draft model twice the
    target's size). The first request probes and falls back; the requests after it start in fallback, each
    waiting twice as long as the one before, up to the cap; a cheap draft is never held back."""
    from specdraft.engine.adaptive import DraftCostMemory, DraftLengthController

    config = AdaptiveConfig(reprobe_after=4, max_reprobe_after=32)
    memory = DraftCostMemory()

    def run_request(draft_step: float, rounds: int = 12) -> list[int]:
        controller = DraftLengthController(4, config, memory)
        ks = []
        for _ in range(rounds):
            k = controller.next_k()
            ks.append(k)
            controller.update(k, k, draft_step * k, 0.010 + 0.001 * k) if k else controller.update(0, 0, 0.0, 0.010)
        memory.record(controller)
        return ks

    first = run_request(0.020)
    assert first[:3] == [0, 0, 1] and memory.hopeless and memory.cost_ratio > 1.5
    assert memory.reprobe_after == 8  # its probe after 4 plain rounds failed too
    waits = []
    for _ in range(4):
        ks = run_request(0.020, rounds=80)
        waits.append(next(i for i, k in enumerate(ks) if k) - 2)  # plain rounds after the calibration
    assert waits == [16, 32, 32, 32]
    cheap = DraftCostMemory()
    memory.__dict__.update(cheap.__dict__)
    assert run_request(0.002)[2] == 1 and not memory.hopeless


def test_a_slow_draft_costs_later_requests_no_probe(target):
    """Through the engine: a drafter slower than the target falls back in the first request; the second
    drafts nothing at all, and both equal plain decoding."""
    import time

    class SlowOracle(OracleDrafter):
        def propose(self, request_ids, contexts, max_ks, max_nodes=None):
            time.sleep(0.02 * max(max_ks))
            return super().propose(request_ids, contexts, max_ks, max_nodes)

    ids = [3, 1, 4]
    params = SamplingParams(temperature=0, max_tokens=24)
    want = engine(target).generate(ids, params).token_ids
    spec = engine(target, SlowOracle(len(ids), want, wrong=True), k=4, adaptive=AdaptiveConfig())
    first, second = spec.generate(ids, params), spec.generate(ids, params)
    assert first.token_ids == second.token_ids == want
    assert first.metrics.drafted > 0 and second.metrics.drafted == 0
    assert spec.draft_costs.hopeless


def test_baseline_ignores_the_cold_first_step_and_is_bounded_by_verification():
    """The first decoding step after a prefill runs cold (measured 27 ms against 15 ms later on SmolLM2): taken
    alone as the plain baseline it made a drafter as slow as the target look 1.3x faster."""
    from specdraft.engine.adaptive import CALIBRATION_ROUNDS, DraftLengthController

    controller = DraftLengthController(4)
    assert CALIBRATION_ROUNDS == 2
    assert controller.next_k() == 0
    controller.update(0, 0, 0.0, 0.027)
    assert controller.next_k() == 0  # still calibrating
    controller.update(0, 0, 0.0, 0.015)
    assert controller.plain_forward == 0.015
    assert controller.next_k() > 0
    controller.update(2, 2, 0.004, 0.013)  # verifying 3 tokens in 13 ms: a plain step takes at most that
    assert controller.plain_forward == 0.013


def test_shared_cache_draft_copies_what_it_missed(target):
    """A self-draft that shares the target's cache copies the keys/values of tokens decoded while it was not
    consulted instead of running them through its layers, and proposes what a draft that ran them would."""
    prompt = [3, 1, 4, 1, 5]
    cache = target.new_cache(64)
    decoded = engine(target).generate(prompt, SamplingParams(temperature=0, max_tokens=12)).token_ids
    context = prompt + decoded
    target(torch.tensor([context[:-1]]), cache)
    cache.commit(0, len(context) - 1)  # the engine's state: every token but the newest is committed
    proposals = []
    for share in (True, False):
        drafter = ModelDrafter(target, exit_layer=1, max_len=64, share_prompt_cache=share)
        drafter.add_request(DraftRequest(0, prompt, SamplingParams(temperature=0), None, target_cache=cache))
        calls = []
        original = drafter.model.forward
        drafter.model.forward = lambda x, *a, calls=calls, original=original, **k: (
            calls.append(x.shape[1]) or original(x, *a, **k))
        proposals.append(drafter.propose([0], [context], [3])[0].tokens)
        drafter.model.forward = original
        if share:
            assert calls == [1, 1, 1]  # the 11 missed tokens were copied, only the newest one is fed
            layer0 = slice(len(prompt), len(context) - 1)
            assert torch.equal(drafter.cache.k[0][0, :, layer0], cache.k[0][0, :, layer0])
        else:
            # A draft of its own runs its prompt at the first proposal, with the missed tokens, then the newest.
            assert calls[:2] == [len(context) - 1, 1]
    assert proposals[0] == proposals[1]


def test_a_cold_first_draft_round_does_not_turn_a_cheap_draft_off():
    """A drafter's first call runs cold (an EAGLE head measured 18 ms, then 1.5 ms a step, against a 10 ms
    target forward): taken as the draft's cost it read as 3.8 plain forwards a token, the request fell back
    and the cost memory then kept every later request from drafting at all."""
    from specdraft.engine.adaptive import CALIBRATION_ROUNDS, DraftCostMemory, DraftLengthController

    memory = DraftCostMemory()
    controller = DraftLengthController(4, AdaptiveConfig(), memory)
    draft_costs = iter([0.040] + [0.0015] * 100)
    ks = []
    for _ in range(12):
        k = controller.next_k()
        ks.append(k)
        if k == 0:
            controller.update(0, 0, 0.0, 0.010)
        else:
            controller.update(k, k - 1 if k > 1 else 1, next(draft_costs) * k, 0.010 + 0.0005 * k)
    assert ks[:CALIBRATION_ROUNDS] == [0] * CALIBRATION_ROUNDS
    assert 0 not in ks[CALIBRATION_ROUNDS:] and max(ks) > 1 and controller.fallback_events == 0
    assert controller.draft_step < 0.002
    memory.record(controller)
    assert not memory.hopeless


def test_a_stalled_round_does_not_switch_speculation_off_but_a_slow_verification_does():
    """Simulated rounds: a plain forward takes 10 ms, a draft token 0.5 ms, verification 0.5 ms a token, every
    draft accepted. One round stalled 50 times over (another process, a page fault) once made the request
    fall back for 16 rounds and fail every probe after it (its verification cost stayed inflated); now one
    stall moves the estimate a little. Verification that truly costs 1.5 forwards a token still falls back;
    once it is cheap again, a probe that stalls fails, and the next measures afresh and resumes."""
    from specdraft.engine.adaptive import DraftLengthController

    controller = DraftLengthController(4)
    ks: list[int] = []

    def rounds(n: int, stall: float = 1.0, extra_per_token: float = 0.0005) -> None:
        """`n` rounds; `stall` slows the drafted ones."""
        for _ in range(n):
            k = controller.next_k()
            ks.append(k)
            if k == 0:
                controller.update(0, 0, 0.0, 0.010)
            else:
                controller.update(k, k, 0.0005 * k, (0.010 + extra_per_token * k) * stall)

    rounds(20)
    assert controller.fallback_events == 0 and ks[-1] == 4
    rounds(1, stall=50.0)
    rounds(20)
    assert controller.fallback_events == 0 and ks[-20:] == [4] * 20
    rounds(10, extra_per_token=0.015)
    assert controller.fallback_events == 1 and controller.in_fallback
    rounds(controller.fallback_left)
    rounds(1, stall=50.0)  # verification is cheap again, but the probe stalls: it fails
    assert controller.fallback_events == 2 and controller.in_fallback
    ks.clear()
    rounds(60)
    assert controller.fallback_events == 2 and ks[-20:] == [4] * 20  # the next probe measured afresh and paid
    assert controller.reprobe_after == AdaptiveConfig().reprobe_after


def test_timing_estimates_take_a_stall_as_a_few_times_the_estimate():
    from specdraft.smoothing import STALL_FACTOR, geometric_ema, timing_ema

    assert timing_ema(None, 5.0, 0.5) == 5.0  # nothing to compare with: taken whole
    assert timing_ema(1.0, 100.0, 0.5) == pytest.approx(1.0 + 0.5 * (STALL_FACTOR - 1.0))
    assert timing_ema(1.0, 0.2, 0.5) == pytest.approx(0.6)  # faster: taken whole
    assert timing_ema(0.0, 3.0, 0.5, expected=2.0) == pytest.approx(0.5 * min(3.0, STALL_FACTOR * 2.0))
    assert timing_ema(0.0, 30.0, 0.5, expected=2.0) == pytest.approx(0.5 * STALL_FACTOR * 2.0)
    assert geometric_ema(1.0, 4.0, 0.5) == pytest.approx(2.0)  # half way in logarithms
    assert geometric_ema(None, 4.0, 0.5) == 4.0
    assert timing_ema(1.0, 100.0, 0.5, geometric=True) == pytest.approx(STALL_FACTOR ** 0.5)
    estimate = 1.0
    for _ in range(12):  # a real slowdown, 10 times over, is followed within a dozen rounds
        estimate = timing_ema(estimate, 10.0, 1 / 8)
    assert estimate > 5.0
