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

from specdraft.verify.greedy import topk_indices

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit, vLLM's default max_logprobs)
# Rows are scored a few at a time, their fp32 copy and log-softmax (8 bytes a logit) within about this many
# bytes (a core's L2 cache), not a prompt's hundreds of rows at once (hundreds of MB through memory). SmolLM2's
# rows go two at a time: 100-125 us a row, against 285-335 for 200 rows at once and 175-190 alone
# (docs/bench/amd-zen4/stop52/ab/logprob-blocks.txt); Gemma 3's vocabulary goes one at a time.
BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted position: the token chosen, its log-probability and rank (1: the most likely token), and
    the `top` most likely tokens as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()

    def ranked(self) -> list[tuple[int, float, int]]:
        """(token id, log-probability, rank) of the token chosen, then of the `top` ones not already listed:
        the order vLLM and OpenAI give a position's alternatives in."""
        out = [(self.token_id, self.logprob, self.rank)]
        out += [(token, logprob, rank) for rank, (token, logprob) in enumerate(self.top, start=1)
                if token != self.token_id]
        return out


def position_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """`logits` [n, V]: row i the target's logits that `tokens[i]` was chosen from; `top` alternatives each
    (0: only the chosen token's own)."""
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(tokens)} tokens: want one row per token")
    if not 0 <= top <= MAX_LOGPROBS:
        raise ValueError(f"top must be in [0, {MAX_LOGPROBS}], got {top}")
    rows = max(1, BLOCK_BYTES // (8 * logits.shape[-1]))
    out: list[TokenLogprobs] = []
    for start in range(0, len(tokens), rows):
        out += _block_logprobs(logits[start:start + rows], tokens[start:start + rows], top)
    return out


def _block_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    if top:
        ids = topk_indices(logprobs, top)
        alternatives = [tuple(zip(row_ids, row_values, strict=True))
                        for row_ids, row_values in zip(ids.tolist(), logprobs.gather(-1, ids).tolist(), strict=True)]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprobs(token, logprob, rank, alts)
            for token, logprob, rank, alts in zip(tokens, chosen.tolist(), ranks.tolist(), alternatives, strict=True)]
