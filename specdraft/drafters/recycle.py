"""`recycle`: a best-first draft tree from three free sources of "what the target says next", with no model
forward at all (after Token Recycling, Luo et al. 2024, and retrieval drafting, REST, He et al. 2024).

1. The request's own context (prompt lookup, `NgramIndex`): the token that followed an earlier occurrence of
   the context's last n tokens.
2. The target's recycled predictions: every verification forward computes the target's distribution at
   every scored token, rejected tree branches included, and plain decoding keeps only one token of it. The
   drafter keeps the top `target_topk` of each (keyed by the last 1-3 tokens of the scored path), shared by
   every request of the drafter, and offers them the next time those tokens come up.
3. A static `NgramTable` distilled from the target's own answers to training prompts (`specdraft train
   ngram-table`): for contexts of 1-3 tokens, the target's most frequent next tokens and their frequencies.
   One ships per bundled model (`recycle` alone picks it, `recycle:DIR` names one).

Each source offers candidate next tokens with an estimated chance of being the target's choice (the
constants below, measured on held-out distilled answers); a token offered by several sources gets the
chance that at least one is right (as if the sources erred independently). The tree grows EAGLE-2
style: a node's score is the product of its path's chances (an estimate of the chance the target accepts
the whole path), and the best `max_nodes` nodes are proposed, expanded lazily best first. As a chain it
follows the best child `max_k` deep.

Deterministic (`draft_probs=None`): verification treats the tokens as one-hot drafts and stays lossless
whatever the tables hold, so a stale or foreign table costs speed, never correctness.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified, node_budgets
from specdraft.drafters.ngram import NO_OCCURRENCE, NgramIndex
from specdraft.errors import SpecdraftError
from specdraft.runtime.paths import replaced_on_success

# The constants below are measured on the target's own answers to held-out training prompts (the validation
# split of SmolLM2-135M's distillation, 31k answer positions, half of them sampled at T = 0.7), never on
# Spec-Bench: `python scripts/recycle_calibration.py --model smollm2-135m --data DATA --table TABLE`.
#
# Chance that the token after the latest earlier occurrence of the context's last n tokens is the target's
# next one, by n (the last entry for longer matches).
MATCH_CHANCE = (0.0, 0.19, 0.46, 0.61, 0.89)
# Chance that the target's r-th ranked prediction after the same last `order` tokens, recycled from an
# earlier forward over other text, is its next token here: {order: (rank 0, rank 1, ...)}.
RECYCLED_CHANCE = {3: (0.73, 0.063, 0.028, 0.017), 2: (0.28, 0.080, 0.042, 0.033), 1: (0.16, 0.067, 0.046, 0.038)}
# A static table's frequencies (count / (total + 1)) come from other text: how often one of a context's
# candidates was right, over their summed frequencies, by order.
TABLE_WEIGHT = {3: 0.77, 2: 0.64, 1: 0.59}

# Table keys pack up to MAX_ORDER tokens (each + 1, so orders differ) in KEY_BITS bits each.
KEY_BITS = 20
MAX_ORDER = 3
MAX_VOCAB = (1 << KEY_BITS) - 1
# The table's file in a table directory (`specdraft train ngram-table --out DIR`).
TABLE_FILE = "table.safetensors"


def pack_key(tokens: Sequence[int]) -> int:
    """One int for a context of 1..MAX_ORDER tokens (its order is part of the key)."""
    key = 0
    for t in tokens:
        key = (key << KEY_BITS) | (int(t) + 1)
    return key


def context_keys(tail: Sequence[int]) -> list[tuple[int, int]]:
    """(order, packed key) of the contexts ending `tail`, longest first (what both tables look up)."""
    keys, key = [], 0
    for order, t in enumerate(reversed(tail[max(0, len(tail) - MAX_ORDER):]), start=1):
        key |= (int(t) + 1) << (KEY_BITS * (order - 1))
        keys.append((order, key))
    return keys[::-1]


class NgramTable:
    """For contexts of 1..MAX_ORDER tokens: up to `top` next tokens, most frequent first, each with its
    frequency shrunk toward zero for rare contexts (count / (total + 1)).

    Stored as sorted packed keys with [n, top] token and probability arrays (-1 / 0 pad a row); a dict from
    key to row is built on load, so a lookup is a dict probe."""

    def __init__(self, keys: np.ndarray, next_tokens: np.ndarray, next_probs: np.ndarray,
                 meta: dict | None = None) -> None:
        if not (len(keys) == len(next_tokens) == len(next_probs)) or next_tokens.shape != next_probs.shape:
            raise ValueError("NgramTable: keys, next_tokens and next_probs disagree in shape")
        self.keys = np.ascontiguousarray(keys, dtype=np.int64)
        self.next_tokens = np.ascontiguousarray(next_tokens, dtype=np.int32)
        self.next_probs = np.ascontiguousarray(next_probs, dtype=np.float32)
        self.meta = dict(meta or {})
        self._rows = dict(zip(self.keys.tolist(), range(len(self.keys))))
        self._found: dict[int, list[tuple[int, float]]] = {}  # rows already read, as Python lists

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, tail: Sequence[int], keys: list[tuple[int, int]] | None = None
               ) -> tuple[int, list[tuple[int, float]]]:
        """(order, [(token, frequency), ...]) for the longest context ending `tail` that the table holds
        (`keys`: its `context_keys`, if already computed); (0, []) when none."""
        for order, key in context_keys(tail) if keys is None else keys:
            row = self._rows.get(key)
            if row is not None:
                found = self._found.get(row)
                if found is None:
                    found = self._found[row] = [(t, p) for t, p in zip(self.next_tokens[row].tolist(),
                                                                       self.next_probs[row].tolist()) if t >= 0]
                return order, found
        return 0, []

    @classmethod
    def build(cls, sequences: Iterable[tuple[Sequence[int], int]], top: int = 4, min_count: int = 2,
              vocab_size: int | None = None, meta: dict | None = None) -> NgramTable:
        """Count, over (tokens, start) pairs, every next token at positions >= start (the target's answer,
        not the prompt) after each context of 1..MAX_ORDER tokens; keep contexts seen `min_count` times."""
        if top < 1 or min_count < 1:
            raise ValueError(f"NgramTable.build: top and min_count must be >= 1, got {top}, {min_count}")
        if vocab_size is not None and vocab_size > MAX_VOCAB:
            raise ValueError(f"NgramTable: a vocabulary of {vocab_size} does not fit {KEY_BITS}-bit keys")
        contexts, nexts = [], []
        for tokens, start in sequences:
            seq = np.asarray(tokens, dtype=np.int64)
            if seq.size and (seq.min() < 0 or seq.max() >= MAX_VOCAB):
                raise ValueError(f"NgramTable: token ids must be in [0, {MAX_VOCAB}), got {seq.min()}..{seq.max()}")
            for order in range(1, MAX_ORDER + 1):
                first = max(start, order)
                if first >= len(seq):
                    continue
                key = np.zeros(len(seq) - first, dtype=np.int64)
                for j in range(order):  # tokens i - order .. i - 1, oldest first
                    key = (key << KEY_BITS) | (seq[first - order + j: len(seq) - order + j] + 1)
                contexts.append(key)
                nexts.append(seq[first:])
        if not contexts:
            return cls(np.zeros(0, np.int64), np.zeros((0, top), np.int32), np.zeros((0, top), np.float32), meta)
        pairs = np.stack([np.concatenate(contexts), np.concatenate(nexts)], axis=1)
        unique, counts = np.unique(pairs, axis=0, return_counts=True)  # sorted by context, then token
        ctx, tok = unique[:, 0], unique[:, 1]
        starts = np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]])
        totals = np.add.reduceat(counts, starts)
        keep = totals >= min_count
        # Within each context: most frequent first, ties to the smaller token id (np.lexsort: last key first).
        # Sorting by context first keeps each context's block where it was, so a pair's rank in its context
        # is its sorted index minus the block's start.
        group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(ctx)]))
        order = np.lexsort((tok, -counts, group))
        sorted_group = group[order]
        rank = np.arange(len(order)) - starts[sorted_group]
        chosen = (rank < top) & keep[sorted_group]
        rows = (np.cumsum(keep) - 1)[sorted_group[chosen]]
        n = int(keep.sum())
        next_tokens = np.full((n, top), -1, dtype=np.int32)
        next_probs = np.zeros((n, top), dtype=np.float32)
        next_tokens[rows, rank[chosen]] = tok[order][chosen]
        next_probs[rows, rank[chosen]] = counts[order][chosen] / (totals[sorted_group[chosen]] + 1)
        return cls(ctx[starts][keep], next_tokens, next_probs, meta)

    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_on_success(path) as tmp:
            save_file({"keys": self.keys, "next_tokens": self.next_tokens,
                       "next_probs": self.next_probs.astype(np.float16)}, str(tmp),
                      metadata={"specdraft": json.dumps(self.meta)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> NgramTable:
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if path.is_dir():
            path = path / TABLE_FILE
        if not path.is_file():
            raise SpecdraftError(f"no n-gram table at {path}: build one with `specdraft train ngram-table`")
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = json.loads((f.metadata() or {}).get("specdraft", "{}"))
                arrays = {name: f.get_tensor(name) for name in ("keys", "next_tokens", "next_probs")}
        except (OSError, KeyError, ValueError, SafetensorError) as exc:  # JSONDecodeError is a ValueError
            raise SpecdraftError(f"{path} is not a specdraft n-gram table: {exc}") from exc
        return cls(arrays["keys"], arrays["next_tokens"], arrays["next_probs"], meta)


class RecycledPredictions:
    """The target's top-k predictions after the last 1..MAX_ORDER tokens of every path it scored, latest
    wins; shared by the requests of one drafter. Bounded: past `capacity` keys the quarter first recorded
    longest ago goes."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self._top: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._top)

    def record(self, path: Sequence[int], top: Sequence[int]) -> None:
        """The target's ranked predictions `top` after the token sequence `path` (its last MAX_ORDER count)."""
        top = tuple(top)
        for _, key in context_keys(path):
            self._top[key] = top
        if len(self._top) > self.capacity:
            for key in list(self._top)[: len(self._top) - self.capacity * 3 // 4]:
                del self._top[key]

    def snapshot(self) -> dict[int, tuple[int, ...]]:
        """The recorded predictions, to `restore` later (a benchmark runs each prompt from the same state, so
        a prompt is never drafted from the target's predictions on its own earlier run)."""
        return dict(self._top)

    def restore(self, snapshot: dict[int, tuple[int, ...]]) -> None:
        self._top = dict(snapshot)

    def lookup(self, tail: Sequence[int], keys: list[tuple[int, int]] | None = None
               ) -> tuple[int, tuple[int, ...]]:
        """(order, ranked predictions) after the longest recorded context ending `tail`; (0, ()) when none."""
        for order, key in context_keys(tail) if keys is None else keys:
            top = self._top.get(key)
            if top is not None:
                return order, top
        return 0, ()


class RecycleDrafter:
    """See the module docstring. One `NgramIndex` per request; the recycled predictions and the table are
    shared by every request."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, table: NgramTable | None = None, max_n: int = 4, max_occurrences: int = 4,
                 target_topk: int = 4, name: str = "recycle", capacity: int = 1 << 20) -> None:
        for label, value, low in (("max_n", max_n, 1), ("max_occurrences", max_occurrences, 1),
                                  ("target_topk", target_topk, 0), ("capacity", capacity, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{type(self).__name__}: {label} must be an integer >= {low}, got {value!r}")
        self.table, self.name = table, name
        self.max_n, self.max_occurrences = max_n, max_occurrences
        # How many of the target's top predictions per scored token the engine hands to `observe`.
        self.target_topk = target_topk
        self.recycled = RecycledPredictions(capacity)
        self._indexes: dict[int, NgramIndex] = {}

    @property
    def memory(self) -> RecycledPredictions:
        """What it remembers across requests (see `Drafter`)."""
        return self.recycled

    # ------------------------------------------------------------------ the drafter interface

    def add_request(self, request: DraftRequest) -> None:
        index = self._indexes[request.request_id] = NgramIndex(1, self.max_n, self.max_occurrences)
        index.sync(request.prompt_ids)

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int | None] | None = None) -> list[Proposal]:
        budgets = node_budgets(self, request_ids, max_nodes)
        proposals = []
        for request_id, context, max_k, budget in zip(request_ids, contexts, max_ks, budgets):
            index = self._indexes[request_id]
            index.sync(context)
            if max_k <= 0:
                proposals.append(Proposal([]))
            elif budget is None or budget <= max_k:
                proposals.append(self.grow(index, max_k, max_k, chain=True))
            else:
                proposals.append(self.grow(index, max_k, budget))
        return proposals

    def observe(self, request_id: int, verified: Verified) -> None:
        """Recycle the target's top predictions at every token it scored (the pending token and each draft
        node, accepted or not): each is its prediction after the committed context plus the node's path."""
        top = verified.target_topk
        if top is not None and len(top):
            end = len(verified.context) - len(verified.emitted)  # the committed context before the round
            committed = list(verified.context[max(0, end - MAX_ORDER):end])
            rows = top.tolist()
            self.recycled.record(committed, rows[0])
            for path, row in zip(_node_paths(verified.scored[1:], verified.parents), rows[1:]):
                self.recycled.record((committed + path)[-MAX_ORDER:], row)
        self._indexes[request_id].sync(verified.context)

    def remove_request(self, request_id: int) -> None:
        self._indexes.pop(request_id, None)

    # ------------------------------------------------------------------ drafting

    def candidates(self, index: NgramIndex, tail: Sequence[int]) -> dict[int, float]:
        """Next-token candidates after `tail` (the last tokens of the context and the path so far) with their
        estimated chance of being the target's choice; several sources of one token combine as 1 - prod(1 - p)."""
        # Prompt lookup: the token after each of the latest `max_occurrences` earlier occurrences of the last n
        # tokens, counted once, with its longest n (NgramIndex.occurrences, inlined: this runs per tree node).
        chance: dict[int, float] = {}
        tokens, last = index.tokens, len(index.tokens) - 1
        for n in range(min(index.max_n, len(tail)), 0, -1):
            end = index.tables[n].get(tuple(tail[len(tail) - n:]), NO_OCCURRENCE)
            links, p, left = index.prev[n], MATCH_CHANCE[min(n, len(MATCH_CHANCE) - 1)], index.max_occurrences
            while end != NO_OCCURRENCE and left:
                if end < last and tokens[end + 1] not in chance:
                    chance[tokens[end + 1]] = p
                end, left = links[end], left - 1
        keys = context_keys(tail)
        order, top = self.recycled.lookup(tail, keys)
        for token, p in zip(top, RECYCLED_CHANCE[order] if order else ()):
            chance[token] = 1.0 - (1.0 - chance.get(token, 0.0)) * (1.0 - p)
        if self.table is not None:
            order, found = self.table.lookup(tail, keys)
            weight = TABLE_WEIGHT.get(order, 0.0)
            for token, p in found:
                chance[token] = 1.0 - (1.0 - chance.get(token, 0.0)) * (1.0 - weight * p)
        return chance

    def grow(self, index: NgramIndex, max_depth: int, max_nodes: int, chain: bool = False) -> Proposal:
        """The best `max_nodes` nodes (by path chance) of depth at most `max_depth`, expanded lazily best
        first from the committed context in `index`; `chain`: only each node's best child."""
        context_tail = index.tokens[-max(self.max_n, MAX_ORDER):]
        tokens: list[int] = []
        parents: list[int] = []
        paths: list[list[int]] = []
        heap: list[tuple[float, int, int, int]] = []  # (-path chance, tie-break, parent, token)
        counter = 0

        def push_children(parent: int, path: list[int], score: float) -> None:
            nonlocal counter
            found = self.candidates(index, (context_tail + path)[-max(self.max_n, MAX_ORDER):])
            ranked = sorted(found.items(), key=lambda item: (-item[1], item[0]))
            for token, p in ranked[:1] if chain else ranked:
                if p > 0.0:
                    heapq.heappush(heap, (-score * p, counter, parent, token))
                    counter += 1

        push_children(ROOT, [], 1.0)
        while heap and len(tokens) < max_nodes:
            neg_score, _, parent, token = heapq.heappop(heap)
            path = (paths[parent] if parent != ROOT else []) + [token]
            tokens.append(token)
            parents.append(parent)
            paths.append(path)
            if len(path) < max_depth and len(tokens) < max_nodes:
                push_children(len(tokens) - 1, path, -neg_score)
        return Proposal(tokens, None, parents)


def _node_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Each node's tokens from the root down to it."""
    paths: list[list[int]] = []
    for token, parent in zip(tokens, parents):
        paths.append(([] if parent == ROOT else paths[parent]) + [token])
    return paths


__all__ = ["MATCH_CHANCE", "RECYCLED_CHANCE", "TABLE_WEIGHT", "NgramTable", "RecycleDrafter", "RecycledPredictions",
           "pack_key"]
