"""A draft model with a tokenizer of its own (`draft:REF` from another model family): drafting through text.

Two vocabularies share no ids, so the draft never sees the target's tokens. It reads the target's committed
text re-encoded with its own tokenizer, drafts greedily in its own tokens (one `ModelDrafter` forward per
draft token, batched over requests), and its continuation is decoded to text and re-encoded with the
target's tokenizer; those target tokens are the proposal.

Why this is lossless: the proposal is a deterministic function of the committed context, i.e. a one-hot
draft in the target's vocabulary, and the standard rule with a one-hot q is exact (accept x with
probability p(x), otherwise sample from p with x removed and renormalised), so greedy output equals plain
greedy and sampled output follows the target's distribution whatever the draft's tokenizer. The draft's own
probabilities are not used even when the request samples: verifying over the intersection of the two
vocabularies would need a one-to-one map of tokens with equal text, and SmolLM2's 49k byte-level BPE and
Gemma's 262k SentencePiece vocabulary tokenize the same text into different pieces most of the time.

Trees (the engine's `tree`): the draft grows its own top-k tree (`ModelDrafter`, EAGLE-2 style) with twice the
target's node budget, since several of its paths read as the same target tokens; each leaf's path goes
through text as a chain's does, and the paths merge into one trie of target tokens, the draft's best path
first (`tree_from_continuations`). Siblings are distinct target tokens, each a deterministic function of
the context, so the multi-candidate rule for one-hot drafts keeps the target's law.

Boundary cases, each tested in tests/test_cross_tokenizer.py:
- partial words: the target's last committed token may be half a word; the draft context holds the target
  text up to the last word boundary as stable draft ids and re-encodes the unfinished word every round, so
  the draft sees the word as its own tokenizer would split it. When the committed target tokens at the end
  do not re-encode to themselves together with the drafted text (the draft completed a word the target
  started), the drafted text is encoded on its own.
- the drafted text's last word may be cut by the draft's last token: the target token that covers the end
  of the drafted text is dropped (unless the draft ended on its own, at a special token).
- byte tokens: only complete UTF-8 characters pass in either direction (the target's context through
  `StreamDecoder`, the draft's continuation up to its first U+FFFD).
- special tokens: the target's (chat markers, BOS) are not shown to the draft, which gets its own BOS where
  its tokenizer adds one; a draft special token (its EOS, a chat marker) ends the draft.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdraft.drafters.base import ROOT, DraftRequest, Proposal, Verified, node_budgets
from specdraft.drafters.draft_model import ModelDrafter
from specdraft.drafters.ngram import tree_from_continuations
from specdraft.runtime.tokenizer import StreamDecoder, Tokenizer
from specdraft.verify.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
WINDOW = 4  # tokens of context decoded with a continuation to find the continuation's own text
TARGET_TAILS = (3, 2, 1)  # committed target tokens re-encoded with the drafted text, longest first
MAX_DRAFT_PER_TARGET = 3.0  # cap on draft tokens per proposed target token
MAX_PENDING = 128  # characters re-encoded every round at most, when the text has no word boundary


@dataclass
class _CrossState:
    decoder: StreamDecoder  # the target's committed ids -> complete text
    stable_ids: list[int]  # draft ids for the target text up to its last word boundary (BOS first, if any)
    pending: str = ""  # target text after that boundary, re-encoded every round
    seen: int = 0  # target tokens pushed into `decoder`
    fed: list[int] = field(default_factory=list)  # the draft sequence the draft's cache slot is a prefix of
    ratio: float = 1.0  # target tokens per draft token (running estimate)


class CrossTokenizerDrafter:
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, draft: ModelDrafter, draft_tokenizer: Tokenizer, target_tokenizer: Tokenizer,
                 name: str = "draft") -> None:
        self.draft = draft
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.name = name
        self._draft_special = special_ids(draft_tokenizer)
        self._bos = draft_tokenizer.encode("", add_special_tokens=True)
        self._states: dict[int, _CrossState] = {}

    def add_request(self, request: DraftRequest) -> None:
        state = _CrossState(StreamDecoder(self.target_tokenizer), list(self._bos))
        self._advance(state, request.prompt_ids)
        context = self._draft_context(state)
        if request.prompt_ids and len(context) > len(self._bos):
            state.ratio = len(request.prompt_ids) / (len(context) - len(self._bos))
        # The draft always drafts greedily: its proposals must be one-hot (see the module docstring).
        self.draft.add_request(DraftRequest(request.request_id, context, GREEDY, None))
        self._states[request.request_id] = state

    def remove_request(self, request_id: int) -> None:
        if self._states.pop(request_id, None) is not None:
            self.draft.remove_request(request_id)

    def observe(self, request_id: int, verified: Verified) -> None:
        """Nothing to keep: the next `propose` re-reads the committed context, and the draft's cache is cut
        back to what still agrees with it."""

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int] | None = None) -> list[Proposal]:
        """Chains, and trees for requests given more nodes than depth: the draft grows its own tree, each of
        its leaves' paths becomes target tokens through text, and the paths are merged into one trie (its
        siblings are distinct tokens, each a deterministic function of the context: one-hot drafts still)."""
        budgets = node_budgets(self, request_ids, max_nodes)
        out = [Proposal([]) for _ in request_ids]
        rows, draft_contexts, draft_ks, draft_nodes = [], [], [], []
        for i, (rid, context, k) in enumerate(zip(request_ids, contexts, max_ks)):
            state = self._states[rid]
            self._advance(state, context)
            draft_context = self._draft_context(state)
            if k <= 0 or not draft_context:
                continue
            # The draft's cache keeps what still agrees with the new context; at least one token is fed.
            self.draft.rewind_to(rid, state.fed, draft_context)
            rows.append(i)
            draft_contexts.append(draft_context)
            draft_ks.append(min(math.ceil((k + 1) / state.ratio), math.ceil(MAX_DRAFT_PER_TARGET * (k + 1))))
            budget = budgets[i]
            draft_nodes.append(max(2 * budget, draft_ks[-1] + 1) if budget is not None and budget > k else draft_ks[-1])
        if not rows:
            return out
        drafts = self.draft.propose([request_ids[i] for i in rows], draft_contexts, draft_ks, draft_nodes)
        for i, draft_context, draft in zip(rows, draft_contexts, drafts):
            state = self._states[request_ids[i]]
            if not draft.is_chain:  # the draft's cache holds the context only: the tree's keys were dropped
                state.fed = list(draft_context)
                out[i] = self._tree_to_target(contexts[i], draft_context, draft, max_ks[i], budgets[i])
                continue
            state.fed = draft_context + draft.tokens
            tokens = self._to_target(contexts[i], draft_context, draft.tokens)
            if draft.tokens and tokens:
                state.ratio = 0.75 * state.ratio + 0.25 * max(0.2, len(tokens) / len(draft.tokens))
            out[i] = Proposal(tokens[:max_ks[i]])
        return out

    def _advance(self, state: _CrossState, context: Sequence[int]) -> None:
        """Append the target's newly committed tokens to the draft-side text; the text up to the last word
        boundary becomes stable draft ids, the unfinished word stays pending."""
        if len(context) > state.seen:
            state.pending += state.decoder.push(context[state.seen:])
            state.seen = len(context)
        cut = word_boundary(state.pending)
        if cut == 0 and len(state.pending) > MAX_PENDING:  # text without spaces (CJK, long identifiers)
            cut = len(state.pending) - MAX_PENDING // 4
        if cut > 0:
            state.stable_ids += self.draft_tokenizer.encode(state.pending[:cut], add_special_tokens=False)
            state.pending = state.pending[cut:]

    def _draft_context(self, state: _CrossState) -> list[int]:
        if not state.pending:
            return list(state.stable_ids)
        return state.stable_ids + self.draft_tokenizer.encode(state.pending, add_special_tokens=False)

    def _tree_to_target(self, context: Sequence[int], draft_context: Sequence[int], draft: Proposal, max_k: int,
                        max_nodes: int) -> Proposal:
        """The draft's tree in target tokens: each leaf's path through text (an inner node's text is a prefix
        of its leaves'), the draft's own best path first (first children all the way), merged by
        `tree_from_continuations` into at most `max_nodes` nodes, `max_k` deep."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(draft.parents):
            children.setdefault(parent, []).append(node)
        best, node = [], ROOT
        while node in children:
            node = children[node][0]
            best.append(node)
        leaves = [best[-1]] + [n for n in range(len(draft.tokens)) if n not in children and n != best[-1]]
        paths = []
        for leaf in leaves:
            path, node = [], leaf
            while node != ROOT:
                path.append(draft.tokens[node])
                node = draft.parents[node]
            tokens = self._to_target(context, draft_context, path[::-1])[:max_k]
            if tokens:
                paths.append((tokens, 1.0))
        return tree_from_continuations(paths, max_nodes)

    def _to_target(self, context: Sequence[int], draft_context: Sequence[int], draft_tokens: list[int]) -> list[int]:
        """The drafted continuation as target tokens that follow `context`."""
        ended = False  # the draft stopped by itself (a special token), so its last word is complete
        for n, token in enumerate(draft_tokens):
            if token in self._draft_special:
                draft_tokens, ended = draft_tokens[:n], True
                break
        text = continuation_text(self.draft_tokenizer, draft_context[-WINDOW:], draft_tokens)
        if not text:
            return []
        tokens = target_continuation(self.target_tokenizer, context, text)
        return tokens if ended else tokens[:-1]


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids a tokenizer treats as special (skipped when decoding): EOS, BOS, chat markers."""
    ids = set(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        ids.update(int(i) for i in hf.all_special_ids)
        ids.update(int(i) for i, added in hf.added_tokens_decoder.items() if added.special)
    return frozenset(ids)


def word_boundary(text: str) -> int:
    """Where the last (possibly unfinished) word of `text` begins, with the whitespace before it: word pieces
    in both SentencePiece and byte-level BPE start with their space. 0 when the text is one word."""
    end = len(text)
    while end > 0 and not text[end - 1].isspace():
        end -= 1
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return end


def continuation_text(tokenizer: Tokenizer, window: Sequence[int], tokens: Sequence[int]) -> str:
    """The text `tokens` add after `window` (decoded together, since some tokenizers drop or merge spaces at
    the start of a decode), up to the first incomplete or invalid character."""
    if not tokens:
        return ""
    before = tokenizer.decode(list(window))
    after = tokenizer.decode(list(window) + list(tokens))
    text = after[len(before):] if after.startswith(before) else tokenizer.decode(list(tokens))
    bad = text.find("\ufffd")
    return text if bad < 0 else text[:bad]


def target_continuation(tokenizer: Tokenizer, context: Sequence[int], text: str) -> list[int]:
    """Target tokens for `text` following the committed `context`: the last few committed tokens are encoded
    together with the text (so the first new word is split as the target splits it after them) and kept only
    if they come back unchanged; otherwise the text is encoded on its own."""
    for tail in TARGET_TAILS:
        if len(context) < tail:
            continue
        tail_ids = [int(t) for t in context[-tail:]]
        tail_text = tokenizer.decode(tail_ids)
        if not tail_text or "\ufffd" in tail_text:
            continue
        ids = tokenizer.encode(tail_text + text, add_special_tokens=False)
        if ids[:tail] == tail_ids:
            return ids[tail:]
    return tokenizer.encode(text, add_special_tokens=False)
