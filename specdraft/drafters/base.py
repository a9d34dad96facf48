"""The one small interface every drafter implements, keyed by request so one drafter serves many at once.

The engine calls, per request: `add_request` once (after the target's prefill), then repeatedly
`propose` -> (the target verifies, in one batched forward with the other requests) -> `observe`, and
`remove_request` when the request ends. `propose` takes every request of the round at once, so a model
drafter runs one forward per draft step for all of them. Per-request state (an n-gram index, a KV-cache
slot, the sampling generator) lives in the drafter under the request id, never in a drafter-wide field.

`observe` hands the drafter what the target computed, at no extra forward: the tokens it scored, their
positions, the accepted path, and, for the layers the drafter names in `hidden_layers`, the target's hidden
states (EAGLE-3 reads three layers, EAGLE-1 and Medusa the last). Drafters that name none cost plain
decoding nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdraft.runtime.kv_cache import KVCache
from specdraft.verify.sampling import SamplingParams
from specdraft.verify.tree import ROOT, tree_depths


@dataclass
class Proposal:
    """Draft tokens as a tree: each token has the index of its parent node (ROOT: it follows the last
    committed token), parents come before their children, and siblings are tried in their order. A chain is
    `parents == [ROOT, 0, 1, ...]` (the default).

    `draft_probs` is [len(tokens), vocab] fp32: row i is the exact distribution token i was drawn from, given
    its parent and its earlier siblings (made by `logits_to_probs` with the request's params; a drafter that
    samples siblings without replacement zeroes and renormalises the earlier ones). `None` means the drafter
    is deterministic (each token is a one-hot draft), which is what greedy drafting, top-k trees and n-gram
    lookup are. Verification is lossless under exactly these semantics (see verify/tree.py).

    `predicted` marks the nodes the request's prediction proposed (OpenAI's Predicted Outputs; None: none
    did), so that the engine can count the prediction's tokens accepted and rejected; verification ignores it.
    """

    tokens: list[int]
    draft_probs: torch.Tensor | None = None
    parents: list[int] | None = None  # None: a chain
    predicted: list[bool] | None = None

    def __post_init__(self) -> None:
        if self.parents is None:
            self.parents = [ROOT] + list(range(len(self.tokens) - 1)) if self.tokens else []
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} draft tokens but {len(self.parents)} parent indices")
        if any(not ROOT <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"parents must point to an earlier node or ROOT, got {self.parents}")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.tokens)} tokens")
        if self.predicted is not None and len(self.predicted) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} draft tokens but {len(self.predicted)} prediction marks")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def depths(self) -> list[int]:
        """1-based depth of each node (a child of ROOT has depth 1)."""
        return tree_depths(self.parents)

    def truncated(self, max_depth: int, max_nodes: int | None = None) -> Proposal:
        """The first `max_nodes` nodes (default: all) of depth at most `max_depth`; for a chain, its first
        `max_depth` tokens. A node is kept only with its parent, so the result is again a tree."""
        max_nodes = len(self.tokens) if max_nodes is None else max_nodes
        depths = self.depths
        keep: list[int] = []
        new_index: dict[int, int] = {}
        for i, (p, d) in enumerate(zip(self.parents, depths)):
            if len(keep) == max_nodes:
                break
            if d <= max_depth and (p == ROOT or p in new_index):
                new_index[i] = len(keep)
                keep.append(i)
        if len(keep) == len(self.tokens):
            return self
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        return Proposal([self.tokens[i] for i in keep], probs,
                        [ROOT if self.parents[i] == ROOT else new_index[self.parents[i]] for i in keep],
                        None if self.predicted is None else [self.predicted[i] for i in keep])


@dataclass
class DraftRequest:
    """What a drafter learns about a new request: its prompt, how it samples, and the target's work on it.

    target_cache/target_slot: where the target keeps the prompt's keys and values (drafters derived from the
    target's own weights copy them instead of running a prefill of their own). prompt_hidden: the target's
    hidden states over the prompt for the layers the drafter asked for ({layer: [len(prompt_ids), dim]}).
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    target_cache: KVCache | None = None
    target_slot: int = 0
    prompt_hidden: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Verified:
    """One round's outcome, as the target computed it.

    scored: the tokens the target scored in this round (the pending token, then the draft tokens), at
    `positions`; accepted: indices into the proposal's tokens of the accepted path, root first; emitted: the
    tokens committed this round (accepted drafts, then the target's correction or bonus); context: the whole
    committed sequence afterwards. hidden: {layer: [len(scored), dim]} for the layers the drafter asked for.
    parents: the draft tokens' parent indices (as in `Proposal`). target_topk: [len(scored), k] token ids,
    the target's k most likely next tokens after each scored token (given its path), best first, for a
    drafter whose `target_topk` is k > 0; None otherwise.
    """

    scored: list[int]
    positions: list[int]
    accepted: list[int]
    emitted: list[int]
    context: Sequence[int]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    parents: list[int] = field(default_factory=list)
    target_topk: torch.Tensor | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


class Drafter(Protocol):
    """A drafter may also set `target_topk = k` (absent: 0): `observe` then receives the target's top k
    next tokens at every scored token (`Verified.target_topk`), for the price of a top-k over the logits.
    One that remembers across requests exposes that state as `memory` (absent: None), an object with
    `snapshot()` and `restore(snapshot)`: a benchmark rewinds it so that no prompt is drafted from its own
    earlier run."""

    name: str
    # Target layers whose hidden states `add_request` and `observe` receive (-1: the final-normed output).
    hidden_layers: tuple[int, ...]

    def add_request(self, request: DraftRequest) -> None:
        """Begin drafting for a new request; its id stays valid until `remove_request`."""

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int] | None = None) -> list[Proposal]:
        """For each request, draft tokens that continue its `context` (the committed sequence): at most
        `max_k` deep and at most `max_nodes` tokens in all (None: `max_k`, i.e. a chain). A drafter that
        cannot branch returns a chain; a proposal may be empty."""

    def observe(self, request_id: int, verified: Verified) -> None:
        """Told after every verification round of the request (also rounds in which it drafted nothing)."""

    def remove_request(self, request_id: int) -> None:
        """Forget the request and free what it held."""


def node_budgets(drafter: object, request_ids: Sequence[int], max_nodes: Sequence[int | None] | None
                 ) -> Sequence[int | None]:
    """Each request's node budget from `propose`'s `max_nodes` (None for all: chains), checked for length."""
    budgets: Sequence[int | None] = [None] * len(request_ids) if max_nodes is None else max_nodes
    if len(budgets) != len(request_ids):
        raise ValueError(f"{type(drafter).__name__}: {len(budgets)} node budgets for {len(request_ids)} requests")
    return budgets

