"""Prompt lookup decoding: draft by copying what followed earlier occurrences of the current suffix.

Outputs that quote, edit or summarise their prompt repeat long spans of it, so a free, model-less drafter
that copies those spans gets many tokens accepted. The drafter is deterministic (`draft_probs=None`), so
verification treats its tokens as one-hot drafts and stays lossless whatever it proposes.

As a chain it copies the continuation of the single best occurrence (`NgramIndex.lookup`). Given a node budget
larger than the depth it proposes a tree instead (`NgramIndex.lookup_tree`): when the suffix was followed by
different text at different places, the target can accept whichever of them it agrees with, at the price of
a wider verification forward only.

A request with a `prediction` (OpenAI's Predicted Outputs: text the output is expected to repeat) gets a second
index over the prediction, placed after the prompt's last tokens so that the output's first tokens match its
start. A lookup there takes the occurrence nearest where the output stands in the prediction (not the latest:
a prediction is read in order); the draft is the prediction's continuation where its match is at least as long
as the context's own, else the context's; a tree merges both indexes' continuations.

The index is incremental because `propose` runs once per decoding step: rescanning the whole context each
time would make a request quadratic in its length. The context only grows within a request, so only its new
tail ever needs indexing.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified, node_budgets

# `NgramIndex.prev` entry of an occurrence with no earlier one (or of a position where no n-gram ends).
NO_OCCURRENCE = -1
# Occurrences of a suffix in a prediction weighed for where the output stands (`NgramDrafter._aligned`): a
# phrase that recurs more often in a long prediction is found at one of its latest this many places.
PREDICTION_OCCURRENCES = 256


class NgramIndex:
    """One request's incremental index of where each n-gram (min_n <= n <= max_n) of its context occurred.

    For each n, `tables[n]` maps an n-gram to the end position of its latest occurrence, and `prev[n][j]` is
    the end of the previous occurrence of the n-gram that ends at j (NO_OCCURRENCE: none). Following these
    links from the table lists every occurrence, most recent first. Links cost one entry per position and n
    and O(1) per new token, whereas a list of recent positions per n-gram would cost an object per distinct
    n-gram; how many occurrences a tree looks at (`max_occurrences`) is then a lookup-time choice.

    An n-gram ending at position j is indexed only once position j + 1 exists, so every occurrence has a
    continuation and the current suffix can never be found as its own match.
    """

    # Evidence weight of one occurrence in `lookup_tree`: MATCH_BASE ** n for a match of n tokens, times
    # RECENCY_DECAY ** rank for the rank-th most recent occurrence of that n-gram (0: the latest).
    MATCH_BASE = 2.0
    RECENCY_DECAY = 0.75

    def __init__(self, min_n: int, max_n: int, max_occurrences: int = 8) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.max_occurrences = max_occurrences
        self.reset()

    def reset(self) -> None:
        # A private int copy of the context, so lookups and slicing do not depend on what kind of sequence
        # (list, tuple, tensor) the engine hands in.
        self.tokens: list[int] = []
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.prev: dict[int, list[int]] = {n: [] for n in self.tables}
        self.indexed_upto = 0  # every n-gram ending before this position is in the index

    def sync(self, context: Sequence[int]) -> None:
        """Bring the copy and the index up to `context`, touching only tokens not seen before.

        A request's context only ever grows; a shorter one breaks that promise, so the index is rebuilt
        rather than silently corrupted."""
        if len(context) < len(self.tokens):
            self.reset()
        self.extend(context[len(self.tokens):])

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens to the copy and index what they complete (`sync` without handing in the whole
        context again)."""
        tokens = self.tokens
        tokens.extend(int(t) for t in new_tokens)
        # Index n-grams ending at j for every j that now has a continuation (j <= len - 2).
        for j in range(self.indexed_upto, len(tokens) - 1):
            for n, table in self.tables.items():
                prev = self.prev[n]
                if j + 1 >= n:
                    gram = tuple(tokens[j + 1 - n : j + 1])
                    prev.append(table.get(gram, NO_OCCURRENCE))
                    table[gram] = j
                else:
                    prev.append(NO_OCCURRENCE)  # keeps prev[n][j] aligned with positions
        self.indexed_upto = max(self.indexed_upto, len(tokens) - 1)

    def occurrences(self, gram: Sequence[int], limit: int | None = None) -> list[int]:
        """End positions of the indexed occurrences of `gram`, most recent first, at most `limit` of them
        (default `max_occurrences`)."""
        n = len(gram)
        if n not in self.tables:
            raise ValueError(f"NgramIndex indexes n-grams of length {self.min_n}..{self.max_n}, not {n}")
        limit = self.max_occurrences if limit is None else limit
        ends: list[int] = []
        end = self.tables[n].get(tuple(int(t) for t in gram), NO_OCCURRENCE)
        while end != NO_OCCURRENCE and len(ends) < limit:
            ends.append(end)
            end = self.prev[n][end]
        return ends

    def longest_match(self) -> tuple[int, int]:
        """(n, end) of the longest indexed suffix of the context that occurred before, with the end position of
        its latest earlier occurrence; (0, NO_OCCURRENCE) when no suffix did."""
        n = self.match_of(self.tokens)  # the suffix itself is never indexed: a match is an earlier occurrence
        return (n, self.tables[n][tuple(self.tokens[-n:])]) if n else (0, NO_OCCURRENCE)

    def match_of(self, query: Sequence[int]) -> int:
        """How many of `query`'s last tokens (at most max_n) occur in this index (0: none): a lookup in
        someone else's index, as `continuations(query=...)`."""
        suffix = [int(t) for t in query[-self.max_n:]]
        for n in sorted(self.tables, reverse=True):
            if n <= len(suffix) and tuple(suffix[len(suffix) - n:]) in self.tables[n]:
                return n
        return 0

    def lookup(self, max_k: int) -> list[int]:
        """The continuation of the latest earlier occurrence of the longest indexed suffix (n from max down)."""
        n, end = self.longest_match()
        if not n:
            return []
        # The continuation may run into the suffix itself (periodic text); stop at the end of the context
        # rather than guess beyond it.
        return self.tokens[end + 1 : min(end + 1 + max_k, len(self.tokens))]

    def continuations(self, max_depth: int, query: Sequence[int] | None = None,
                      stop: int | None = None) -> list[tuple[list[int], float]]:
        """(continuation, evidence weight) of every distinct occurrence of a suffix n-gram: longest n first,
        then most recent first, each continuation at most `max_depth` tokens and stopping at the end of the
        context as in `lookup`, so the first one is exactly `lookup(max_depth)`. With `query`, the suffixes
        are those of `query` instead of the indexed context (a lookup in someone else's index), and a
        continuation also ends before any `stop` token; empty continuations are left out.

        An occurrence of the n-suffix is also one of every shorter suffix; it is counted once, with its
        longest n, because it is one piece of evidence. The weight grows exponentially with n because a long
        match is exponentially less likely to be chance, and decays with recency rank because nearby text
        predicts best; with the defaults a match one token longer outweighs the two latest occurrences of the
        shorter one together.
        """
        tokens, length = self.tokens, len(self.tokens)
        suffix = tokens if query is None else [int(t) for t in query[-self.max_n:]]
        seen: set[int] = set()
        found: list[tuple[list[int], float]] = []
        for n in sorted(self.tables, reverse=True):
            if n > len(suffix):
                continue
            for rank, end in enumerate(self.occurrences(suffix[len(suffix) - n :])):
                if end not in seen:
                    seen.add(end)
                    continuation = tokens[end + 1 : min(end + 1 + max_depth, length)]
                    if stop is not None and stop in continuation:
                        continuation = continuation[: continuation.index(stop)]
                    if continuation:
                        found.append((continuation, self.MATCH_BASE**n * self.RECENCY_DECAY**rank))
        return found

    def lookup_tree(self, max_depth: int, max_nodes: int) -> Proposal:
        """A draft tree of at most `max_nodes` tokens and depth `max_depth`, made of the continuations of the
        suffix's earlier occurrences (`continuations`).

        The continuations are merged into a trie (a shared prefix is one path, siblings are distinct tokens),
        and each trie node is scored by the summed weight of the continuations through it: how strongly the
        context says that path comes next, a proxy for the chance that the target accepts it. A node never
        outscores its parent, so picking nodes best-first from the frontier (children of picked nodes) gives a
        connected tree that spends the budget where acceptance is most likely.

        The chain `lookup(max_depth)` is picked first, whatever the scores, and its last node gets no
        children: following the first child from the root gives exactly that chain, so greedy acceptance with
        the tree is never below the chain's. With `max_nodes <= max_depth` the whole budget goes to the chain,
        so the result is `lookup(max_nodes)`.

        Nodes are emitted in the order they were picked, so parents come before children and siblings
        follow the chain child (if any) by descending score, and the first m > max_depth nodes are the tree
        this method returns for a budget of m.
        """
        if max_depth <= 0 or max_nodes <= 0:
            return Proposal([])
        if max_nodes <= max_depth:
            return Proposal(self.lookup(max_nodes))
        return tree_from_continuations(self.continuations(max_depth), max_nodes)


