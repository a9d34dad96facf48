"""Log-probabilities of emitted tokens, as OpenAI's and vLLM's `logprobs` report them.

They are the target's own distribution at each emitted position, before temperature and the top-k, top-p and
min-p filters (vLLM's default, "raw" logprobs): what the model thinks of the token, whatever way it was
chosen. A token accepted from a draft is scored by the target row that verified it, so speculation reports
what plain decoding reports: with the fused kernels' row invariance, the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit, vLLM's default max_logprobs)


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted position: the token chosen, its log-probability and rank (1: the most likely token), and
    the `top` most likely tokens as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def position_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """`logits` [n, V]: row i the target's logits that `tokens[i]` was chosen from; `top` alternatives each
    (0: only the chosen token's own)."""
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(tokens)} tokens: want one row per token")
    if not 0 <= top <= MAX_LOGPROBS:
        raise ValueError(f"top must be in [0, {MAX_LOGPROBS}], got {top}")
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    if top:
        values, ids = torch.topk(logprobs, top, dim=-1)
        alternatives = [tuple(zip(row_ids, row_values, strict=True))
                        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprobs(token, logprob, rank, alts)
            for token, logprob, rank, alts in zip(tokens, chosen.tolist(), ranks.tolist(), alternatives, strict=True)]
