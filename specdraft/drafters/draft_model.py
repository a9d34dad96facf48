"""A draft transformer run autoregressively with its own rollback-able KV cache.

Serves three drafters: an independent draft checkpoint (`draft:REF`), the target's own weights quantized
(`quant:int4`, see quant.py) and the target's first N layers (`self:N`, see self_draft.py).

Cache bookkeeping: after `propose` the draft cache holds the context plus draft tokens d1..d_{k-1} (d_k was
sampled but never fed). `accepted(n)` keeps what the target kept, so the next `propose` only feeds the tokens
the draft has not seen: the target's correction, or d_k plus the bonus token after full acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.drafters.base import Proposal
from specdraft.runtime.errors import SpecdraftError
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.model import Transformer
from specdraft.runtime.tokenizer import Tokenizer
from specdraft.verify.sampling import SamplingParams, logits_to_probs, sample


class ModelDrafter:
    def __init__(self, model: Transformer, name: str = "draft", exit_layer: int | None = None,
                 max_len: int = 4096, min_confidence: float = 0.0, share_prompt_cache: bool = False) -> None:
        """share_prompt_cache: the draft is derived from the target's weights (quantized, or its first layers),
        so the target's prompt keys/values are copied instead of running a second prefill."""
        if not 0.0 <= min_confidence < 1.0:
            raise SpecdraftError("min_confidence must be in [0, 1)")
        self.model = model
        self.name = name
        self.share_prompt_cache = share_prompt_cache
        self.exit_layer = exit_layer
        self.min_confidence = min_confidence
        cfg = model.config
        layers = exit_layer or cfg.num_layers
        max_len = min(max_len, cfg.max_position_embeddings)
        self.cache = KVCache(layers, cfg.num_kv_heads, cfg.head_dim, max_len, 1, model.dtype, model.device)
        self.params = SamplingParams(temperature=0.0)
        self.generator: torch.Generator | None = None
        self._proposed_at = 0  # len(context) when the last proposal was made
        self.target_cache: KVCache | None = None  # set by start() when share_prompt_cache
        self._num_proposed = 0

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator | None,
              target_cache: KVCache | None = None) -> None:
        self.params, self.generator = params, generator
        self.cache.reset()
        self.target_cache = target_cache if self.share_prompt_cache else None
        self._catch_up_from_target(len(prompt_ids))
        if self.cache.length() < len(prompt_ids):
            self._forward(list(prompt_ids[self.cache.length():]), want_logits=False)

    def _catch_up_from_target(self, context_len: int) -> None:
        """Copy the target's committed keys/values the draft has not seen (the prompt; the tokens decoded
        while the engine had fallen back to plain decoding) instead of running them through the draft: for
        `self:N` they are exactly what the draft would compute, for `quant:*` the target's own, and a probe
        after a long fallback then costs one draft step instead of a forward over every missed token."""
        if self.target_cache is None:
            return
        start, end = self.cache.length(), min(context_len, self.target_cache.length(0), self.cache.max_len)
        if end - start < 2:  # one token is as cheap to feed as to copy
            return
        for mine, theirs in ((self.cache.k, self.target_cache.k), (self.cache.v, self.target_cache.v)):
            for layer, dst in enumerate(mine):
                dst[0, :, start:end] = theirs[layer][0, :, start:end]
        self.cache.commit(0, end)

    def _forward(self, tokens: list[int], want_logits: bool = True) -> torch.Tensor | None:
        x = torch.tensor([tokens], device=self.model.device)
        logits = self.model(x, self.cache, exit_layer=self.exit_layer, logits_from=len(tokens) - 1)
        self.cache.commit(0, self.cache.length() + len(tokens))
        return logits[0, -1] if want_logits else None

    def propose(self, context: Sequence[int], max_k: int) -> Proposal:
        room = self.cache.max_len - len(context) - 1
        max_k = min(max_k, room)
        if max_k <= 0:
            return Proposal([])
        self._catch_up_from_target(len(context) - 1)
        feed = list(context[self.cache.length():])
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        self._proposed_at = len(context)
        for i in range(max_k):
            logits = self._forward(feed)
            if self.params.greedy:
                token = int(logits.argmax())
                confidence = float(torch.softmax(logits.float(), -1)[token]) if self.min_confidence else 1.0
            else:
                dist = logits_to_probs(logits, self.params)
                token = int(sample(dist, self.generator))
                confidence = float(dist[token])
                probs.append(dist)
            if confidence < self.min_confidence and i > 0:
                if probs:
                    probs.pop()
                break
            tokens.append(token)
            feed = [token]
        self._num_proposed = len(tokens)
        # The cache now holds context + tokens[:-1] (+ the last token too after an early stop; `accepted`
        # rolls back to what is known to be kept, so at worst one token is fed again).
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def accepted(self, num_accepted: int, context: Sequence[int]) -> None:
        kept = self._proposed_at + min(num_accepted, max(self._num_proposed - 1, 0))
        self.cache.commit(0, min(kept, self.cache.length()))


def check_tokenizers_match(target: Tokenizer, draft: Tokenizer) -> None:
    """Draft and target must give the same ids the same strings; padded vocabularies (e.g. 151936 vs 152064)
    are fine as long as the shared range agrees."""
    common = min(len(target.hf), len(draft.hf))
    ids = list(range(common))
    t_tokens = target.hf.convert_ids_to_tokens(ids)
    d_tokens = draft.hf.convert_ids_to_tokens(ids)
    mismatched = [i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b]
    larger = max(len(target.hf), len(draft.hf))
    if mismatched or common < 0.9 * larger:
        example = ""
        if mismatched:
            i = mismatched[0]
            example = f"; e.g. id {i} is {t_tokens[i]!r} for the target but {d_tokens[i]!r} for the draft"
        raise SpecdraftError(
            f"draft and target tokenizers do not match ({len(mismatched)} of {common} shared ids differ, "
            f"vocab sizes {len(target.hf)} vs {len(draft.hf)}){example}. A draft model must use the target's "
            f"tokenizer; use 'ngram', 'quant:int4' or 'self:N' instead"
        )
