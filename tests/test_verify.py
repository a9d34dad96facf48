"""Verification math: greedy acceptance by hand, rejection sampling by statistics.

The statistical tests model a tiny "language" as a Markov chain over V tokens (each position's distribution
depends on the previous token), so `target_probs[:, i]` genuinely depends on the draft prefix as it does in
a real model. One verification round is run on N independent rows; rows that stopped early are completed by
plain sampling from the target (which is what later rounds amount to). The emitted sequences must then follow
the target chain exactly. The same check is run against planted broken verifiers and must reject them,
so a pass means something.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from scipy import stats

from specdraft.verify import (
    SamplingParams,
    greedy_verify,
    logits_to_probs,
    rejection_verify,
    sample,
)
from specdraft.verify.greedy import argmax, topk_indices
from specdraft.verify.rejection import one_hot_probs, pad_vocab
from specdraft.verify.tree import ROOT

VOCAB = 8
NUM_SAMPLES = 40_000
# Acceptance region: chi-square p-value above P_ACCEPT and total variation below `tv_bound`. With fixed seeds
# every test is deterministic; the bounds say how unlikely a false failure of a correct verifier is.
P_ACCEPT = 1e-4
# A broken verifier must be rejected decisively, not just fall outside the acceptance region.
P_REJECT = 1e-6
TV_FAILURE_PROB = 1e-6


# ---------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------


def tv_bound(num_samples: int, num_bins: int, failure_prob: float = TV_FAILURE_PROB) -> float:
    """A total-variation bound that a correct sampler exceeds with probability < failure_prob.

    E[TV] <= 0.5 * sum_i sqrt(p_i / n) <= 0.5 * sqrt(bins / n) (Jensen), and TV moves by at most 1/n per
    sample, so McDiarmid adds sqrt(ln(1/failure_prob) / (2n)).
    """
    return 0.5 * math.sqrt(num_bins / num_samples) + math.sqrt(math.log(1 / failure_prob) / (2 * num_samples))


@dataclass
class Distance:
    p_value: float
    tv: float
    tv_bound: float

    @property
    def matches(self) -> bool:
        return self.p_value > P_ACCEPT and self.tv < self.tv_bound

    @property
    def decisively_different(self) -> bool:
        return self.p_value < P_REJECT or self.tv > self.tv_bound


def distribution_distance(samples: torch.Tensor, expected: torch.Tensor) -> Distance:
    """Chi-square p-value and TV distance between sampled outcomes (ints in [0, bins)) and `expected`.

    Bins with an expected count below 5 are pooled so the chi-square approximation holds; any sample in a
    bin of expected probability 0 is an impossible outcome and gives p = 0 outright.
    """
    expected = expected.double().flatten()
    expected = expected / expected.sum()
    num_bins = expected.numel()
    n = samples.numel()
    observed = torch.bincount(samples.flatten(), minlength=num_bins).double()
    assert observed.numel() == num_bins, "sample outside the outcome space"
    tv = 0.5 * (observed / n - expected).abs().sum().item()
    bound = tv_bound(n, int((expected > 0).sum()))
    if observed[expected == 0].sum() > 0:
        return Distance(0.0, tv, bound)
    expected_counts = expected * n
    big = expected_counts >= 5
    obs = observed[big].tolist()
    exp = expected_counts[big].tolist()
    small = (expected_counts > 0) & ~big
    if small.any():
        obs.append(observed[small].sum().item())
        exp.append(expected_counts[small].sum().item())
    if len(obs) < 2:
        return Distance(1.0, tv, bound)
    total = sum(obs)
    exp = [e * total / sum(exp) for e in exp]  # guard rounding: scipy wants equal sums
    return Distance(float(stats.chisquare(obs, exp).pvalue), tv, bound)


def assert_matches_target(samples: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    d = distribution_distance(samples, expected)
    assert d.matches, (
        f"{what}: p={d.p_value:.3g} (need > {P_ACCEPT}), TV={d.tv:.4f} (need < {d.tv_bound:.4f})"
    )


def assert_rejects(samples: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    d = distribution_distance(samples, expected)
    assert d.decisively_different, (
        f"{what}: broken verifier not detected: p={d.p_value:.3g} (need < {P_REJECT}), "
        f"TV={d.tv:.4f} (bound {d.tv_bound:.4f})"
    )


# ---------------------------------------------------------------------------------------------------------
# A Markov-chain "language model" and one speculative round over it
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Chain:
    """Distributions of the next token: row V (the last) is the first position, row v follows token v."""

    target: torch.Tensor  # [V+1, V]
    draft_sampling: torch.Tensor  # [V+1, V] what draft tokens are drawn from
    draft_reported: torch.Tensor  # [V+1, V] what the drafter hands to the verifier (normally the same)

    def joint(self, length: int) -> torch.Tensor:
        """Target probability of every token sequence of `length`, flattened in row-major order."""
        joint = self.target[VOCAB]
        for _ in range(1, length):
            last_token = torch.arange(joint.numel()) % VOCAB  # index = prefix_index * V + next
            joint = (joint.unsqueeze(-1) * self.target[last_token]).flatten()
        return joint


def make_chain(
    seed: int,
    target_params: SamplingParams,
    draft_params: SamplingParams | None = None,
    reported_params: SamplingParams | None = None,
) -> Chain:
    """Random target logits; the draft is a noisy copy, so acceptance is partial and both paths run."""
    g = torch.Generator().manual_seed(seed)
    target_logits = 2.0 * torch.randn(VOCAB + 1, VOCAB, generator=g)
    draft_logits = target_logits + 1.5 * torch.randn(VOCAB + 1, VOCAB, generator=g)
    draft_params = draft_params or target_params
    return Chain(
        target=logits_to_probs(target_logits, target_params),
        draft_sampling=logits_to_probs(draft_logits, draft_params),
        draft_reported=logits_to_probs(draft_logits, reported_params or draft_params),
    )


def speculative_sequences(chain: Chain, num_draft: int, length: int, seed: int, verify=rejection_verify,
                          drafter: str = "sampled", pass_probs: bool = True) -> torch.Tensor:
    """Run one draft+verify round on NUM_SAMPLES rows and return the first `length` tokens of each row.

    drafter "sampled" draws from the draft chain; "greedy" takes its argmax (a deterministic drafter).
    """
    g = torch.Generator().manual_seed(seed)
    rows = NUM_SAMPLES
    prev = torch.full((rows,), VOCAB, dtype=torch.long)  # "start of sequence" state
    draft_tokens, draft_probs, target_probs = [], [], []
    for _ in range(num_draft):
        row_probs = chain.draft_sampling[prev]
        token = sample(row_probs, g) if drafter == "sampled" else row_probs.argmax(-1)
        draft_tokens.append(token)
        draft_probs.append(chain.draft_reported[prev])
        target_probs.append(chain.target[prev])
        prev = token
    target_probs.append(chain.target[prev])
    draft_tokens_t = torch.stack(draft_tokens, 1) if num_draft else torch.zeros(rows, 0, dtype=torch.long)
    draft_probs_t = torch.stack(draft_probs, 1) if num_draft else torch.zeros(rows, 0, VOCAB)
    accepted_len, out_tokens = verify(
        draft_tokens_t, draft_probs_t if pass_probs else None, torch.stack(target_probs, 1), g
    )
    emitted = accepted_len + 1
    seq = torch.empty(rows, length, dtype=torch.long)
    prev = torch.full((rows,), VOCAB, dtype=torch.long)
    for j in range(length):  # complete short rows by plain target sampling, as the next rounds would
        fresh = sample(chain.target[prev], g)
        from_round = out_tokens[:, j] if j < out_tokens.shape[1] else fresh
        seq[:, j] = torch.where(j < emitted, from_round, fresh)
        prev = seq[:, j]
    return seq


def sequence_index(seq: torch.Tensor) -> torch.Tensor:
    index = torch.zeros(seq.shape[0], dtype=torch.long)
    for j in range(seq.shape[1]):
        index = index * VOCAB + seq[:, j]
    return index


def check_round(chain: Chain, num_draft: int, seed: int, assertion=assert_matches_target, **kwargs) -> None:
    """First token against the target marginal, first two tokens against the target joint."""
    seq = speculative_sequences(chain, num_draft, length=2, seed=seed, **kwargs)
    assertion(seq[:, 0], chain.joint(1), f"first token, K={num_draft}")
    assertion(sequence_index(seq), chain.joint(2), f"first two tokens, K={num_draft}")


PARAMS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7 top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 3": SamplingParams(top_k=3),
    "min_p 0.1 temperature 1.3": SamplingParams(temperature=1.3, min_p=0.1),
}


# ---------------------------------------------------------------------------------------------------------
# Planted broken verifiers (only here, never in the library)
# ---------------------------------------------------------------------------------------------------------


def verify_resampling_from_target(draft_tokens, draft_probs, target_probs, generator):
    """Bug: after a rejection, draws from target_probs instead of norm(max(0, target - draft)).

    That double-counts the mass the draft already covered, so draft-favoured tokens come out too often.
    """
    batch, num_draft = draft_tokens.shape
    target_tok = target_probs[:, :num_draft].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    draft_tok = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    uniform = torch.rand(batch, num_draft, generator=generator)
    accepted_len = (uniform * draft_tok < target_tok).long().cumprod(-1).sum(-1)
    next_token = sample(target_probs[torch.arange(batch), accepted_len], generator)
    out = torch.cat([draft_tokens, next_token.unsqueeze(-1)], 1)
    out.scatter_(1, accepted_len.unsqueeze(-1), next_token.unsqueeze(-1))
    return accepted_len, out


def verify_ignoring_draft_probs_in_residual(draft_tokens, draft_probs, target_probs, generator):
    """Bug: the right acceptance test, but the residual of a deterministic drafter (target with the draft
    token zeroed) although the draft was sampled; mixing the two rules is not lossless."""
    batch, num_draft = draft_tokens.shape
    rows = torch.arange(batch)
    target_tok = target_probs[:, :num_draft].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    draft_tok = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    uniform = torch.rand(batch, num_draft, generator=generator)
    accepted_len = (uniform * draft_tok < target_tok).long().cumprod(-1).sum(-1)
    rejected_token = draft_tokens[rows, accepted_len.clamp(max=num_draft - 1)]
    zero_it = one_hot_probs(rejected_token, target_probs.shape[-1]) * (accepted_len < num_draft).unsqueeze(-1)
    next_token = sample(target_probs[rows, accepted_len] * (1 - zero_it), generator)
    out = torch.cat([draft_tokens, next_token.unsqueeze(-1)], 1)
    out.scatter_(1, accepted_len.unsqueeze(-1), next_token.unsqueeze(-1))
    return accepted_len, out


# ---------------------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------------------


def logits_with_argmax(argmax_rows: list[list[int]], vocab: int = 6) -> torch.Tensor:
    """Random-looking logits whose argmax is exactly the given token at each position."""
    g = torch.Generator().manual_seed(1)
    argmax = torch.tensor(argmax_rows)
    logits = torch.randn(*argmax.shape, vocab, generator=g)
    return logits.scatter(-1, argmax.unsqueeze(-1), 10.0)


def test_greedy_all_accepted_gives_bonus():
    accepted_len, out = greedy_verify(torch.tensor([[3, 1, 4]]), logits_with_argmax([[3, 1, 4, 5]]))
    assert accepted_len.tolist() == [3]
    assert out[0, :4].tolist() == [3, 1, 4, 5]


def test_greedy_first_rejected_gives_correction():
    accepted_len, out = greedy_verify(torch.tensor([[2, 1, 4]]), logits_with_argmax([[3, 1, 4, 5]]))
    assert accepted_len.tolist() == [0]
    assert out[0, 0].item() == 3


def test_greedy_middle_rejection_stops_the_run():
    # Position 2 would match again, but nothing after the first mismatch may count.
    accepted_len, out = greedy_verify(torch.tensor([[3, 0, 4]]), logits_with_argmax([[3, 1, 4, 5]]))
    assert accepted_len.tolist() == [1]
    assert out[0, :2].tolist() == [3, 1]


def test_greedy_k0_is_plain_greedy_decoding():
    logits = logits_with_argmax([[4], [0]])
    accepted_len, out = greedy_verify(torch.zeros(2, 0, dtype=torch.long), logits)
    assert accepted_len.tolist() == [0, 0]
    assert out.shape == (2, 1)
    assert out[:, 0].tolist() == [4, 0]


def test_greedy_batch_with_different_lengths():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]]
    drafts = torch.tensor([[1, 2, 3], [1, 2, 0], [0, 2, 3], [5, 5, 0]], dtype=torch.int32)
    accepted_len, out = greedy_verify(drafts, logits_with_argmax(target))
    assert accepted_len.tolist() == [3, 2, 0, 2]
    assert accepted_len.dtype == torch.long and out.dtype == torch.long
    emitted = [out[b, : accepted_len[b] + 1].tolist() for b in range(4)]
    assert emitted == [[1, 2, 3, 4], [1, 2, 3], [1], [5, 5, 5]]


def test_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError):
        greedy_verify(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 6))


@pytest.mark.parametrize("vocab", [4099, 4096])  # whole chunks (two-stage) or not (torch's argmax)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_argmax_gives_torchs_indices_ties_and_nan_included(dtype, vocab):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 3, vocab, generator=g).to(dtype)
    logits[0, 0, [7, 900, 4000]] = 50.0  # ties in three chunks: the first one wins
    logits[0, 1, [300, 260]] = 50.0  # and inside a chunk
    logits[1, 1, [3000, 10]] = float("nan")  # NaN counts as the maximum, the first NaN
    logits[2, 2] = float("-inf")
    logits[3, 0, 5] = float("inf")
    logits[4, 2, 4095] = 60.0  # the last entry of the last chunk
    logits[5] = torch.randint(-2, 3, (3, vocab), generator=g).to(dtype)  # ties everywhere
    got = argmax(logits)
    assert got.dtype == torch.long
    assert torch.equal(got, logits.argmax(-1))
    assert got[0, 0] == 7 and got[0, 1] == 260 and got[1, 1] == 10 and got[3, 0] == 5 and got[4, 2] == 4095


@pytest.mark.parametrize("vocab", [4099, 4096])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_topk_indices_give_torchs_values_best_first(vocab, k):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 2, vocab, generator=g).to(torch.bfloat16)
    logits[0, 0, torch.arange(k) * 128] = 40.0 + torch.arange(k).flip(0).to(torch.bfloat16)  # one per chunk
    logits[1, 1, 200:200 + k] = 40.0  # all in one chunk, tied
    logits[2] = torch.randint(-2, 3, (2, vocab), generator=g).to(torch.bfloat16)  # ties everywhere
    got = topk_indices(logits, k)
    assert got.shape == (5, 2, k) and len(set(got[3, 0].tolist())) == k
    assert torch.equal(logits.gather(-1, got), logits.float().topk(k, dim=-1).values.to(logits.dtype))
    assert got[0, 0].tolist() == (torch.arange(k) * 128).tolist()


# ---------------------------------------------------------------------------------------------------------
# Rejection sampling: exactness
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_draft", [1, 2, 3])
@pytest.mark.parametrize("setting", list(PARAMS))
def test_rejection_matches_target(setting, num_draft):
    chain = make_chain(seed=10 + num_draft, target_params=PARAMS[setting])
    check_round(chain, num_draft, seed=100 + num_draft)


def test_rejection_matches_target_when_draft_params_differ():
    # The draft may sample with any distribution at all, as long as it reports it honestly.
    chain = make_chain(seed=3, target_params=SamplingParams(temperature=0.7, top_p=0.9),
                       draft_params=SamplingParams(temperature=1.4, top_k=5))
    check_round(chain, num_draft=3, seed=4)


def test_rejection_k0_samples_the_target():
    chain = make_chain(seed=5, target_params=SamplingParams(temperature=0.8))
    check_round(chain, num_draft=0, seed=6)


def test_rejection_k0_draws_what_sampling_the_target_row_draws():
    """No drafts: each row's token is the `sample` draw from its target row with its own generator (what the
    residual of an all-zero draft gives), consuming nothing else, so later draws stay aligned too."""
    target_probs = random_probs((5, 1, VOCAB), seed=13)
    seeds = [3, 4, 5, 3, 6]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    alone = [torch.Generator().manual_seed(s) for s in seeds]
    for _ in range(20):
        accepted_len, out = rejection_verify(torch.zeros(5, 0, dtype=torch.long), None, target_probs, gens)
        assert accepted_len.tolist() == [0] * 5 and out.shape == (5, 1)
        for b in range(5):
            assert int(out[b, 0]) == int(sample(target_probs[b, 0], alone[b]))


@pytest.mark.parametrize("setting", ["temperature 1", "top_k 3"])
def test_rejection_deterministic_drafter_matches_target(setting):
    chain = make_chain(seed=7, target_params=PARAMS[setting])
    check_round(chain, num_draft=3, seed=8, drafter="greedy", pass_probs=False)


def test_rejection_without_draft_probs_is_still_lossless_for_sampled_drafts():
    # Treating any draft token as one-hot is exact (it only lowers acceptance), so None is always safe.
    chain = make_chain(seed=9, target_params=SamplingParams(temperature=1.0))
    check_round(chain, num_draft=2, seed=10, pass_probs=False)


def test_rejection_full_round_joint_including_bonus():
    # Every emitted token of a K=2 round (accepted, correction and bonus) against the 3-token target joint.
    chain = make_chain(seed=11, target_params=SamplingParams(temperature=1.0, top_p=0.95))
    seq = speculative_sequences(chain, num_draft=2, length=3, seed=12)
    assert_matches_target(sequence_index(seq), chain.joint(3), "three tokens, K=2")


# ---------------------------------------------------------------------------------------------------------
# Rejection sampling: the check has teeth
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_draft", [1, 3])
def test_check_detects_resampling_from_target(num_draft):
    chain = make_chain(seed=10 + num_draft, target_params=SamplingParams(temperature=1.0))
    check_round(chain, num_draft, seed=100 + num_draft, assertion=assert_rejects,
                verify=verify_resampling_from_target)


def test_check_detects_draft_probs_taken_before_top_k():
    # Tokens drawn from the top-k draft, but the verifier is told the unfiltered draft distribution.
    chain = make_chain(seed=13, target_params=SamplingParams(top_k=3),
                       reported_params=SamplingParams(top_k=0))
    check_round(chain, num_draft=2, seed=14, assertion=assert_rejects)


def test_check_detects_one_hot_residual_with_sampled_draft():
    chain = make_chain(seed=15, target_params=SamplingParams(temperature=1.0))
    check_round(chain, num_draft=2, seed=16, assertion=assert_rejects,
                verify=verify_ignoring_draft_probs_in_residual)


# ---------------------------------------------------------------------------------------------------------
# Rejection sampling: acceptance behaviour and edge cases
# ---------------------------------------------------------------------------------------------------------


def random_probs(shape, seed, params=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return logits_to_probs(2.0 * torch.randn(*shape, generator=g), params or SamplingParams())


def test_identical_distributions_accept_everything():
    g = torch.Generator().manual_seed(0)
    target_probs = random_probs((5000, 4, VOCAB), seed=1, params=SamplingParams(top_k=4))
    draft_tokens = sample(target_probs[:, :3], g)
    accepted_len, out = rejection_verify(draft_tokens, target_probs[:, :3].clone(), target_probs, g)
    assert (accepted_len == 3).all()
    assert torch.equal(out[:, :3], draft_tokens)
    assert (target_probs[:, 3].gather(-1, out[:, 3:]) > 0).all()  # the bonus comes from target_probs[K]


def test_disjoint_supports_accept_nothing():
    g = torch.Generator().manual_seed(0)
    target_probs = random_probs((5000, 4, VOCAB), seed=2)
    draft_probs = random_probs((5000, 3, VOCAB), seed=3)
    target_probs[..., :4] = 0.0
    draft_probs[..., 4:] = 0.0
    draft_tokens = sample(draft_probs, g)
    accepted_len, out = rejection_verify(draft_tokens, draft_probs, target_probs, g)
    assert (accepted_len == 0).all()
    assert (out[:, 0] >= 4).all()


def test_partial_acceptance_rate_is_sum_of_min():
    # P(accept the first token) = sum_x min(target(x), draft(x)); 4-sigma band.
    g = torch.Generator().manual_seed(0)
    target_probs = random_probs((1, 2, VOCAB), seed=4).expand(NUM_SAMPLES, 2, VOCAB)
    draft_probs = random_probs((1, 1, VOCAB), seed=5).expand(NUM_SAMPLES, 1, VOCAB)
    accepted_len, _ = rejection_verify(sample(draft_probs, g), draft_probs, target_probs, g)
    expected = torch.minimum(target_probs[0, 0], draft_probs[0, 0]).sum().item()
    sigma = math.sqrt(expected * (1 - expected) / NUM_SAMPLES)
    assert abs(accepted_len.float().mean().item() - expected) < 4 * sigma


def test_greedy_target_through_rejection_equals_greedy_verify():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 5, VOCAB, generator=g)
    argmax = logits.argmax(-1)[:, :4]
    flip = torch.rand(500, 4, generator=g) < 0.3
    draft_tokens = torch.where(flip, (argmax + 1) % VOCAB, argmax)
    want_len, want_out = greedy_verify(draft_tokens, logits)
    target_probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    got_len, got_out = rejection_verify(draft_tokens, None, target_probs, g)
    assert torch.equal(got_len, want_len)
    for b in range(500):
        n = want_len[b].item() + 1
        assert got_out[b, :n].tolist() == want_out[b, :n].tolist()


def test_same_seed_same_output():
    target_probs = random_probs((1000, 4, VOCAB), seed=6)
    draft_probs = random_probs((1000, 3, VOCAB), seed=7)
    draft_tokens = sample(draft_probs, torch.Generator().manual_seed(8))
    runs = [rejection_verify(draft_tokens, draft_probs, target_probs, torch.Generator().manual_seed(s))
            for s in (42, 42, 43)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not (torch.equal(runs[0][0], runs[2][0]) and torch.equal(runs[0][1], runs[2][1]))


def test_one_generator_per_row_draws_what_each_row_draws_alone():
    """Batched verification of seeded requests: row b of one call with a generator per row must equal row b
    verified alone with its generator, so a request's tokens do not depend on what shares its batch."""
    from specdraft.verify.sampling import sample_rows

    target_probs = random_probs((6, 4, VOCAB), seed=9)
    draft_probs = random_probs((6, 3, VOCAB), seed=10)
    draft_tokens = sample(draft_probs, torch.Generator().manual_seed(11))
    seeds = [5, 6, 7, 5, 8, 9]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    got_len, got_out = rejection_verify(draft_tokens, draft_probs, target_probs, gens)
    for b, seed in enumerate(seeds):
        want_len, want_out = rejection_verify(draft_tokens[b:b + 1], draft_probs[b:b + 1], target_probs[b:b + 1],
                                              torch.Generator().manual_seed(seed))
        assert got_len[b] == want_len[0] and torch.equal(got_out[b], want_out[0])
    with pytest.raises(ValueError, match="generators"):
        rejection_verify(draft_tokens, draft_probs, target_probs, gens[:2])

    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(12))
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7)]
    tokens, dists = sample_rows(logits, params, [torch.Generator().manual_seed(s) for s in range(5)])
    for b, p in enumerate(params):
        if p.greedy:
            assert tokens[b] == int(logits[b].argmax()) and dists[b] is None
            continue
        alone = logits_to_probs(logits[b], p)
        assert torch.equal(dists[b], alone)
        assert tokens[b] == int(sample(alone, torch.Generator().manual_seed(b)))


