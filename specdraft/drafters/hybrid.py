"""`hybrid:ngram,B`: n-gram lookup where the context repeats itself, the model drafter B everywhere else.

Why: the two kinds of drafter are right in different places. Prompt lookup is free and, after a long match,
nearly always right (on the target's own answers to held-out training prompts, SmolLM2-135M: the first
guess after a match of 3 tokens is right 61% of the time, after 6 tokens 93%), but after a 1-token match it
is right 19% of the time and half the positions have no match of 2 tokens at all. A trained head (EAGLE) or
a draft model guesses new text too, at the price of its forwards. So each round, per request, the hybrid
asks the n-gram index how long a suffix of the context it has seen before: from `min_match` tokens on it
proposes the lookup's chain or tree (and B drafts nothing that round), otherwise B proposes.

Lossless whatever it picks: each round's proposal is exactly one drafter's, with that drafter's semantics
(the lookup's are deterministic, B's carry their own draft distribution), and the choice depends only on the
committed context. B observes every round, including rounds the lookup drafted, so its state (EAGLE's
features, a draft model's cache) keeps up with the context as it does through plain-decoding rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdraft.drafters.base import Drafter, DraftRequest, Proposal, Verified
from specdraft.drafters.ngram import NgramDrafter


class HybridDrafter:
    """See the module docstring. `rounds` counts the proposals each side made (lookup, model)."""

    def __init__(self, lookup: NgramDrafter, model: Drafter, min_match: int = 2, name: str = "hybrid") -> None:
        if not isinstance(min_match, int) or isinstance(min_match, bool) or min_match < 1:
            raise ValueError(f"{type(self).__name__}: min_match must be an integer >= 1, got {min_match!r}")
        if min_match > lookup.max_n:
            raise ValueError(f"{type(self).__name__}: min_match {min_match} exceeds the lookup's max_n "
                             f"{lookup.max_n}")
        self.lookup, self.model, self.min_match, self.name = lookup, model, min_match, name
        self.hidden_layers: tuple[int, ...] = tuple(model.hidden_layers)
        self.rounds = {"lookup": 0, "model": 0}

    def add_request(self, request: DraftRequest) -> None:
        self.lookup.add_request(request)
        self.model.add_request(request)

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int | None] | None = None) -> list[Proposal]:
        budgets: list[int | None] = [None] * len(request_ids) if max_nodes is None else list(max_nodes)
        out = [Proposal([]) for _ in request_ids]
        by_lookup, by_model = [], []
        for i, (request_id, context, max_k) in enumerate(zip(request_ids, contexts, max_ks)):
            if max_k <= 0:
                continue
            matched = self.lookup.match_length(request_id, context)
            (by_lookup if matched >= self.min_match else by_model).append(i)
        for side, rows, drafter in (("lookup", by_lookup, self.lookup), ("model", by_model, self.model)):
            if not rows:
                continue
            nodes = None if max_nodes is None else [budgets[i] for i in rows]
            proposals = drafter.propose([request_ids[i] for i in rows], [contexts[i] for i in rows],
                                        [max_ks[i] for i in rows], nodes)
            for i, proposal in zip(rows, proposals):
                out[i] = proposal
            self.rounds[side] += len(rows)
        return out

    def observe(self, request_id: int, verified: Verified) -> None:
        self.lookup.observe(request_id, verified)
        self.model.observe(request_id, verified)

    def remove_request(self, request_id: int) -> None:
        self.lookup.remove_request(request_id)
        self.model.remove_request(request_id)
