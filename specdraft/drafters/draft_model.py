"""A draft transformer run autoregressively with its own rollback-able KV cache.

Serves three drafters: an independent draft checkpoint (`draft:REF`), the target's own weights quantized
(`quant:int4`, see quant.py) and the target's first N layers (`self:N`, see self_draft.py).

Cache bookkeeping, per request in its own slot of the draft's KV cache: after `propose` the slot holds the
context plus draft tokens d1..d_{k-1} (d_k was sampled but never fed). `observe` keeps what the target kept,
so the next `propose` only feeds the tokens the draft has not seen: the target's correction, or d_k plus the
bonus token after full acceptance.

Cascades (`cascade:A,B`): a `guesser` A (the n-gram drafter, or a cheaper draft model through
`ModelGuesser`) speeds up the draft's own chain drafting the way speculation speeds up the target. Each
draft step feeds the draft its next token plus the guesser's continuation of what it has drafted so far, in
one forward; the draft samples (or takes the argmax) at every position and keeps the guesses up to the
first one that differs from its own token, plus that token. Every
drafted token is still an exact draw from the draft's own distribution given the tokens before it (the
draws are made whatever the guesses are, and a guessed position is used only when all guesses before it
were right), so the proposal and its `draft_probs` are what the draft alone would give, for fewer forwards.

Token trees (when `propose` gets a node budget above the depth) grow EAGLE-2 style (tree_growth.py), one
draft forward per level for all requests. Tree drafts are deterministic (one-hot draft probabilities),
which keeps multi-candidate verification lossless at any temperature whatever nodes are kept. The tree's
keys are dropped afterwards; the next `propose` feeds the accepted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified
from specdraft.drafters.ngram import NgramDrafter
from specdraft.drafters.tree_growth import TREE_BEAM, TreeNode, add_children, best_tree, level_block, next_frontier
from specdraft.errors import SpecdraftError
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.model import Transformer
from specdraft.runtime.tokenizer import Tokenizer
from specdraft.verify.greedy import common_prefix
from specdraft.verify.sampling import SamplingParams, logits_to_probs, sample_rows


@dataclass
class _DraftState:
    """One request's drafting state."""

    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    target_cache: KVCache | None  # the target's cache when the draft shares its prompt keys/values
    target_slot: int
    proposed_at: int = 0  # len(context) when the last proposal was made
    num_proposed: int = 0  # tokens in that proposal (0: none outstanding)
    tree: bool = False  # the last proposal was a tree (its keys were dropped)



