"""The engine core: many requests, one target, one propose -> verify -> accept round per `step`.

Each request carries all of its own state (`Request`): context, output assembly and stopping, sampling
parameters with its own random generator, the adaptive draft-length controller, metrics and a KV-cache slot.
`Engine.step(requests)` advances the given requests by one round: new requests get their prefill (one
prompt forward per step, which yields the first token); once none is left waiting, every other request's
drafter proposes, one batched target forward scores all proposals (ragged lengths over the slot KV cache,
padded to the longest), and each request accepts on its own. `stream` and `generate` are thin loops over
`step`; `generate_many` keeps up to `max_batch` requests in flight, admitting new ones as others finish
(continuous batching).

Invariant per request: the target's KV cache slot holds the whole context except its last token (the
pending one), which is fed to the next forward together with the draft tokens. After verification the
pending token and the accepted draft tokens are committed; the target's correction/bonus token becomes the
new pending token. Padding rows write keys past the committed length, which are stale by construction.

A proposal may be a token tree (`tree` > 0): it is verified in the same forward, each node at its depth's
position and seeing only its ancestors (`tree_mask`); afterwards the cache keeps just the accepted path,
moved up behind the pending token (`KVCache.compact`), so nothing is recomputed. Verification walks the tree
(verify/tree.py): greedy takes the branch that matches the target's argmax, sampling uses multi-candidate
rejection sampling. With adaptation each request picks, per round, a chain or a tree of a few sizes by
measured tokens per second (`TreeShapeChooser`). A tree has at most MAX_TREE_NODES tokens, so that its block
stays within the fused kernels' row-invariant size.

Row invariance of the runtime (a token's logits do not depend on the block or batch it is scored in, bit for
bit in bf16 on the fused CPU path) makes a request's greedy output the same alone or beside others. It also
makes cache entries reusable: a prompt that starts like one a slot still holds (a system prompt, the earlier
turns of a conversation) copies those entries instead of computing them (`_reuse_prefix`), with the same
output token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specdraft.drafters.base import ROOT, Drafter, DraftRequest, Proposal, Verified
from specdraft.engine.adaptive import (
    CALIBRATED_AFTER,
    AdaptiveConfig,
    BatchPlanner,
    DraftCostMemory,
    DraftLengthController,
    TreeShapeChooser,
)
from specdraft.engine.metrics import SpecMetrics
from specdraft.engine.stopping import OutputAssembler
from specdraft.errors import ContextOverflowError, InvalidParameterError, SpecdraftError
from specdraft.runtime import cpu_kernels
from specdraft.runtime.fused import SMALL_BATCH_ROWS
from specdraft.runtime.model import PREFILL_CHUNK_TOKENS, Transformer
from specdraft.runtime.tokenizer import Tokenizer
from specdraft.verify.batch import verify_batch
from specdraft.verify.greedy import argmax, common_prefix, for_reduction, topk_indices
from specdraft.verify.logprobs import TokenLogprobs, position_logprobs
from specdraft.verify.penalties import node_paths, penalize_rows_
from specdraft.verify.sampling import SamplingParams, sample_rows
from specdraft.verify.tree import tree_attention_mask

# Where each emitted token came from (for --show-drafts and the metrics).
TARGET, DRAFT, CORRECTION, BONUS = "target", "draft", "correction", "bonus"
MAX_DRAFT_TOKENS = 64
# Nodes of a token tree: with the pending token a tree is one block of at most SMALL_BATCH_ROWS tokens, the
# size up to which the fused kernels give every row the bits it gets alone (greedy stays bit-identical).
MAX_TREE_NODES = SMALL_BATCH_ROWS - 1

# A prompt copies the cache entries of an earlier prompt's start it shares (`Engine._reuse_prefix`) from this
# many tokens on: below it the copy's fixed cost is about what computing them costs.
MIN_REUSED_PREFIX = 8
# Prompt logprobs: a prompt's rows are put through the output layer and scored in blocks of at most this many
# bytes of logits (SmolLM2: 1,280 rows; Gemma 3: 256), not all at once.
PROMPT_LOGITS_BYTES = 256 << 20


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: SpecMetrics
    origins: list[str] = field(default_factory=list)
    adaptation_log: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, where the params asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (None for the first)


@dataclass
class StreamChunk:
    """What one step produced for one request; `result` is set on the request's last chunk."""

    request_id: int
    text: str
    token_ids: list[int]
    origins: list[str]
    result: GenerationResult | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, where the params asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the prompt's chunk, where asked for


