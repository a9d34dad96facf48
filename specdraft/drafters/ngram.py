"""Prompt lookup decoding: draft by copying what followed the last time the current suffix appeared.

Outputs that quote, edit or summarise their prompt repeat long spans of it, so a free, model-less drafter
that copies those spans gets many tokens accepted. The drafter is deterministic (`draft_probs=None`), so
verification treats its tokens as one-hot drafts and stays lossless whatever it proposes.

The index is incremental because `propose` runs once per decoding step: rescanning the whole context each
time would make a request quadratic in its length. The context only grows within a request, so only its new
tail ever needs indexing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.drafters.base import Proposal
from specdraft.verify.sampling import SamplingParams


class NgramDrafter:
    """Proposes the continuation of the most recent earlier occurrence of the longest matching suffix.

    Longer n-grams are tried first because a longer shared history is stronger evidence that the same
    continuation follows; among occurrences of one n-gram the most recent wins because nearby text is the
    best predictor of what comes next.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1, name: str = "ngram") -> None:
        for label, value in (("max_n", max_n), ("min_n", min_n)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"NgramDrafter: {label} must be an integer, got {value!r}")
        if min_n < 1:
            raise ValueError(f"NgramDrafter: min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"NgramDrafter: max_n must be >= min_n, got max_n={max_n}, min_n={min_n}")
        self.name = name
        self.max_n = max_n
        self.min_n = min_n
        self._reset()

    def _reset(self) -> None:
        # A private int copy of the context, so lookups and slicing do not depend on what kind of sequence
        # (list, tuple, tensor) the engine hands in.
        self._tokens: list[int] = []
        # For each n: n-gram -> end position (inclusive) of its latest indexed occurrence. An n-gram ending
        # at position j is indexed only once position j + 1 exists, so every entry has a continuation and the
        # current suffix can never be found as its own match.
        ns = range(self.min_n, self.max_n + 1)
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ns}
        # Every n-gram ending before this position is in the index.
        self._indexed_upto = 0

    def start(
        self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator | None,
        target_cache: object | None = None,
    ) -> None:
        """Sampling params and the generator are irrelevant: lookup never samples."""
        self._reset()
        self._sync(prompt_ids)

    def propose(self, context: Sequence[int], max_k: int) -> Proposal:
        if max_k <= 0:
            return Proposal([])
        self._sync(context)
        tokens = self._tokens
        length = len(tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > length:
                continue
            end = self._index[n].get(tuple(tokens[length - n:]))
            if end is not None:
                # The continuation may run into the suffix itself (periodic text); stop at the end of the
                # context rather than guess beyond it.
                return Proposal(tokens[end + 1 : min(end + 1 + max_k, length)])
        return Proposal([])

    def accepted(self, num_accepted: int, context: Sequence[int]) -> None:
        """Indexing here keeps `propose` cheap; `num_accepted` is not needed since `context` says it all."""
        self._sync(context)

    def _sync(self, context: Sequence[int]) -> None:
        """Bring the copy and the index up to `context`, touching only tokens not seen before.

        The context is trusted to extend the previous one (the protocol guarantees it); a shorter one can
        only mean a new request that skipped `start`, so the state is rebuilt instead of silently corrupted.
        """
        if len(context) < len(self._tokens):
            self._reset()
        tokens = self._tokens
        for i in range(len(tokens), len(context)):
            tokens.append(int(context[i]))
        # Index n-grams ending at j for every j that now has a continuation (j <= len - 2).
        for j in range(self._indexed_upto, len(tokens) - 1):
            for n, table in self._index.items():
                if j + 1 >= n:
                    table[tuple(tokens[j + 1 - n : j + 1])] = j
        self._indexed_upto = max(self._indexed_upto, len(tokens) - 1)
