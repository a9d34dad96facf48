"""Logit bias and the repetition, frequency and presence penalties, as vLLM and OpenAI apply them, on a
verification block.

A logit bias adds the same to a token's logit at every position. A penalty makes the target's distribution
at a position depend on the tokens generated before it. In a verification block those include the draft
tokens before the row: row 0 (the pending token's) follows the request's generated tokens, the row of draft
node i follows them and node i's path from the root (itself and its ancestors; in a chain, the drafts up to
i). Each row is penalized with its own counts, so every row is the distribution plain decoding would sample
from had it reached that node: the verifiers stay lossless unchanged. Order and meaning are vLLM's: the
logit bias first, then the penalties (`apply_penalties`): the repetition penalty (HF's: a logit of a token
seen in the prompt or the output divided by it where positive, multiplied where not), then the frequency
penalty (times the token's count in the output) and the presence penalty (once if it occurs there)
subtracted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
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


def penalize_rows_(logits: torch.Tensor, prompt: Sequence[int], generated: Sequence[int],
                   row_tokens: Sequence[Sequence[int]], repetition: float = 1.0, frequency: float = 0.0,
                   presence: float = 0.0, bias: Mapping[int, float] | None = None) -> None:
    """Apply `bias` ({token id: added to its logit}) and the penalties to fp32 `logits` [R, V] in place
    (in that order, vLLM's): row r follows `generated` and then `row_tokens[r]` (the draft tokens before it,
    see `node_paths`); the repetition penalty also counts the `prompt`'s tokens. Only the columns of tokens
    that occur are read and written (a few hundred of tens of thousands), in NumPy on a view of the tensor:
    a dozen small operations each round, where torch's own overhead per call (5-50 us just after a forward)
    came to 0.3 ms a decoded token."""
    if logits.dim() != 2 or logits.shape[0] != len(row_tokens) or logits.dtype != torch.float32:
        raise ValueError(f"logits {tuple(logits.shape)} {logits.dtype} for {len(row_tokens)} rows: want fp32, one "
                         "row each")
    if logits.device.type != "cpu":  # a GPU's rows: adjusted on the CPU and copied back
        rows = logits.cpu()
        penalize_rows_(rows, prompt, generated, row_tokens, repetition, frequency, presence, bias)
        logits.copy_(rows)
        return
    rows = logits.numpy()  # a view: writing it writes the tensor
    if bias:
        biased = np.fromiter(bias, dtype=np.int64, count=len(bias))
        rows[:, biased] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
    drafted = [token for tokens in row_tokens for token in tokens]
    in_prompt = prompt if repetition != 1.0 else ()
    if not (generated or drafted or in_prompt) or (repetition == 1.0 and frequency == 0.0 and presence == 0.0):
        return
    n_generated, n_drafted = len(generated), len(drafted)
    columns, column_of = np.unique(np.array([*generated, *drafted, *in_prompt], dtype=np.int64),
                                   return_inverse=True)
    # counts[r, j]: occurrences of token columns[j] in the output before row r's prediction.
    counts = np.repeat(np.bincount(column_of[:n_generated], minlength=len(columns))[None].astype(np.float32),
                       len(row_tokens), axis=0)
    if drafted:
        row_of = [r for r, tokens in enumerate(row_tokens) for _ in tokens]
        np.add.at(counts, (row_of, column_of[n_generated:n_generated + n_drafted]), 1.0)
    picked = rows[:, columns]
    if repetition != 1.0:
        seen = counts > 0
        seen[:, column_of[n_generated + n_drafted:]] = True
        picked = np.where(seen, np.where(picked > 0, picked / np.float32(repetition),
                                         picked * np.float32(repetition)), picked)
    if frequency != 0.0:
        picked -= np.float32(frequency) * counts
    if presence != 0.0:
        picked -= np.float32(presence) * (counts > 0)
    rows[:, columns] = picked