@dataclass
class Request:
    """Everything one request owns; the engine keeps nothing per request outside it."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    out: OutputAssembler
    controller: DraftLengthController
    shapes: TreeShapeChooser | None  # chain or tree, per round (None: chains only)
    metrics: SpecMetrics
    slot: int
    started_at: float
    context: list[int] = field(default_factory=list)  # prompt + emitted tokens (the last one is pending)
    origins: list[str] = field(default_factory=list)
    prefilled: bool = False
    drafting: bool = False  # registered with the drafter
    holds_slot: bool = True  # until released (the slot may then serve another request)
    result: GenerationResult | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per emitted token, where the params ask for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (None for the first)

    @property
    def finished(self) -> bool:
        return self.out.finished


class Engine:
    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 5,
        adaptive: AdaptiveConfig | None = None,
        max_model_len: int | None = None,
        max_batch: int = 1,
        tree: int = 0,
    ) -> None:
        """max_model_len: prompt + output limit per request (clamped to the model's own context; default
        4096). max_batch: requests in flight at once (one KV-cache slot each). tree: at most this many draft
        tokens per round as a token tree (0: chains); `num_speculative_tokens` bounds its depth. With
        `adaptive`, each request chooses per round between a chain and trees of up to `tree` nodes by
        measured speed."""
        if not isinstance(num_speculative_tokens, int) or not 0 <= num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise SpecdraftError(f"num_speculative_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}], "
                                 f"got {num_speculative_tokens!r}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise SpecdraftError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(tree, int) or isinstance(tree, bool) or not 0 <= tree <= MAX_TREE_NODES:
            raise SpecdraftError(f"tree must be an integer in [0, {MAX_TREE_NODES}] (draft tokens per tree; 0 = "
                                 f"chains), got {tree!r}")
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive if adaptive is not None else AdaptiveConfig()
        self.max_model_len = context_limit(target, max_model_len)
        self.max_batch = max_batch
        self.tree = tree if self.drafter is not None else 0
        # Every request's chain/tree measurements also feed this one, from which new requests start.
        self.shapes = TreeShapeChooser(self.tree, self.adaptive.window) if self.tree and self.adaptive.enabled \
            else None
        # Batched rounds: each one's drafts are planned from what earlier ones measured.
        self.planner = BatchPlanner(self.adaptive.window) \
            if self.drafter is not None and self.adaptive.enabled else None
        # The draft's measured cost, carried from finished requests to new ones.
        self.draft_costs = DraftCostMemory()
        # Room past any request's own limit for the padding of a batched verification block.
        self.cache = target.new_cache(self.max_model_len + max(num_speculative_tokens, self.tree) + 1, max_batch)
        self._free_slots = list(range(max_batch))  # least recently released first (`_take_slot`)
        # Slot -> the tokens whose cache entries the slot still holds intact (its request's prompt, then its
        # whole context once it finished), for later prompts that start with them (`_reuse_prefix`).
        self._cached_tokens: dict[int, list[int]] = {}
        self._next_id = 0
        self.totals = SpecMetrics()

    # ------------------------------------------------------------------------------------------ requests

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if len(prompt_ids) == 0:
            raise SpecdraftError("empty prompt: give at least one token of input")
        vocab = self.target.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt_ids):
            raise SpecdraftError("prompt token ids must be integers")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise SpecdraftError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParameterError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}")
        if params.prediction and not isinstance(params.prediction, str) and max(params.prediction) >= vocab:
            raise InvalidParameterError(f"prediction token ids must be in [0, {vocab}), got {max(params.prediction)}")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_model_len:
            raise ContextOverflowError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Validate and admit a request (it holds a KV-cache slot until it finishes or is released)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params)
        if not self._free_slots:
            raise SpecdraftError(f"all {self.max_batch} slots are busy: wait for a request to finish")
        if isinstance(params.prediction, str):  # drafters read token ids: the text as the output would spell it
            params = replace(params, prediction=self.tokenizer.encode(params.prediction, add_special_tokens=False))
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        request = Request(
            id=self._next_id, prompt_ids=prompt_ids, params=params, generator=generator,
            out=OutputAssembler(self.tokenizer, params),
            controller=DraftLengthController(self.num_speculative_tokens, self.adaptive, self.draft_costs),
            shapes=self.shapes.fork() if self.shapes is not None else None,
            metrics=SpecMetrics(prompt_tokens=len(prompt_ids)), slot=self._take_slot(prompt_ids),
            started_at=time.perf_counter(), logprobs=None if params.logprobs is None else [])
        self._next_id += 1
        self.cache.reset(request.slot)
        return request

    def _take_slot(self, prompt_ids: list[int]) -> int:
        """A free slot for a new request, overwriting as few reusable cache entries as it can: a slot whose
        entries all start the prompt (the conversation's last turn: reused where they are, nothing lost), the
        longest such; else the slot released longest ago. The slot released last would be the worst choice:
        with several clients, another client's request took the slot a conversation had just finished its
        turn in before that conversation's next turn came (an empty slot holds nothing, so it comes first)."""
        at, longest = 0, -1
        for i, slot in enumerate(self._free_slots):
            cached = self._cached_tokens.get(slot, ())
            if len(cached) > longest and common_prefix(cached, prompt_ids) == len(cached):
                at, longest = i, len(cached)
        return self._free_slots.pop(at)

    def release(self, request: Request) -> None:
        """Free the request's slot and drafter state (at its end, or when its client goes away)."""
        if request.drafting:
            self.drafter.remove_request(request.id)
            request.drafting = False
        if request.holds_slot:
            request.holds_slot = False
            if request.prefilled and request.slot in self._cached_tokens:  # its entries stay until overwritten
                self._cached_tokens[request.slot] = request.context[:self.cache.length(request.slot)]
            self.cache.reset(request.slot)
            self._free_slots.append(request.slot)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def prefix_snapshot(self) -> dict[int, list[int]]:
        """Which tokens' cache entries each slot holds for later prompts to reuse (see `_reuse_prefix`)."""
        return {slot: list(tokens) for slot, tokens in self._cached_tokens.items()}

    def restore_prefixes(self, snapshot: dict[int, list[int]]) -> None:
        """Offer later prompts no more than `snapshot` offered: each slot keeps only the start its tokens share
        with what it held then (those entries are still the same bits; `{}` forgets every prefix). A benchmark
        repeating a prompt calls this so that no repeat reuses the prompt an earlier repeat left behind."""
        for slot, tokens in list(self._cached_tokens.items()):
            kept = common_prefix(tokens, snapshot.get(slot, []))
            if kept:
                self._cached_tokens[slot] = tokens[:kept]
            else:
                del self._cached_tokens[slot]

    # ------------------------------------------------------------------------------------------ stepping

    def step(self, requests: Sequence[Request]) -> list[StreamChunk]:
        """Advance the requests by one round; one chunk per request, in order. A request that finishes in
        this round gets its `GenerationResult` on its chunk and its slot released.

        New requests are prefilled one forward (`_prefill_groups`) per step, and the decode round of the
        others runs in the step that prefills the last of them: the same forwards as prefilling them all
        first, but a wave of arrivals gets each first token as soon as its own prompt is done (8 clients
        arriving together: median time to first token 251 -> 158 ms), not after every prompt of the wave."""
        live = [r for r in requests if not r.finished]
        chunks: dict[int, StreamChunk] = {}
        groups = _prefill_groups([r for r in live if not r.prefilled])
        if groups:
            chunks.update(self._prefill(groups[0]))
        decoding = [r for r in live if r.prefilled and r.id not in chunks]
        if decoding and len(groups) <= 1:
            chunks.update(self._decode_round(decoding))
        out = []
        for r in requests:
            chunk = chunks.get(r.id) or StreamChunk(r.id, "", [], [])
            if r.finished and r.result is None:
                chunk.text += r.out.take_delta()
                chunk.result = self._finish(r)
            out.append(chunk)
        return out

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StreamChunk]:
        request = self.add_request(prompt_ids, params)
        try:
            while not request.finished:
                yield from self.step([request])
        finally:
            self.release(request)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        for chunk in self.stream(prompt_ids, params):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")

    def generate_many(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                      on_result: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Every prompt, up to `max_batch` at a time (admitted as others finish); results in input order.
        All requests are validated before any runs, so a bad one cannot leave half a batch done. `on_result`
        hears of each result (its input position and it) as it finishes: a long run's progress."""
        if len(prompts) != len(params):
            raise SpecdraftError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for ids, p in zip(prompts, params):
            self.validate(ids, p)
        waiting = list(range(len(prompts)))[::-1]
        results: list[GenerationResult | None] = [None] * len(prompts)
        active: dict[int, Request] = {}  # request id -> request
        index: dict[int, int] = {}  # request id -> input position
        try:
            while waiting or active:
                while waiting and self._free_slots:
                    i = waiting.pop()
                    request = self.add_request(prompts[i], params[i])
                    active[request.id], index[request.id] = request, i
                for chunk in self.step(list(active.values())):
                    if chunk.result is not None:
                        results[index[chunk.request_id]] = chunk.result
                        del active[chunk.request_id]
                        if on_result is not None:
                            on_result(index[chunk.request_id], chunk.result)
        finally:
            for request in active.values():
                self.release(request)
        return results

    # ------------------------------------------------------------------------------------------ rounds

    def _prefill(self, requests: Sequence[Request]) -> dict[int, StreamChunk]:
        """The prompts' forward (one for prompts of equal length): yields each request's first token and
        registers it with the drafter."""
        hidden_layers = self.drafter.hidden_layers if self.drafter is not None else ()
        length = len(requests[0].prompt_ids)
        t0 = time.perf_counter()
        exact = self.target.reuses_cache_entries(self.cache, length)
        # Prompt logprobs need every prompt row's logits: nothing reused, no row left out of the head.
        every_row = any(r.params.prompt_logprobs is not None for r in requests)
        reused = self._reuse_prefix(requests[0]) if exact and len(requests) == 1 and not every_row else 0
        if every_row:
            logits, final, captured, capture = self._scored_prompt_forward(requests, hidden_layers)
        else:
            logits, final, captured, capture = self._score([r.prompt_ids[reused:] for r in requests], requests,
                                                           length - reused - 1, hidden_layers)
        prefill_time = time.perf_counter() - t0
        for r in requests:
            r.metrics.prompt_tokens_cached = reused
            if exact:
                self._cached_tokens[r.slot] = r.prompt_ids
            else:
                self._cached_tokens.pop(r.slot, None)
        chunks = {}
        last = _adjusted(logits[:, -1:], requests)[:, 0]
        firsts, _ = sample_rows(last, [r.params for r in requests], [r.generator for r in requests])
        for b, (r, first) in enumerate(zip(requests, firsts, strict=True)):
            self.cache.commit(r.slot, length)
            r.metrics.prefill_time = prefill_time
            r.prefilled = True
            r.context = r.prompt_ids + [first]
            r.out.add(first)
            r.origins.append(TARGET)
            logprobs = None
            if r.logprobs is not None:
                logprobs = position_logprobs(logits[b, -1:], [first], r.params.logprobs)
                r.logprobs.extend(logprobs)
            if self.drafter is not None and not r.finished:
                t = time.perf_counter()
                prompt_hidden = self._hidden(hidden_layers, capture, captured, final, b)
                self.drafter.add_request(DraftRequest(r.id, r.prompt_ids, r.params, r.generator, self.cache,
                                                      r.slot, prompt_hidden))
                r.drafting = True
                r.metrics.draft_time += time.perf_counter() - t
            chunks[r.id] = StreamChunk(r.id, r.out.take_delta(), [first], [TARGET], logprobs=logprobs,
                                       prompt_logprobs=r.prompt_logprobs)
        if self.planner is not None:
            self.planner.prompt_forward()
        return chunks

    def _scored_prompt_forward(self, requests: Sequence[Request], hidden_layers: Sequence[int]
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple[int, ...]]:
        """The prompts' forward with every row's logits, for `prompt_logprobs`: in blocks of rows whose logits
        stay within PROMPT_LOGITS_BYTES, each block scored as it comes (into `r.prompt_logprobs`) and let go,
        so a long prompt over a large vocabulary never holds prompt length x vocabulary logits at once
        (Gemma 3, 3,000 tokens: 1.6 GB in bf16). Blocks are whole multiples of the runtime's own prefill
        chunk, which the fused kernels already run a prompt in: the same bits as one forward. Returns what
        `_score` returns for the last row's logits and the drafter's hidden states of every row."""
        length = len(requests[0].prompt_ids)
        row_bytes = len(requests) * self.target.config.vocab_size * 4  # fp32 at most
        rows = max(1, PROMPT_LOGITS_BYTES // row_bytes // PREFILL_CHUNK_TOKENS) * PREFILL_CHUNK_TOKENS
        for r in requests:
            r.prompt_logprobs = [None] if r.params.prompt_logprobs is not None else None
        parts = []
        for lo in range(0, length, rows):
            hi = min(length, lo + rows)
            logits, *hidden = self._score([r.prompt_ids[lo:hi] for r in requests], requests, 0, hidden_layers)
            for b, r in enumerate(requests):
                if r.prompt_logprobs is not None:  # row i predicts token i + 1 (the last row: the first output)
                    targets = r.prompt_ids[lo + 1:hi + 1]
                    r.prompt_logprobs += position_logprobs(logits[b, :len(targets)], targets,
                                                           r.params.prompt_logprobs)
                self.cache.commit(r.slot, hi)  # the next block sees this one (`_prefill` commits the whole)
            parts.append((logits[:, -1:].clone(), *hidden))  # a copy: a view would keep the block's logits
        final, captured, capture = parts[-1][1:]
        if len(parts) > 1 and final is not None:
            final = torch.cat([p[1] for p in parts], dim=1)
        if len(parts) > 1 and captured is not None:
            captured = torch.cat([p[2] for p in parts], dim=2)
        return parts[-1][0], final, captured, capture

    def _reuse_prefix(self, r: Request) -> int:
        """Put in r's slot the longest start of its prompt whose cache entries a slot still holds (a shared
        system prompt, the earlier turns of a conversation), copied unless they are already there; returns
        its length (0: none). Called only where those entries are the bits r's own prefill would write
        (`reuses_cache_entries`: the output stays the same token for token); nothing is reused for a drafter
        that reads target features of the prompt. The last prompt token is always computed, for its logits."""
        prompt = r.prompt_ids
        if self.drafter is not None and self.drafter.hidden_layers:
            return 0
        best, source = 0, r.slot
        for slot, tokens in self._cached_tokens.items():
            n = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if n > best or (n == best and slot == r.slot):
                best, source = n, slot
        if best < MIN_REUSED_PREFIX:
            return 0
        if source == r.slot:
            self.cache.commit(r.slot, best)
        else:
            self.cache.copy_prefix(source, r.slot, best)
        return best

    def _decode_round(self, requests: Sequence[Request]) -> dict[int, StreamChunk]:
        drafter = self.drafter
        t0 = time.perf_counter()
        budgets = [self._draft_budget(r) for r in requests]
        shadows: list[int] = []
        batched = len(requests) > 1 and self.planner is not None
        # The cached tokens the round's requests attend to: the planner's costs are kept per class of it.
        context = sum(len(r.context) for r in requests) if batched else 0
        if batched and any(depth for depth, _, _ in budgets):
            budgets, shadows = self._plan_batch(requests, budgets, context)
        drafting = [b for b, (depth, _, _) in enumerate(budgets) if depth > 0]
        asked = sum(budgets[b][0] for b in drafting)
        proposals = [Proposal([]) for _ in requests]
        if drafting:
            drafted = drafter.propose([requests[b].id for b in drafting], [requests[b].context for b in drafting],
                                      [budgets[b][0] for b in drafting], [budgets[b][1] for b in drafting])
            for b, proposal in zip(drafting, drafted, strict=True):
                proposals[b] = proposal.truncated(*budgets[b][:2])
        shadow_tokens = {b: proposals[b].tokens[:1] for b in shadows}
        for b in shadows:
            proposals[b], budgets[b] = Proposal([]), (0, 0, None)
        # One draft call serves the whole round: each request is charged what the round's drafting cost.
        draft_time = time.perf_counter() - t0

        hidden_layers = drafter.hidden_layers if drafter is not None else ()
        width = 1 + max(len(p) for p in proposals)
        rows = [[r.context[-1], *p.tokens] + [r.context[-1]] * (width - 1 - len(p))
                for r, p in zip(requests, proposals)]
        starts = [self.cache.length(r.slot) for r in requests]
        positions, tree_mask = _tree_layout(proposals, starts, width)
        t1 = time.perf_counter()
        raw, final, captured, capture = self._score(rows, requests, 0, hidden_layers, positions, tree_mask,
                                                    [1 + len(p) for p in proposals])
        logits = _adjusted(raw, requests, proposals)
        greedy = [r.params.greedy for r in requests]
        target_argmax = _target_argmax(logits) if any(greedy) else None  # all that greedy rows read
        if not all(greedy):
            logits = for_reduction(logits)  # once (exact): sampling and the drafter's top-k both reduce these
        accepted, emitted = verify_batch([p.tokens for p in proposals], [p.draft_probs for p in proposals],
                                         logits, [r.params for r in requests], [r.generator for r in requests],
                                         [p.parents for p in proposals], target_argmax)
        verify_time = time.perf_counter() - t1
        # What the drafter recycles of the target's work (its cost is the drafter's, booked with `observe`).
        t2 = time.perf_counter()
        topk = getattr(drafter, "target_topk", 0) if drafter is not None else 0
        top = _target_topk(logits, topk) if topk else None
        topk_time = time.perf_counter() - t2

        if self.planner is not None:
            if len(requests) > 1:
                self._learn_from_batch(requests, proposals, accepted, emitted, shadow_tokens, asked, draft_time,
                                       context, verify_time)
            else:
                self.planner.lone_round()
        chunks = {}
        for b, (r, proposal) in enumerate(zip(requests, proposals)):
            start, path = starts[b], accepted[b]
            if path == list(range(len(path))):  # a prefix of the block: keep it where it is
                self.cache.commit(r.slot, start + 1 + len(path))
            else:  # a path through a tree: move its keys and values up behind the pending token
                self.cache.compact(r.slot, [0] + [1 + i for i in path])
            logprobs = None
            if r.logprobs is not None:  # token i was chosen from the row of the node before it on the path
                chosen_from = [0, *(1 + node for node in path)][:len(emitted[b])]
                logprobs = position_logprobs(raw[b, chosen_from], emitted[b], r.params.logprobs)
            chunks[r.id] = self._accept(r, proposal, path, emitted[b], draft_time if budgets[b][0] else 0.0,
                                        verify_time, budgets[b][2], logprobs)
            if r.drafting and not r.finished:
                scored = rows[b][:1 + len(proposal)]
                hidden = self._hidden(hidden_layers, capture, captured, final, b, len(scored))
                t = time.perf_counter()
                depths = [0] + proposal.depths
                drafter.observe(r.id, Verified(scored, [start + d for d in depths], path, emitted[b], r.context,
                                               hidden, list(proposal.parents),
                                               None if top is None else top[b, :len(scored)]))
                r.metrics.draft_time += time.perf_counter() - t + topk_time
        if batched:  # what the round's plan produced, all its costs included
            self.planner.check(len(requests), any(len(p) for p in proposals), sum(len(tokens) for tokens in emitted),
                               time.perf_counter() - t0)
        return chunks

    def _plan_batch(self, requests: Sequence[Request], budgets: list[tuple[int, int, int | None]], context: int
                    ) -> tuple[list[tuple[int, int, int | None]], list[int]]:
        """The budgets of a batched round cut to what the planner says pays for the batch, and the requests
        to shadow-draft one token for."""
        planned = self.planner.plan([r.controller.alpha for r in requests], [depth for depth, _, _ in budgets],
                                    context=context)
        # A cheap drafter still proposes one token for the requests the plan leaves out: checked against the
        # token the target emits, it keeps their acceptance current at no cost to the forward.
        cheap = self.draft_costs.cheap
        shadows = [b for b, r in enumerate(requests)
                   if budgets[b][0] and not planned[b] and (cheap or r.controller.cheap)]
        shadowed = set(shadows)
        budgets = [(1, 1, None) if b in shadowed else _cut_budget(budget, depth)
                   for b, (budget, depth) in enumerate(zip(budgets, planned))]
        return budgets, shadows

    def _learn_from_batch(self, requests: Sequence[Request], proposals: Sequence[Proposal],
                          accepted: Sequence[list[int]], emitted: Sequence[list[int]],
                          shadow_tokens: dict[int, list[int]], asked: int, draft_time: float, context: int,
                          verify_time: float) -> None:
        """Book what a batched round measured with the planner (its forward's rows and cost, what its plan's
        drafts expected and got, the draft's cost for `asked` tokens, shadows included), and the shadow
        drafts' hits with their requests."""
        counted = [b for b, (r, p) in enumerate(zip(requests, proposals))
                   if len(p) and r.controller.observed >= CALIBRATED_AFTER]
        expected = sum(requests[b].controller.alpha ** j for b in counted
                       for j in range(1, max(proposals[b].depths) + 1)) if counted else None
        computed = sum(1 + len(p) for p in proposals)
        self.planner.learn(computed, verify_time, plain=computed == len(requests), expected=expected,
                           accepted=sum(len(accepted[b]) for b in counted), asked=asked, draft_seconds=draft_time,
                           context=context)
        for b, tokens in shadow_tokens.items():
            if tokens:  # a lookup that found nothing says nothing about acceptance
                requests[b].controller.observe_shadow(tokens[0] == emitted[b][0])

    def _draft_budget(self, r: Request) -> tuple[int, int, int | None]:
        """(depth, nodes, shape) of the request's next draft: depth 0 is a plain round; shape is the
        `TreeShapeChooser` arm taken (None without one)."""
        if self.drafter is None:
            return 0, 0, None
        remaining = r.params.max_tokens - len(r.out.token_ids)
        room = self.max_model_len - self.cache.length(r.slot) - 1
        depth = max(0, min(r.controller.next_k(), remaining - 1, room))
        if depth == 0:
            return 0, 0, None
        shape = r.shapes.choose() if r.shapes is not None else None
        nodes = min(self.tree if shape is None else shape, room)
        if nodes == 0:  # a chain
            return depth, depth, shape
        if r.controller.cheap:
            # A cheap drafter's tree costs its nodes, not its depth: let it place them as deep as it likes.
            depth = max(0, min(r.controller.max_k, remaining - 1, room))
        return min(depth, nodes), nodes, shape

    def _accept(self, r: Request, proposal: Proposal, path: list[int], new_tokens: list[int], draft_time: float,
                verify_time: float, shape: int | None = None,
                logprobs: list[TokenLogprobs] | None = None) -> StreamChunk:
        """Book one verified round (`path`: the accepted nodes of the proposal, root first): metrics, the
        controller, and the emitted tokens up to any stop (with their `logprobs`, where asked for: one per new
        token)."""
        num_accepted = len(path)
        nodes = len(proposal) if len(proposal) and not proposal.is_chain else None
        drafted = max(proposal.depths, default=0)
        r.metrics.record_round(drafted, num_accepted, nodes)
        if proposal.predicted is not None:
            r.metrics.prediction_drafted += sum(proposal.predicted)
            r.metrics.prediction_accepted += sum(proposal.predicted[node] for node in path)
        r.metrics.draft_time += draft_time
        r.metrics.verify_time += verify_time
        if self.drafter is not None:
            r.controller.update(drafted, num_accepted, draft_time, verify_time, nodes)
            if drafted and shape is not None:
                r.shapes.update(shape, num_accepted + 1, draft_time + verify_time)
                self.shapes.update(shape, num_accepted + 1, draft_time + verify_time)
            if not drafted:
                r.metrics.fallback_rounds += int(r.controller.in_fallback)
        last = CORRECTION if num_accepted < drafted else BONUS if drafted else TARGET
        round_origins = [DRAFT] * num_accepted + [last]
        emitted = []
        for token, origin in zip(new_tokens, round_origins, strict=True):
            r.out.add(token)
            emitted.append(token)
            r.origins.append(origin)
            if r.out.finished:
                break
        r.context.extend(new_tokens)
        if logprobs is not None:
            logprobs = logprobs[:len(emitted)]
            r.logprobs.extend(logprobs)
        return StreamChunk(r.id, r.out.take_delta(), emitted, round_origins[:len(emitted)], logprobs=logprobs)

    def _finish(self, r: Request) -> GenerationResult:
        m = r.metrics
        m.generated_tokens = len(r.out.token_ids)
        m.fallback_events = r.controller.fallback_events
        self.draft_costs.record(r.controller)
        m.total_time = time.perf_counter() - r.started_at
        self.totals = self.totals.merge(m)
        r.result = GenerationResult(r.prompt_ids, r.out.token_ids, r.out.text, r.out.finish_reason, m, r.origins,
                                    r.controller.log, r.logprobs, r.prompt_logprobs)
        self.release(r)
        return r.result

    def _score(self, rows: list[list[int]], requests: Sequence[Request], logits_from: int,
               hidden_layers: Sequence[int], positions: torch.Tensor | None = None,
               tree_mask: torch.Tensor | None = None, lengths: Sequence[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple[int, ...]]:
        """One target forward over `rows` (one per request, in its slot): logits from `logits_from` on, and
        what the drafter's `hidden_layers` need: the final-normed hidden states of those rows (-1) and the
        residual stream after the named layers (all rows), with the captured layer list. `lengths`: each
        row's real tokens (the rest is padding the target need not compute)."""
        # The final output of every prompt row is not computed (only the last row's logits are): at prefill
        # -1 comes from the last layer's residual stream instead.
        want_final = -1 in hidden_layers and logits_from == 0
        capture = _capture_layers(hidden_layers, self.target, final_computed=want_final)
        out = self.target(torch.tensor(rows), self.cache, slots=[r.slot for r in requests], positions=positions,
                          tree_mask=tree_mask, logits_from=logits_from, return_hidden=want_final,
                          capture_layers=capture, lengths=lengths)
        if not (want_final or capture):
            return out, None, None, capture
        return out.logits, out.hidden if want_final else None, out.captured, capture

    def _hidden(self, layers: Sequence[int], capture: Sequence[int], captured: torch.Tensor | None,
                final: torch.Tensor | None, row: int = 0, length: int | None = None) -> dict[int, torch.Tensor]:
        """{layer: [tokens, dim]} of one batch row, from the captured residual streams (`captured` [L, B, T,
        dim]) and the final-normed output (-1; at prefill only the last layer is captured: normed here)."""
        hidden: dict[int, torch.Tensor] = {}
        for layer in layers:
            if layer == -1 and final is not None:
                hidden[-1] = final[row, :length]
            elif layer == -1:
                hidden[-1] = self.target.norm(captured[capture.index(len(self.target.layers) - 1), row, :length])
            else:
                hidden[layer] = captured[capture.index(layer), row, :length]
        return hidden


def _cut_budget(budget: tuple[int, int, int | None], depth: int) -> tuple[int, int, int | None]:
    """A draft budget (depth, nodes, shape) cut to at most `depth` levels; a tree keeps its nodes per level."""
    wanted, nodes, shape = budget
    if depth >= wanted:
        return budget
    if depth == 0:
        return 0, 0, None
    return depth, max(depth, nodes * depth // wanted), shape


def _adjusted(logits: torch.Tensor, requests: Sequence[Request],
              proposals: Sequence[Proposal] | None = None) -> torch.Tensor:
    """A verification block's logits [B, T, V] (row 0 the pending token's, then the proposal's nodes; no
    `proposals`: row 0 only, a prompt's last row) with the rows of each request that asks for a logit bias or
    penalties adjusted, each row penalized for the tokens generated before it, its draft path included
    (verify/penalties.py): a new fp32 tensor; the same one where no request asks."""
    asking = [b for b, r in enumerate(requests) if r.params.adjusts_logits]
    if not asking:
        return logits
    out = logits.to(torch.float32, copy=True)
    for b in asking:
        r, p = requests[b], requests[b].params
        proposal = proposals[b] if proposals is not None else Proposal([])
        paths = [[proposal.tokens[node] for node in path] for path in node_paths(proposal.parents)]
        penalize_rows_(out[b, :len(paths)], r.prompt_ids, r.context[len(r.prompt_ids):], paths,
                       p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.logit_bias)
    return out


def _target_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1): the kernels' one call on CPU where they are built, else verify's reduction (after a
    forward pass torch's few ops per row cost about 0.1 ms a round on CPU: the pass evicted their caches)."""
    if cpu_kernels.reduces(logits):
        return cpu_kernels.argmax_rows(logits)
    return argmax(logits)


def _target_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k best logits of every row (as `topk_indices`), in one kernel call where built."""
    if cpu_kernels.reduces(logits) and k <= min(logits.shape[-1], cpu_kernels.TOPK_MAX):
        return cpu_kernels.topk_rows(logits, k)
    return topk_indices(logits, k)


def _tree_layout(proposals: Sequence[Proposal], starts: Sequence[int],
                 width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """RoPE positions [B, width] and attention mask [B, width, width] of a verification block holding token
    trees: a node sits at its depth past the committed length and sees its ancestors and the pending token.
    Chains and padding keep the causal layout, which is also what (None, None) means when no row is a tree."""
    if all(p.is_chain for p in proposals):
        return None, None
    positions = torch.tensor(starts)[:, None] + torch.arange(width)[None, :]
    mask = torch.ones(len(proposals), width, width, dtype=torch.bool).tril()
    for b, p in enumerate(proposals):
        if not p.is_chain:
            n = len(p) + 1
            positions[b, :n] = starts[b] + torch.tensor([0] + p.depths)
            mask[b, :n, :n] = tree_attention_mask(p.parents)
    return positions, mask


def _prefill_groups(requests: Sequence[Request]) -> list[list[Request]]:
    """New requests whose prompts share one forward: equal lengths of at most SMALL_BATCH_ROWS tokens, where
    the fused kernels keep every row's bits whatever the batch (a longer prompt runs alone)."""
    groups: dict[int, list[Request]] = {}
    singles = []
    for r in requests:
        n = len(r.prompt_ids)
        if n <= SMALL_BATCH_ROWS:
            groups.setdefault(n, []).append(r)
        else:
            singles.append([r])
    return [*groups.values(), *singles]


def _capture_layers(hidden_layers: Sequence[int], target: Transformer, final_computed: bool) -> tuple[int, ...]:
    """Target layers whose residual stream to capture for a drafter's `hidden_layers`; -1 (the final output)
    needs the last layer only where the forward does not compute the final output of every row."""
    layers = {layer for layer in hidden_layers if layer >= 0}
    if -1 in hidden_layers and not final_computed:
        layers.add(target.config.num_layers - 1)
    return tuple(sorted(layers))


def build_engine(target: Transformer, tokenizer: Tokenizer, speculative_model: str | None = None,
                 num_speculative_tokens: int = 5, adaptive: bool | AdaptiveConfig = True,
                 max_model_len: int | None = None, max_batch: int = 1,
                 drafter_options: dict[str, Any] | None = None, tree: int = 0) -> Engine:
    """The one way to assemble an engine from names: the drafter built for the engine's context and batch.
    `speculative_model` None (or 0 draft tokens) is plain decoding."""
    from specdraft.drafters import make_drafter

    if not isinstance(adaptive, AdaptiveConfig):
        adaptive = AdaptiveConfig(enabled=bool(adaptive))
    drafter = None
    if speculative_model and num_speculative_tokens > 0:
        drafter = make_drafter(speculative_model, target, tokenizer, max_len=context_limit(target, max_model_len),
                               options=drafter_options, max_batch=max_batch)
    return Engine(target, tokenizer, drafter, num_speculative_tokens if drafter else 0, adaptive, max_model_len,
                  max_batch, tree)


def context_limit(target: Transformer, max_model_len: int | None) -> int:
    """The per-request context: the user's limit (default 4096), never beyond the model's own."""
    limit = target.config.max_position_embeddings
    return min(limit, max_model_len) if max_model_len else min(limit, 4096)


__all__ = ["BONUS", "CORRECTION", "DRAFT", "MAX_TREE_NODES", "ROOT", "TARGET", "Engine", "GenerationResult", "Request",
           "StreamChunk", "build_engine", "context_limit"]