def tree_from_continuations(found: Sequence[tuple[list[int], float]], max_nodes: int) -> Proposal:
    """The draft tree of `NgramIndex.lookup_tree` from (continuation, evidence weight) pairs, best first: the
    first continuation is the chain, the rest branch off it where the trie's summed weights are highest."""
    if len(found) <= 1:
        return Proposal(found[0][0] if found else [])

    # The trie: node_tokens[i], node_parents[i], scores[i], children[i] (token -> node); ROOT's children in
    # root_children. Node ids follow insertion order, so the first continuation (the chain) is 0, 1, ...
    node_tokens: list[int] = []
    node_parents: list[int] = []
    scores: list[float] = []
    children: list[dict[int, int]] = []
    root_children: dict[int, int] = {}
    for continuation, weight in found:
        parent, kids = ROOT, root_children
        for token in continuation:
            node = kids.get(token)
            if node is None:
                node = kids[token] = len(node_tokens)
                node_tokens.append(token)
                node_parents.append(parent)
                scores.append(0.0)
                children.append({})
            scores[node] += weight
            parent, kids = node, children[node]

    chain_len = len(found[0][0])
    picked = list(range(chain_len))
    # Frontier: the chain's off-chain children (the chain's tip stays a leaf). Ties go to the earlier node,
    # i.e. the one from the longer or more recent match.
    frontier = [(-scores[c], c) for c in root_children.values() if c != 0]
    frontier += [(-scores[c], c) for node in range(chain_len - 1) for c in children[node].values() if c != node + 1]
    heapq.heapify(frontier)
    while frontier and len(picked) < max_nodes:
        _, node = heapq.heappop(frontier)
        picked.append(node)
        for child in children[node].values():
            heapq.heappush(frontier, (-scores[child], child))

    position = {node: i for i, node in enumerate(picked)}
    return Proposal([node_tokens[node] for node in picked], None,
                    [ROOT if node_parents[node] == ROOT else position[node_parents[node]] for node in picked])


