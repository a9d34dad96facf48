"""Suffix-cache drafting (after SuffixDecoding, Oliaro et al. 2024): prompt lookup over the request's own
context *and* over the text of earlier requests.

Real traffic repeats itself across requests: agents re-send tool schemas and earlier turns, RAG pipelines
quote the same documents, a task template is filled with new inputs again and again, and a model answers
similar questions in similar words. `ngram` only sees the current request; `suffix` also looks the current
suffix up in a `SuffixCache` of finished requests (prompt + output), shared by every request of one engine
(so of one `LLM` and of one server), bounded in tokens and evicting the oldest requests first.

Like `ngram` it is deterministic (`draft_probs=None`), so verification treats its tokens as one-hot drafts
and stays lossless whatever the cache holds. Candidates from both sources are weighed the same way
(`NgramIndex.MATCH_BASE ** n` for a match of n tokens, decayed by recency rank): the best one is the chain, and
given a node budget beyond the depth the others branch off it as a tree (`tree_from_continuations`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from specdraft.drafters.base import Proposal
from specdraft.drafters.ngram import NgramDrafter, NgramIndex, tree_from_continuations

# Ends each cached request in the cache's token stream: no real token equals it, so no n-gram match spans two
# requests and a continuation stops at its request's end.
SEPARATOR = -1


class SuffixCache:
    """A bounded index of earlier requests' tokens, safe to share between threads.

    The requests are concatenated (each followed by SEPARATOR) into one `NgramIndex` over n-grams of
    `min_n..max_n` tokens. When the stream exceeds `max_tokens`, the oldest requests are dropped until a
    quarter of the budget is free and the index is rebuilt from the rest: O(max_tokens) work once per
    max_tokens / 4 tokens added, rather than per request. A request longer than the whole budget keeps its
    tail. Memory: about (max_n - min_n + 1) dictionary entries per cached token (~25 MB at the defaults).
    """

    def __init__(self, max_tokens: int = 32768, min_n: int = 2, max_n: int = 6, max_occurrences: int = 8) -> None:
        for label, value in (("max_tokens", max_tokens), ("min_n", min_n), ("max_n", max_n),
                             ("max_occurrences", max_occurrences)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SuffixCache: {label} must be a positive integer, got {value!r}")
        if max_n < min_n:
            raise ValueError(f"SuffixCache: max_n must be >= min_n, got max_n={max_n}, min_n={min_n}")
        if max_tokens <= max_n:
            raise ValueError(f"SuffixCache: max_tokens must exceed max_n ({max_n}), got {max_tokens}")
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._requests: deque[list[int]] = deque()
        self._index = NgramIndex(min_n, max_n, max_occurrences)

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream (separators included); never above `max_tokens`."""
        return len(self._index.tokens)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add(self, tokens: Sequence[int]) -> None:
        """Cache one finished request's tokens (its prompt and output)."""
        tokens = [int(t) for t in tokens][-(self.max_tokens - 1):]
        if len(tokens) <= self._index.min_n:
            return  # no n-gram with a continuation
        with self._lock:
            self._requests.append(tokens)
            if len(self._index.tokens) + len(tokens) + 1 <= self.max_tokens:
                self._index.extend([*tokens, SEPARATOR])
                return
            total = sum(len(r) + 1 for r in self._requests)
            while total > self.max_tokens * 3 // 4 and len(self._requests) > 1:
                total -= len(self._requests.popleft()) + 1
            self._rebuild()

    def _rebuild(self) -> None:
        """Index exactly the cached requests (the caller holds the lock)."""
        self._index.reset()
        self._index.extend([t for r in self._requests for t in (*r, SEPARATOR)])

    def snapshot(self) -> tuple[tuple[int, ...], ...]:
        """The cached requests, to `restore` later (a benchmark repeats a prompt from the same state, so a
        repeat is not drafted from its own earlier answer)."""
        with self._lock:
            return tuple(tuple(r) for r in self._requests)

    def restore(self, snapshot: tuple[tuple[int, ...], ...]) -> None:
        with self._lock:
            self._requests = deque(list(r) for r in snapshot)
            self._rebuild()

    def continuations(self, context: Sequence[int], max_depth: int) -> list[tuple[list[int], float]]:
        """(continuation, evidence weight) for each cached occurrence of a suffix of `context`, longest match
        first, then most recent first; continuations stop at the end of their request."""
        if max_depth <= 0:
            return []
        with self._lock:
            return self._index.continuations(max_depth, query=context, stop=SEPARATOR)


class SuffixDrafter(NgramDrafter):
    """Drafts from the longest, most recent earlier occurrence of the current suffix in the request's own
    context (an `NgramDrafter` index per request) or in the shared `SuffixCache`; trees merge the candidates
    of both. A request's tokens enter the cache when it is removed (finished or cancelled)."""

    def __init__(self, cache: SuffixCache | None = None, max_n: int = 3, min_n: int = 1, max_occurrences: int = 8,
                 name: str = "suffix", max_tokens: int = 32768, cache_min_n: int = 2, cache_max_n: int = 6) -> None:
        """max_n, min_n, max_occurrences: the request's own index (as `ngram`); max_tokens, cache_min_n,
        cache_max_n: the shared cache's, when `cache` is not given."""
        super().__init__(max_n, min_n, name, max_occurrences)
        self.cache = cache if cache is not None else SuffixCache(max_tokens, cache_min_n, cache_max_n,
                                                                 max_occurrences)

    @property
    def memory(self) -> SuffixCache:
        """What it remembers across requests (see `Drafter`)."""
        return self.cache

    def _propose_one(self, index: NgramIndex, context: Sequence[int], max_k: int, budget: int | None) -> Proposal:
        # Both sources' candidates, best first; sorting is stable, so the request's own win ties.
        found = sorted(index.continuations(max_k) + self.cache.continuations(context, max_k),
                       key=lambda pair: -pair[1])
        if budget is None or budget <= max_k:
            return Proposal(found[0][0][:budget or max_k] if found else [])
        return tree_from_continuations(found, budget)

    def remove_request(self, request_id: int) -> None:
        index = self._indexes.get(request_id)
        if index is not None:
            self.cache.add(index.tokens)
        super().remove_request(request_id)