def test_degenerate_residual_falls_back_to_target():
    # target <= draft everywhere (unnormalised inputs): rejections happen but max(0, target - draft) is 0.
    # Without the fallback, sampling from an all-zero row returns token 0, which the target forbids.
    rows = 2000
    target_probs = torch.tensor([0.0, 0.2, 0.2, 0.0]).expand(rows, 2, 4)
    draft_probs = torch.tensor([0.0, 0.5, 0.5, 0.0]).expand(rows, 1, 4)
    g = torch.Generator().manual_seed(0)
    draft_tokens = sample(draft_probs, g)
    accepted_len, out = rejection_verify(draft_tokens, draft_probs, target_probs, g)
    assert (accepted_len == 0).any()
    assert (target_probs[:, 0].gather(-1, out[:, :1]) > 0).all()


def test_draft_token_outside_target_vocab_is_rejected():
    target_probs = random_probs((100, 2, VOCAB), seed=9)
    draft_probs = pad_vocab(one_hot_probs(torch.full((100, 1), VOCAB + 2), VOCAB + 4), VOCAB)
    assert draft_probs.shape == (100, 1, VOCAB) and draft_probs.sum() == 0
    accepted_len, out = rejection_verify(torch.full((100, 1), VOCAB + 2), draft_probs, target_probs,
                                         torch.Generator().manual_seed(0))
    assert (accepted_len == 0).all()
    assert (out[:, 0] < VOCAB).all()


