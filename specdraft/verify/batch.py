"""Verification of a batch of requests in one call: ragged drafts (chains or trees), per-row sampling
parameters and per-row random generators (as vLLM's sampling metadata carries them).

A request's randomness comes only from its own generator, drawn in the same order whatever else shares the
batch, so a seeded request gives the same tokens alone or beside others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.verify.greedy import argmax, common_prefix
from specdraft.verify.rejection import pad_vocab, rejection_verify
from specdraft.verify.sampling import SamplingParams, logits_to_probs, sampling_key
from specdraft.verify.tree import greedy_tree_walk, tree_rejection_verify


def verify_batch(
    draft_tokens: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    target_logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    parents: Sequence[Sequence[int] | None] | None = None,
    target_argmax: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """Verify each row's draft (a chain, or a tree given its `parents`) against the target.

    draft_tokens[b]: row b's k_b draft tokens (k_b may differ per row, 0 included); draft_probs[b]: [k_b,
    vocab] distributions they were sampled from, or None for a deterministic drafter; target_logits
    [B, T, V] with T >= 1 + max k_b: row b's logits for its pending token and its drafts (later rows are
    padding and are never read). parents[b]: the parent of each node of a tree (see verify/tree.py), or
    None for a chain. Greedy rows (temperature 0) accept while equal to the argmax; sampled rows use
    Leviathan/Chen rejection sampling (a tree: its multi-candidate form) with their own params and
    generator. target_argmax [B, T']: target_logits.argmax(-1) (T' >= 1 + max k_b of the greedy rows), where
    the caller has it cheaper (the runtime's one-call kernel): greedy rows then read nothing else.

    Returns (accepted draft indices per row, root first: a chain's are 0..n-1; tokens to emit per row: the
    accepted drafts, then the target's correction or bonus token).
    """
    batch = target_logits.shape[0]
    if not len(draft_tokens) == len(draft_probs) == len(params) == len(generators) == batch:
        raise ValueError(f"verify_batch: {batch} logit rows but {len(draft_tokens)} drafts, {len(draft_probs)} "
                         f"draft distributions, {len(params)} params and {len(generators)} generators")
    lengths = [len(d) for d in draft_tokens]
    if max(lengths, default=0) + 1 > target_logits.shape[1]:
        raise ValueError(f"target_logits has {target_logits.shape[1]} positions; a draft of {max(lengths)} "
                         "needs one more")
    parents = list(parents) if parents is not None else [None] * batch
    accepted: list[list[int]] = [[] for _ in range(batch)]
    emitted: list[list[int]] = [[] for _ in range(batch)]

    trees = {b for b in range(batch) if parents[b] is not None and _is_tree(parents[b])}
    greedy_rows = [b for b in range(batch) if params[b].greedy]
    if greedy_rows:
        # Greedy rows need only the target's argmax at each position: one reduction for all of them, then
        # a walk over a few Python ints per row.
        width = 1 + max(lengths[b] for b in greedy_rows)
        if target_argmax is None:
            rows = target_logits[:, :width] if len(greedy_rows) == batch else target_logits[greedy_rows, :width]
            best = dict(zip(greedy_rows, argmax(rows).tolist()))
        else:
            if target_argmax.shape[0] != batch or target_argmax.shape[1] < width:
                raise ValueError(f"target_argmax {tuple(target_argmax.shape)} does not cover {batch} rows of "
                                 f"{width} positions")
            every = target_argmax.tolist()
            best = {b: every[b] for b in greedy_rows}
        for b in greedy_rows:
            if b in trees:
                accepted[b], emitted[b] = greedy_tree_walk(draft_tokens[b], parents[b], best[b])
            else:
                n = common_prefix(draft_tokens[b], best[b])  # the drafts that equal the argmax
                accepted[b], emitted[b] = list(range(n)), best[b][:n + 1]
    for b in sorted(trees.difference(greedy_rows)):  # sampled trees
        rows = target_logits[b, :lengths[b] + 1]
        target_probs = logits_to_probs(rows, params[b])
        probs = draft_probs[b]
        if probs is not None:
            probs = pad_vocab(probs, target_probs.shape[-1])
        accepted[b], emitted[b] = tree_rejection_verify(draft_tokens[b], parents[b], probs, target_probs,
                                                        generators[b])
    chains = [b for b in range(batch) if b not in trees]

    # Sampled chains, verified together where they share a draft length, sampling filters and kind of
    # draft: one vectorized call per group, each row drawing from its own generator as it would alone.
    groups: dict[tuple, list[int]] = {}
    for b in chains:
        if not params[b].greedy:
            key = (lengths[b], draft_probs[b] is None or not lengths[b], *sampling_key(params[b]))
            groups.setdefault(key, []).append(b)
    for (k, deterministic, *_), rows in groups.items():
        target_probs = logits_to_probs(target_logits[rows, :k + 1], params[rows[0]])
        probs = None
        if not deterministic:
            probs = torch.stack([pad_vocab(draft_probs[b][:k], target_probs.shape[-1]) for b in rows])
        tokens = torch.tensor([list(draft_tokens[b]) for b in rows], dtype=torch.long).reshape(len(rows), k)
        run, out = rejection_verify(tokens, probs, target_probs, [generators[b] for b in rows])
        for i, b in enumerate(rows):
            n = int(run[i])
            accepted[b], emitted[b] = list(range(n)), out[i, :n + 1].tolist()
    return accepted, emitted


def _is_tree(parents: Sequence[int]) -> bool:
    return any(p != i - 1 for i, p in enumerate(parents))
