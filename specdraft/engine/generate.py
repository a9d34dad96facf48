"""The propose -> verify -> accept loop. Plain decoding is the same loop with no drafter (K = 0).

Invariant: the target's KV cache holds the whole context except its last token (`pending`), which is fed
to the next forward together with the draft tokens. After verification the pending token and the accepted
draft tokens are committed; the target's correction/bonus token becomes the new pending token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdraft.drafters.base import Drafter, Proposal
from specdraft.engine.adaptive import AdaptiveConfig, DraftLengthController
from specdraft.engine.metrics import SpecMetrics
from specdraft.engine.stopping import OutputAssembler
from specdraft.runtime.errors import ContextOverflowError, SpecdraftError
from specdraft.runtime.model import Transformer
from specdraft.runtime.tokenizer import Tokenizer
from specdraft.verify.greedy import greedy_verify
from specdraft.verify.rejection import pad_vocab, rejection_verify
from specdraft.verify.sampling import SamplingParams, logits_to_probs, sample

# Where each emitted token came from (for --show-drafts and the metrics).
TARGET, DRAFT, CORRECTION, BONUS = "target", "draft", "correction", "bonus"


@dataclass
class StreamChunk:
    text: str
    token_ids: list[int]
    origins: list[str]
    result: GenerationResult | None = None  # set on the last chunk


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: SpecMetrics
    origins: list[str] = field(default_factory=list)
    adaptation_log: list[str] = field(default_factory=list)


class SpeculativeEngine:
    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 5,
        adaptive: AdaptiveConfig | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if num_speculative_tokens < 0:
            raise SpecdraftError("num_speculative_tokens must be >= 0")
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter if num_speculative_tokens > 0 else None
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive if adaptive is not None else AdaptiveConfig()
        limit = target.config.max_position_embeddings
        self.max_model_len = min(limit, max_model_len) if max_model_len else min(limit, 4096)
        self.cache = target.new_cache(self.max_model_len)
        self.totals = SpecMetrics()

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if len(prompt_ids) == 0:
            raise SpecdraftError("empty prompt: give at least one token of input")
        vocab = self.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise SpecdraftError(f"prompt token ids must be in [0, {vocab})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_model_len:
            raise ContextOverflowError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        for chunk in self.stream(prompt_ids, params):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StreamChunk]:
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params)
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        metrics = SpecMetrics(prompt_tokens=len(prompt_ids))
        out = OutputAssembler(self.tokenizer, params)
        origins: list[str] = []
        controller = DraftLengthController(self.num_speculative_tokens, self.adaptive)
        cache, target = self.cache, self.target
        t_start = time.perf_counter()

        cache.reset(0)
        logits = target(torch.tensor([prompt_ids]), cache, logits_from=len(prompt_ids) - 1)
        cache.commit(0, len(prompt_ids))
        first = self._pick(logits[0, -1], params, generator)
        metrics.prefill_time = time.perf_counter() - t_start
        out.add(first)
        origins.append(TARGET)
        context = prompt_ids + [first]
        if self.drafter is not None and not out.finished:
            t = time.perf_counter()
            self.drafter.start(prompt_ids, params, generator, target_cache=cache)
            metrics.draft_time += time.perf_counter() - t
        yield StreamChunk(out.take_delta(), [first], [TARGET])

        while not out.finished:
            remaining = params.max_tokens - len(out.token_ids)
            room = cache.max_len - cache.length(0) - 1
            k = controller.next_k() if self.drafter is not None else 0
            k = max(0, min(k, remaining - 1, room))
            t0 = time.perf_counter()
            proposal = self.drafter.propose(context, k) if k > 0 else Proposal([])
            drafts = proposal.tokens[:k]
            t1 = time.perf_counter()
            num_accepted, new_tokens = self._verify(context[-1], drafts, proposal, params, generator)
            t2 = time.perf_counter()
            cache.commit(0, cache.length(0) + 1 + num_accepted)
            metrics.record_round(len(drafts), num_accepted)
            metrics.draft_time += t1 - t0
            metrics.verify_time += t2 - t1
            if self.drafter is not None:
                controller.update(len(drafts), num_accepted, t1 - t0, t2 - t1)
                if not drafts:
                    metrics.fallback_rounds += int(controller.in_fallback)

            last = CORRECTION if num_accepted < len(drafts) else BONUS if drafts else TARGET
            round_origins = [DRAFT] * num_accepted + [last]
            emitted = []
            for token, origin in zip(new_tokens, round_origins, strict=True):
                out.add(token)
                emitted.append(token)
                origins.append(origin)
                if out.finished:
                    break
            context.extend(new_tokens)
            if drafts and not out.finished:
                self.drafter.accepted(num_accepted, context)
            yield StreamChunk(out.take_delta(), emitted, round_origins[:len(emitted)])

        metrics.generated_tokens = len(out.token_ids)
        metrics.fallback_events = controller.fallback_events
        metrics.total_time = time.perf_counter() - t_start
        self.totals = self.totals.merge(metrics)
        result = GenerationResult(prompt_ids, out.token_ids, out.text, out.finish_reason, metrics, origins,
                                  controller.log)
        yield StreamChunk(out.take_delta(), [], [], result)

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        if params.greedy:
            return int(logits.argmax(-1))
        return int(sample(logits_to_probs(logits, params), generator))

    def _verify(self, pending: int, drafts: list[int], proposal: Proposal, params: SamplingParams,
                generator: torch.Generator) -> tuple[int, list[int]]:
        """One target forward over [pending] + drafts; returns (accepted count, tokens to emit)."""
        logits = self.target(torch.tensor([[pending, *drafts]]), self.cache)
        draft_tokens = torch.tensor([drafts], dtype=torch.long)
        if params.greedy:
            accepted_len, out_tokens = greedy_verify(draft_tokens, logits)
        else:
            target_probs = logits_to_probs(logits, params)
            draft_probs = None
            if proposal.draft_probs is not None and drafts:
                draft_probs = pad_vocab(proposal.draft_probs[:len(drafts)], target_probs.shape[-1])[None]
            accepted_len, out_tokens = rejection_verify(draft_tokens, draft_probs, target_probs, generator)
        num_accepted = int(accepted_len[0])
        return num_accepted, out_tokens[0, :num_accepted + 1].tolist()
