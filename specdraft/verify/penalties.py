"""Repetition, frequency and presence penalties, as vLLM and OpenAI apply them, on a verification block.

A penalty makes the target's distribution at a position depend on the tokens generated before it. In a
verification block those include the draft tokens before the row: row 0 (the pending token's) follows the
request's generated tokens, the row of draft node i follows them and node i's path from the root (itself and
its ancestors; in a chain, the drafts up to i). Each row is penalized with its own counts, so every row is
the distribution plain decoding would sample from had it reached that node: the verifiers stay lossless
unchanged. Order and meaning are vLLM's (`apply_penalties`): the repetition penalty first (HF's: a logit of a
token seen in the prompt or the output divided by it where positive, multiplied where not), then the
frequency penalty (times the token's count in the output) and the presence penalty (once if it occurs there)
subtracted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.verify.tree import ROOT


def node_paths(parents: Sequence[int]) -> list[list[int]]:
    """For each row of a verification block over a draft tree (row 0: the pending token, row 1 + i: node i),
    the node indices generated before the token that row predicts: [] for row 0, node i's ancestors from
    the root then i itself for row 1 + i."""
    paths: list[list[int]] = [[]]
    for i, parent in enumerate(parents):
        paths.append([*(paths[1 + parent] if parent != ROOT else []), i])
    return paths


def penalize_rows(logits: torch.Tensor, prompt: Sequence[int], generated: Sequence[int],
                  row_tokens: Sequence[Sequence[int]], repetition: float = 1.0, frequency: float = 0.0,
                  presence: float = 0.0) -> torch.Tensor:
    """`logits` [R, V] with penalties applied (a new fp32 tensor): row r follows `generated` and then
    `row_tokens[r]` (the draft tokens before it, see `node_paths`); the repetition penalty also counts the
    `prompt`'s tokens. Nothing to do (every penalty neutral) returns the logits as they are."""
    if logits.dim() != 2 or logits.shape[0] != len(row_tokens):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(row_tokens)} rows: want one row each")
    if repetition == 1.0 and frequency == 0.0 and presence == 0.0:
        return logits
    rows, vocab = logits.shape
    counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab)[:vocab]
    counts = counts.to(torch.float32).expand(rows, vocab).clone()
    extra = [(r, token) for r, tokens in enumerate(row_tokens) for token in tokens]
    if extra:
        at = torch.tensor(extra, dtype=torch.long)
        counts.index_put_((at[:, 0], at[:, 1]), torch.ones(len(extra)), accumulate=True)
    out = logits.to(torch.float32, copy=True)
    if repetition != 1.0:
        seen = counts > 0
        if prompt:
            seen[:, torch.tensor(list(prompt), dtype=torch.long)] = True
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    if frequency != 0.0:
        out -= frequency * counts
    if presence != 0.0:
        out -= presence * (counts > 0).float()
    return out
