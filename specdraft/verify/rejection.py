"""Speculative (rejection) sampling verification, after Leviathan et al. 2023 and Chen et al. 2023.

Draft token x_i, sampled from `draft_probs[i]`, is accepted with probability
min(1, target_probs[i](x_i) / draft_probs[i](x_i)); at the first rejection the replacement is drawn from
norm(max(0, target_probs[i] - draft_probs[i])), and if all K survive a bonus token is drawn from
`target_probs[K]`. Every emitted token is then distributed exactly as if sampled from the target alone,
which is the whole point: speculation may only change speed, never the output distribution.

Both distributions must be the *final* ones (after temperature/top-k/top-p/min-p, from `logits_to_probs`)
and over the same vocabulary. Draft and target checkpoints often pad their vocabularies to different sizes;
the caller brings `draft_probs` to the target's vocab with `pad_vocab` first. Draft tokens that fall outside
the target's vocab are legal input and are always rejected (the target gives them probability 0).
"""

from __future__ import annotations

import torch

from specdraft.verify.sampling import Generators, sample, uniforms


def one_hot_probs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The distribution of a deterministic drafter: all mass on the proposed token.

    Tokens outside `[0, vocab)` give an all-zero row: their mass lies outside this vocabulary.
    """
    tokens = tokens.long()
    in_range = (tokens >= 0) & (tokens < vocab)
    rows = torch.nn.functional.one_hot(tokens.clamp(0, vocab - 1), vocab).float()
    return rows * in_range.unsqueeze(-1)


def pad_vocab(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Zero-pad or truncate the last dim to `vocab`.

    Padding is exact (padded ids have probability 0 anyway). Truncating drops draft mass on ids the target
    does not have; that is still lossless, because those ids can only be proposed and then rejected, and
    max(0, target - draft) is 0 there regardless.
    """
    current = probs.shape[-1]
    if current == vocab:
        return probs
    if current > vocab:
        return probs[..., :vocab]
    return torch.nn.functional.pad(probs, (0, vocab - current))


def rejection_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: Generators = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify K sampled draft tokens per row; lossless with respect to `target_probs`.

    `draft_tokens` [B, K]; `draft_probs` [B, K, V] (the exact distributions the tokens were drawn from) or
    None for a deterministic drafter (n-gram lookup, greedy drafting), which is treated as one-hot on its
    token. None is always safe, just accepts less often than the true draft distribution would.
    `target_probs` [B, K+1, V]: row i is the target's distribution for the position of draft token i, row K
    the one after the last draft token.

    Returns `(accepted_len [B], out_tokens [B, K+1])` (int64); the caller emits
    `out_tokens[b, :accepted_len[b] + 1]`, later entries are padding. All randomness comes from `generator`
    (one uniform per draft token, then one `sample` call), so a seeded generator reproduces the result; with one
    generator per row (a sequence of B), each row draws from its own exactly what it draws verified alone.
    No host sync.
    """
    if draft_tokens.dim() != 2 or target_probs.dim() != 3:
        raise ValueError(
            f"expected draft_tokens [B, K] and target_probs [B, K+1, V], got {tuple(draft_tokens.shape)} "
            f"and {tuple(target_probs.shape)}"
        )
    batch, num_draft = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape[0] != batch or target_probs.shape[1] != num_draft + 1:
        raise ValueError(
            f"target_probs must be [B, K+1, V] = [{batch}, {num_draft + 1}, V], "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, num_draft, vocab):
        raise ValueError(
            f"draft_probs must be [B, K, V] = [{batch}, {num_draft}, {vocab}] (the target's vocab; see "
            f"pad_vocab), got {tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    draft_tokens = draft_tokens.to(device, torch.long)
    if num_draft == 0:
        # Nothing to verify: the next token is a draw from the target row, the residual below with an all-zero
        # draft (the same values, so the same draw), without its four passes over the vocabulary (a plain
        # round of sampled rows: distillation's batches, plain sampling beside speculation).
        next_token = sample(target_probs[:, 0].float(), generator=generator)
        return draft_tokens.new_zeros(batch), next_token.unsqueeze(-1)
    rows = torch.arange(batch, device=device)

    # Draft ids beyond the target vocab get target probability 0 through the mask, not an index error.
    in_range = (draft_tokens >= 0) & (draft_tokens < vocab)
    safe_tokens = draft_tokens.clamp(0, vocab - 1).unsqueeze(-1)
    target_tok = target_probs[:, :num_draft].gather(-1, safe_tokens).squeeze(-1).float() * in_range
    if draft_probs is None:
        draft_tok = torch.ones_like(target_tok)
    else:
        draft_tok = draft_probs.to(device).gather(-1, safe_tokens).squeeze(-1).float()

    # u < target/draft written without the division: no 0/0 for tokens the draft could not have produced,
    # and target == draft accepts with certainty since u < 1.
    uniform = uniforms((batch, num_draft), generator, device=device)
    accepted = uniform * draft_tok < target_tok
    accepted_len = accepted.long().cumprod(-1).sum(-1)  # leading run of acceptances

    # The row to draw the next token from: the residual at the first rejection, or target[K] for the bonus.
    # Both are max(0, target - draft) with draft taken as all-zero at position K.
    target_row = target_probs[rows, accepted_len].float()  # [B, V]
    if num_draft == 0:
        draft_row = torch.zeros_like(target_row)
    else:
        position = accepted_len.clamp(max=num_draft - 1)
        not_bonus = (accepted_len < num_draft).unsqueeze(-1)
        if draft_probs is None:
            draft_row = one_hot_probs(draft_tokens[rows, position], vocab)
        else:
            draft_row = draft_probs.to(device)[rows, position].float()
        draft_row = draft_row * not_bonus
    residual = (target_row - draft_row).clamp_min(0.0)
    # A rejection with an all-zero residual means target <= draft everywhere, i.e. they are equal up to
    # rounding and the rejection itself was a rounding artefact; the target row is then the right law.
    # (No renormalisation needed: `sample` is invariant to the scale of its input.)
    degenerate = residual.sum(-1, keepdim=True) <= 0.0
    residual = torch.where(degenerate, target_row, residual)
    next_token = sample(residual, generator=generator)

    out_tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)
    out_tokens.scatter_(1, accepted_len.unsqueeze(-1), next_token.unsqueeze(-1))
    return accepted_len, out_tokens
