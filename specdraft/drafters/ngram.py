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

from specdraft.drafters.base import DraftRequest, Proposal, Verified


class NgramIndex:
    """One request's incremental index: for each n, n-gram -> end position of its latest occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.reset()

    def reset(self) -> None:
        # A private int copy of the context, so lookups and slicing do not depend on what kind of sequence
        # (list, tuple, tensor) the engine hands in.
        self.tokens: list[int] = []
        # An n-gram ending at position j is indexed only once position j + 1 exists, so every entry has a
        # continuation and the current suffix can never be found as its own match.
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.indexed_upto = 0  # every n-gram ending before this position is in the index

    def sync(self, context: Sequence[int]) -> None:
        """Bring the copy and the index up to `context`, touching only tokens not seen before.

        A request's context only ever grows; a shorter one breaks that promise, so the index is rebuilt
        rather than silently corrupted."""
        if len(context) < len(self.tokens):
            self.reset()
        tokens = self.tokens
        for i in range(len(tokens), len(context)):
            tokens.append(int(context[i]))
        # Index n-grams ending at j for every j that now has a continuation (j <= len - 2).
        for j in range(self.indexed_upto, len(tokens) - 1):
            for n, table in self.tables.items():
                if j + 1 >= n:
                    table[tuple(tokens[j + 1 - n : j + 1])] = j
        self.indexed_upto = max(self.indexed_upto, len(tokens) - 1)

    def lookup(self, max_k: int) -> list[int]:
        """The continuation of the latest earlier occurrence of the longest indexed suffix (n from max down)."""
        tokens, length = self.tokens, len(self.tokens)
        for n in sorted(self.tables, reverse=True):
            if n > length:
                continue
            end = self.tables[n].get(tuple(tokens[length - n:]))
            if end is not None:
                # The continuation may run into the suffix itself (periodic text); stop at the end of the
                # context rather than guess beyond it.
                return tokens[end + 1 : min(end + 1 + max_k, length)]
        return []


class NgramDrafter:
    """Proposes the continuation of the most recent earlier occurrence of the longest matching suffix.

    Longer n-grams are tried first because a longer shared history is stronger evidence that the same
    continuation follows; among occurrences of one n-gram the most recent wins because nearby text is the
    best predictor of what comes next. One index per request.
    """

    hidden_layers: tuple[int, ...] = ()

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
        self._indexes: dict[int, NgramIndex] = {}

    def add_request(self, request: DraftRequest) -> None:
        """Sampling params and the generator are irrelevant: lookup never samples."""
        index = self._indexes[request.request_id] = NgramIndex(self.min_n, self.max_n)
        index.sync(request.prompt_ids)

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]],
                max_ks: Sequence[int]) -> list[Proposal]:
        proposals = []
        for request_id, context, max_k in zip(request_ids, contexts, max_ks):
            index = self._indexes[request_id]
            index.sync(context)
            proposals.append(Proposal(index.lookup(max_k) if max_k > 0 else []))
        return proposals

    def observe(self, request_id: int, verified: Verified) -> None:
        """Indexing here keeps `propose` cheap; the new context says it all."""
        self._indexes[request_id].sync(verified.context)

    def remove_request(self, request_id: int) -> None:
        self._indexes.pop(request_id, None)