def test_pad_vocab_and_one_hot():
    probs = torch.tensor([[0.25, 0.75]])
    assert pad_vocab(probs, 4).tolist() == [[0.25, 0.75, 0.0, 0.0]]
    assert pad_vocab(probs, 1).tolist() == [[0.25]]
    assert pad_vocab(probs, 2) is probs
    assert one_hot_probs(torch.tensor([1, 5]), 3).tolist() == [[0, 1, 0], [0, 0, 0]]


def test_rejection_rejects_mismatched_vocab():
    with pytest.raises(ValueError, match="pad_vocab"):
        rejection_verify(torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1, 6), 1 / 6),
                         torch.full((2, 2, 8), 1 / 8), None)


def test_verify_batch_greedy_rows_read_a_given_argmax_as_the_logits_argmax():
    """Greedy chains and trees beside a sampled row: the same answer from the logits as from their argmax
    (what the engine hands over from the runtime's kernel), and a planted wrong argmax changes it."""
    from specdraft.verify.batch import verify_batch

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 50, generator=g)
    best = logits.argmax(-1)
    other = (best + 1) % 50  # never the argmax
    drafts = [best[0, :3].tolist(), best[1, :2].tolist() + [other[1, 2].item()], [],
              [other[3, 0].item(), best[3, 0].item(), best[3, 2].item()]]
    parents = [None, None, None, [ROOT, ROOT, 0]]  # row 3: the second child of the root matches, and ends
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0)]
    gens = [None, None, torch.Generator().manual_seed(1), None]
    plain = verify_batch(drafts, [None] * 4, logits, params, gens, parents)
    gens[2] = torch.Generator().manual_seed(1)
    given = verify_batch(drafts, [None] * 4, logits, params, gens, parents, target_argmax=best)
    assert given == plain
    assert plain[0][0] == [0, 1, 2] and plain[1][0] == best[0, :4].tolist()
    assert plain[0][1] == [0, 1] and plain[1][1] == best[1, :3].tolist()
    assert plain[0][3] == [1] and plain[1][3] == [best[3, 0].item(), best[3, 2].item()]
    wrong = best.clone()
    wrong[0, 1] = (wrong[0, 1] + 1) % 50
    gens[2] = torch.Generator().manual_seed(1)
    assert verify_batch(drafts, [None] * 4, logits, params, gens, parents, target_argmax=wrong)[0][0] == [0]
    with pytest.raises(ValueError, match="does not cover"):
        verify_batch(drafts, [None] * 4, logits, params, gens, parents, target_argmax=best[:, :2])