def marked_path(tree: Proposal, chain: Sequence[int]) -> Proposal:
    """`tree` with the nodes that spell `chain` from the root marked `predicted` (as far as the tree has them)."""
    marks = [False] * len(tree)
    parent = ROOT
    for token in chain:
        node = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == parent and t == token),
                    None)
        if node is None:
            break
        marks[node] = True
        parent = node
    return Proposal(tree.tokens, tree.draft_probs, tree.parents, marks)


class NgramDrafter:
    """Proposes the continuation of the most recent earlier occurrence of the longest matching suffix, or,
    given a node budget beyond the depth, a tree of the continuations of several occurrences.

    Longer n-grams are tried first because a longer shared history is stronger evidence that the same
    continuation follows; among occurrences of one n-gram the most recent wins because nearby text is the
    best predictor of what comes next. A tree looks at up to `max_occurrences` recent occurrences per n-gram.
    One index per request.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, max_n: int = 3, min_n: int = 1, name: str = "ngram", max_occurrences: int = 8) -> None:
        for label, value in (("max_n", max_n), ("min_n", min_n), ("max_occurrences", max_occurrences)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{type(self).__name__}: {label} must be an integer, got {value!r}")
        if min_n < 1:
            raise ValueError(f"{type(self).__name__}: min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"{type(self).__name__}: max_n must be >= min_n, got max_n={max_n}, min_n={min_n}")
        if max_occurrences < 1:
            raise ValueError(f"{type(self).__name__}: max_occurrences must be >= 1, got {max_occurrences}")
        self.name = name
        self.max_n = max_n
        self.min_n = min_n
        self.max_occurrences = max_occurrences
        self._indexes: dict[int, NgramIndex] = {}
        self._predictions: dict[int, NgramIndex] = {}  # request id -> index of its prediction, where it has one
        self._offsets: dict[int, int] = {}  # request id -> prediction index position - output position

    def add_request(self, request: DraftRequest) -> None:
        """The generator is irrelevant (lookup never samples); of the sampling params only the prediction
        counts."""
        index = self._indexes[request.request_id] = NgramIndex(self.min_n, self.max_n, self.max_occurrences)
        index.sync(request.prompt_ids)
        prediction = request.params.prediction
        if prediction:  # token ids (the engine tokenizes a text)
            predicted = self._predictions[request.request_id] = NgramIndex(self.min_n, self.max_n,
                                                                          self.max_occurrences)
            tail = request.prompt_ids[-self.max_n:]
            predicted.extend([*tail, *prediction])
            self._offsets[request.request_id] = len(tail) - len(request.prompt_ids)  # prompt's end: tail's end

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int | None] | None = None) -> list[Proposal]:
        """A chain of up to `max_k` tokens when the request's `max_nodes` is None or `max_k` (exactly what
        the drafter proposed before trees existed), otherwise a tree from `NgramIndex.lookup_tree`."""
        budgets = node_budgets(self, request_ids, max_nodes)
        proposals = []
        for request_id, context, max_k, budget in zip(request_ids, contexts, max_ks, budgets):
            index = self._indexes[request_id]
            index.sync(context)
            if max_k <= 0:
                proposals.append(Proposal([]))
            elif request_id in self._predictions:
                proposals.append(self._propose_predicted(request_id, index, context, max_k, budget))
            else:
                proposals.append(self._propose_one(index, context, max_k, budget))
        return proposals

    def _propose_one(self, index: NgramIndex, context: Sequence[int], max_k: int, budget: int | None) -> Proposal:
        """One request's draft from its synced index (max_k >= 1)."""
        if budget is None or budget == max_k:
            return Proposal(index.lookup(max_k))
        return index.lookup_tree(max_k, budget)

    def _propose_predicted(self, request_id: int, index: NgramIndex, context: Sequence[int], max_k: int,
                           budget: int | None) -> Proposal:
        """A request with a prediction: the prediction's continuation where the context's suffix matches it
        at least as long as it matches the context itself, else the context's own lookup; a tree adds the
        context's continuations to the prediction's (or the other way round) (`tree_from_continuations`)."""
        n, chain = self._aligned(request_id, self._predictions[request_id], context, max_k)
        first = bool(chain) and n >= index.longest_match()[0]
        if budget is None or budget <= max_k:  # a chain: one of the two lookups
            limit = max_k if budget is None else budget
            if first:
                tokens = chain[:limit]
                return Proposal(tokens, predicted=[True] * len(tokens))
            return Proposal(index.lookup(limit))
        from_context = index.continuations(max_k)
        predicted = [(chain, NgramIndex.MATCH_BASE ** n)] if chain else []
        tree = tree_from_continuations(predicted + from_context if first else from_context + predicted, budget)
        return marked_path(tree, chain)

    def _aligned(self, request_id: int, predicted: NgramIndex, context: Sequence[int], max_k: int
                 ) -> tuple[int, list[int]]:
        """(n, continuation) of the context's longest suffix found in the prediction, at the occurrence nearest
        where the output stands in it: not the latest occurrence, as in the context, because a prediction is
        read in order and a common phrase recurs in it. Where the output stands is its position plus the
        offset of the last match, so text the output inserted or left out moves it along."""
        n = predicted.match_of(context)
        if not n:
            return 0, []
        here = len(context) - 1
        expected = here + self._offsets[request_id]
        ends = predicted.occurrences(list(context[-n:]), limit=PREDICTION_OCCURRENCES)
        end = min(ends, key=lambda e: (abs(e - expected), e))
        self._offsets[request_id] = end - here
        return n, predicted.tokens[end + 1:end + 1 + max_k]

    def guess(self, request_id: int, context: Sequence[int], drafted: Sequence[int], max_k: int) -> list[int]:
        """A chain of up to `max_k` tokens that continues `context` + `drafted`, where `drafted` is what a
        later stage of a cascade has drafted and nobody has committed: the suffix of that sequence is looked
        up in the index of the committed `context` alone, so the index never holds uncommitted tokens."""
        index = self._indexes[request_id]
        index.sync(context)
        if max_k <= 0:
            return []
        if not drafted:
            return index.lookup(max_k)
        found = index.continuations(max_k, query=[*context[-self.max_n:], *drafted])
        return found[0][0] if found else []

    def match_length(self, request_id: int, context: Sequence[int]) -> int:
        """How many tokens of the context's end occurred before, or occur in the request's prediction (0: none;
        at most max_n): the evidence behind this request's next proposal."""
        index = self._indexes[request_id]
        index.sync(context)
        predicted = self._predictions.get(request_id)
        return max(index.longest_match()[0], predicted.match_of(context) if predicted else 0)

    def observe(self, request_id: int, verified: Verified) -> None:
        """Indexing here keeps `propose` cheap; the new context says it all."""
        self._indexes[request_id].sync(verified.context)

    def remove_request(self, request_id: int) -> None:
        self._indexes.pop(request_id, None)
        self._predictions.pop(request_id, None)
        self._offsets.pop(request_id, None)