class ModelDrafter:
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, model: Transformer, name: str = "draft", exit_layer: int | None = None,
                 max_len: int = 4096, min_confidence: float = 0.0, share_prompt_cache: bool = False,
                 max_batch: int = 1, guesser: NgramDrafter | ModelGuesser | None = None) -> None:
        """share_prompt_cache: the draft is derived from the target's weights (quantized, or its first layers),
        so the target's prompt keys/values are copied instead of running a second prefill. max_batch:
        requests drafted for at once (one slot each in the draft's cache). guesser: the first stage of a
        cascade, whose guesses the draft checks several at a time (chains only)."""
        if not 0.0 <= min_confidence < 1.0:
            raise SpecdraftError("min_confidence must be in [0, 1)")
        self.model = model
        self.name = name
        self.share_prompt_cache = share_prompt_cache
        self.exit_layer = exit_layer
        self.min_confidence = min_confidence
        self.guesser = guesser
        cfg = model.config
        layers = exit_layer or cfg.num_layers
        max_len = min(max_len, cfg.max_position_embeddings)
        self.cache = KVCache(layers, cfg.num_kv_heads, cfg.head_dim, max_len, max_batch, model.dtype, model.device)
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._states: dict[int, _DraftState] = {}

    def add_request(self, request: DraftRequest) -> None:
        if not self._free_slots:
            raise SpecdraftError(f"drafter {self.name!r} serves {self.cache.num_slots} requests at once")
        state = _DraftState(self._free_slots.pop(), request.params, request.generator,
                            request.target_cache if self.share_prompt_cache else None, request.target_slot)
        self._states[request.request_id] = state
        self.cache.reset(state.slot)
        if self.guesser is not None:
            self.guesser.add_request(request)
        # A draft of its own runs the prompt at the first proposal, in one forward with other new requests.
        self._catch_up_from_target(state, len(request.prompt_ids))

    def remove_request(self, request_id: int) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.reset(state.slot)
            self._free_slots.append(state.slot)
            if self.guesser is not None:
                self.guesser.remove_request(request_id)

    def rewind_to(self, request_id: int, fed: Sequence[int], sequence: Sequence[int]) -> None:
        """For a caller that keeps the draft's context itself instead of calling `observe` (a cross-tokenizer
        draft re-encodes it every round, a cascade's model guesser follows its second stage): the slot was
        filled from `fed`; keep the cached part of it that agrees with `sequence`, leaving at least one token
        of `sequence` to feed."""
        state = self._states[request_id]
        cached = self.cache.length(state.slot)
        keep = min(common_prefix(fed[:cached], sequence), len(sequence) - 1)
        self.cache.commit(state.slot, max(0, min(keep, cached)))
        state.num_proposed = 0

    def _catch_up_from_target(self, state: _DraftState, context_len: int) -> None:
        """Copy the target's committed keys/values the draft has not seen (the prompt; the tokens decoded
        while the engine had fallen back to plain decoding) instead of running them through the draft: for
        `self:N` they are exactly what the draft would compute, for `quant:*` the target's own, and a probe
        after a long fallback then costs one draft step instead of a forward over every missed token."""
        if state.target_cache is None:
            return
        start = self.cache.length(state.slot)
        end = min(context_len, state.target_cache.length(state.target_slot), self.cache.max_len)
        if end - start < 2:  # one token is as cheap to feed as to copy
            return
        for mine, theirs in ((self.cache.k, state.target_cache.k), (self.cache.v, state.target_cache.v)):
            for layer, dst in enumerate(mine):
                dst[state.slot, :, start:end] = theirs[layer][state.target_slot, :, start:end]
        self.cache.sync_key_panels(state.slot, start, end)
        self.cache.commit(state.slot, end)

    def _feed(self, states: list[_DraftState], feeds: list[list[int]]) -> torch.Tensor:
        """Run each row's feed (the tokens its slot has not seen) and return the logits after its last token
        [rows, vocab]. All but the last tokens go first, one forward per distinct length (no padding, so no
        row writes past its own context); then the last tokens of every row in one forward."""
        by_length: dict[int, list[int]] = {}
        for row, feed in enumerate(feeds):
            if len(feed) > 1:
                by_length.setdefault(len(feed) - 1, []).append(row)
        for length, rows in by_length.items():
            self.model(torch.tensor([feeds[r][:-1] for r in rows], device=self.model.device), self.cache,
                       slots=[states[r].slot for r in rows], exit_layer=self.exit_layer, logits_from=length - 1)
            for r in rows:
                self.cache.commit(states[r].slot, self.cache.length(states[r].slot) + length)
        logits = self.model(torch.tensor([[feed[-1]] for feed in feeds], device=self.model.device), self.cache,
                            slots=[state.slot for state in states], exit_layer=self.exit_layer)
        for state in states:
            self.cache.commit(state.slot, self.cache.length(state.slot) + 1)
        return logits[:, -1]

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int] | None = None) -> list[Proposal]:
        """Draft for every request at once: each draft step is one forward over all requests still drafting.
        Requests given more nodes than depth get trees, the others chains."""
        nodes = list(max_nodes) if max_nodes is not None else list(max_ks)
        tree_rows = [i for i, (k, n) in enumerate(zip(max_ks, nodes)) if n > k > 0]
        if not tree_rows:
            return self._propose_chains(request_ids, contexts, max_ks)
        chain_rows = [i for i in range(len(request_ids)) if i not in tree_rows]
        out: list[Proposal] = [Proposal([]) for _ in request_ids]
        if chain_rows:
            chains = self._propose_chains([request_ids[i] for i in chain_rows], [contexts[i] for i in chain_rows],
                                          [max_ks[i] for i in chain_rows])
            for i, proposal in zip(chain_rows, chains):
                out[i] = proposal
        trees = self._propose_trees([request_ids[i] for i in tree_rows], [contexts[i] for i in tree_rows],
                                    [max_ks[i] for i in tree_rows], [nodes[i] for i in tree_rows])
        for i, proposal in zip(tree_rows, trees):
            out[i] = proposal
        return out

    def _propose_trees(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]],
                       max_ks: Sequence[int], max_nodes: Sequence[int]) -> list[Proposal]:
        states = [self._states[i] for i in request_ids]
        # Each level but the last feeds up to TREE_BEAM nodes into the slot behind the context.
        depths = [max(0, min(k, (self.cache.max_len - len(ctx) - 1) // TREE_BEAM)) for k, ctx in zip(max_ks, contexts)]
        feeds = []
        for state, context in zip(states, contexts):
            self._catch_up_from_target(state, len(context) - 1)
            feeds.append([int(t) for t in context[self.cache.length(state.slot):]])
            state.proposed_at, state.tree = len(context), True
        first = self._feed(states, feeds)
        logits = {i: first[i:i + 1] for i in range(len(states))}  # per request: [len(frontier), vocab]
        bases = [self.cache.length(state.slot) for state in states]  # == len(context): the tree goes after
        candidates: list[list[TreeNode]] = [[] for _ in states]
        fed: list[list[int]] = [[] for _ in states]  # candidate indices whose keys follow the context, in order
        frontier = [[ROOT] for _ in states]  # nodes whose children `logits` rows hold
        for level in range(1, max(depths, default=0) + 1):
            for i in range(len(states)):
                if level > depths[i]:
                    continue
                log_probs = _tree_log_probs(logits[i], states[i].params)
                for row, parent in enumerate(frontier[i]):
                    add_children(candidates[i], parent, log_probs[row], level, max_nodes[i])
            growing = [i for i in range(len(states)) if level < depths[i]]
            if not growing:
                break
            for i in growing:
                frontier[i] = next_frontier(candidates[i], level)
            block = level_block([candidates[i] for i in growing], [frontier[i] for i in growing],
                                [fed[i] for i in growing], [bases[i] for i in growing])
            rows = self.model(block.tokens, self.cache, slots=[states[i].slot for i in growing],
                              positions=block.positions, tree_mask=block.tree_mask, exit_layer=self.exit_layer,
                              branch_mask=block.branch_mask)
            logits = {}
            for g, i in enumerate(growing):
                n = len(frontier[i])
                self.cache.commit(states[i].slot, self.cache.length(states[i].slot) + n)
                fed[i].extend(frontier[i])
                logits[i] = rows[g, :n]
        for state, base in zip(states, bases):
            self.cache.commit(state.slot, base)  # drop the tree's keys
            state.num_proposed = 0
        return [best_tree(c, n) for c, n in zip(candidates, max_nodes)]

    def _propose_chains(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]],
                        max_ks: Sequence[int]) -> list[Proposal]:
        states = [self._states[i] for i in request_ids]
        limits = [min(k, self.cache.max_len - len(ctx) - 1) for k, ctx in zip(max_ks, contexts)]
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        active = [i for i, k in enumerate(limits) if k > 0]
        feeds: dict[int, list[int]] = {}
        for i in active:
            state, context = states[i], contexts[i]
            self._catch_up_from_target(state, len(context) - 1)
            feeds[i] = [int(t) for t in context[self.cache.length(state.slot):]]
            state.proposed_at = len(context)
        while active:
            guesses = [self._guess(request_ids[i], contexts[i], tokens[i], limits[i] - len(tokens[i]) - 1)
                       for i in active]
            starts = [self.cache.length(states[i].slot) for i in active]
            logits = self._feed_blocks([states[i] for i in active], [feeds[i] for i in active], guesses)
            rows = [row for row, guess in enumerate(guesses) for _ in range(len(guess) + 1)]
            picked, dists = sample_rows(logits, [states[active[r]].params for r in rows],
                                        [states[active[r]].generator for r in rows])
            still, offset = [], 0
            for row, i in enumerate(active):
                guess, block = guesses[row], logits[offset:offset + len(guesses[row]) + 1]
                kept, stopped = 0, False  # positions of this block whose tokens are drafted
                for j in range(len(guess) + 1):
                    token, dist = picked[offset + j], dists[offset + j]
                    if dist is None:  # greedy
                        confidence = float(torch.softmax(block[j].float(), -1)[token]) if self.min_confidence else 1.0
                    else:
                        confidence = float(dist[token])
                    if confidence < self.min_confidence and tokens[i]:
                        stopped = True  # stop this request's draft at its first unsure token (after the first)
                        break
                    tokens[i].append(token)
                    if dist is not None:
                        probs[i].append(dist)
                    kept += 1
                    if len(tokens[i]) == limits[i] or not guess_holds(guess, j, token):
                        break
                offset += len(guess) + 1
                # The slot keeps its feed and the guesses that were drafted; the last drafted token is fed
                # next (after an early stop the slot may hold it already, which `observe` allows for).
                self.cache.commit(states[i].slot, starts[row] + len(feeds[i]) + (kept if stopped else kept - 1))
                feeds[i] = tokens[i][-1:]
                if not stopped and len(tokens[i]) < limits[i]:
                    still.append(i)
            active = still
        proposals = []
        for state, toks, dists in zip(states, tokens, probs):
            state.num_proposed, state.tree = len(toks), False
            # The cache holds context + toks[:-1] (+ the last token too after an early stop; `observe` rolls
            # back to what is known to be kept, so at worst one token is fed again).
            proposals.append(Proposal(toks, torch.stack(dists) if dists else None))
        return proposals

    def _guess(self, request_id: int, context: Sequence[int], drafted: list[int], max_k: int) -> list[int]:
        if self.guesser is None or max_k <= 0:
            return []
        return self.guesser.guess(request_id, context, drafted, max_k)

    def _feed_blocks(self, states: list[_DraftState], feeds: list[list[int]],
                     guesses: list[list[int]]) -> torch.Tensor:
        """Run each row's feed followed by its guesses; returns the logits after the feed's last token and
        after each guess, row after row [sum(1 + len(guess)), vocab]. The slots keep the whole block (the
        caller cuts them back). Without guesses this is `_feed` (no copy); rows with guesses run one forward
        per block length."""
        if not any(guesses):
            return self._feed(states, feeds)
        out: list[torch.Tensor | None] = [None] * len(states)
        plain = [r for r, guess in enumerate(guesses) if not guess]
        if plain:
            logits = self._feed([states[r] for r in plain], [feeds[r] for r in plain])
            for n, r in enumerate(plain):
                out[r] = logits[n:n + 1]
        by_length: dict[int, list[int]] = {}
        for r, guess in enumerate(guesses):
            if guess:
                by_length.setdefault(len(feeds[r]) + len(guess), []).append(r)
        for length, rows in by_length.items():
            first = min(len(feeds[r]) - 1 for r in rows)  # the first row whose logits any of them needs
            logits = self.model(torch.tensor([feeds[r] + guesses[r] for r in rows], device=self.model.device),
                                self.cache, slots=[states[r].slot for r in rows], exit_layer=self.exit_layer,
                                logits_from=first)
            for n, r in enumerate(rows):
                self.cache.commit(states[r].slot, self.cache.length(states[r].slot) + length)
                out[r] = logits[n, len(feeds[r]) - 1 - first:]
        return torch.cat(out)  # type: ignore[arg-type]

    def observe(self, request_id: int, verified: Verified) -> None:
        if self.guesser is not None:
            self.guesser.observe(request_id, verified)
        state = self._states[request_id]
        if not state.num_proposed:  # no chain outstanding (none drafted, or a tree whose keys were dropped):
            return  # the next `propose` feeds what it missed
        kept = state.proposed_at + min(verified.num_accepted, state.num_proposed - 1)
        self.cache.commit(state.slot, min(kept, self.cache.length(state.slot)))
        state.num_proposed = 0


def guess_holds(guess: Sequence[int], position: int, token: int) -> bool:
    """Whether the draft's token at block `position` confirms the guess there, so that the logits at the next
    position (computed after the guess) are the draft's own after `token`."""
    return position < len(guess) and guess[position] == token


def _tree_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scores for growing a tree: the draft's log-probabilities under the request's own sampling rules (a
    one-hot child is accepted with the target's probability of it at that temperature, so the tempered draft
    distribution is the estimate), or plain log-softmax when greedy."""
    if params.greedy:
        return torch.log_softmax(logits.float(), -1)
    return logits_to_probs(logits, params).log()


def tokenizers_match(target: Tokenizer, draft: Tokenizer) -> bool:
    """Whether draft and target give the same ids the same strings (then the draft proposes in the target's
    ids; otherwise it drafts through text, see cross_tokenizer.py). Padded vocabularies (e.g. 151936 vs
    152064) match as long as the shared range agrees."""
    common = min(len(target.hf), len(draft.hf))
    if common < 0.9 * max(len(target.hf), len(draft.hf)):
        return False
    ids = list(range(common))
    return target.hf.convert_ids_to_tokens(ids) == draft.hf.convert_ids_to_tokens(ids)


class ModelGuesser:
    """A draft model as a cascade's first stage (`cascade:A,B` with A `quant:*`, `self:N` or `draft:REF`): it
    guesses, greedily, how the second stage's chain goes on. The second stage keeps only the guesses its own
    draws confirm, so this stage changes how fast B drafts, never what B proposes. Nobody calls its `observe`:
    like a cross-tokenizer draft, it cuts its cache back to the longest prefix that still agrees with the
    sequence it is asked about."""

    def __init__(self, model: ModelDrafter) -> None:
        self.model = model
        self._fed: dict[int, list[int]] = {}  # the sequence each request's draft slot is a prefix of

    def add_request(self, request: DraftRequest) -> None:
        self.model.add_request(replace(request, params=SamplingParams(temperature=0.0), generator=None))
        self._fed[request.request_id] = list(request.prompt_ids)

    def remove_request(self, request_id: int) -> None:
        if self._fed.pop(request_id, None) is not None:
            self.model.remove_request(request_id)

    def observe(self, request_id: int, verified: Verified) -> None:
        """Nothing to keep: `guess` cuts the cache back to what agrees with the sequence it is asked about."""

    def guess(self, request_id: int, context: Sequence[int], drafted: Sequence[int], max_k: int) -> list[int]:
        """Up to max_k tokens after context + drafted (B's committed context and its draft so far)."""
        sequence = [*context, *drafted]
        self.model.rewind_to(request_id, self._fed[request_id], sequence)
        tokens = self.model.propose([request_id], [sequence], [max_k])[0].tokens
        self._fed[request_id] = sequence + tokens
        return tokens
