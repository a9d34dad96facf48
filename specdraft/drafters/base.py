"""The one small interface every drafter implements.

The engine calls, per request: `start` once, then repeatedly `propose` -> (target verifies) -> `accepted`.
`context` is always the full committed token sequence (prompt + emitted output); it only ever grows, so a
drafter can keep incremental state (an n-gram index, a KV cache) and look only at the new tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdraft.runtime.kv_cache import KVCache
from specdraft.verify.sampling import SamplingParams


@dataclass
class Proposal:
    """Up to K draft tokens.

    `draft_probs` is [len(tokens), vocab] fp32: the exact distribution each token was sampled from (made by
    `logits_to_probs` with the request's params). `None` means the drafter is deterministic (each token is a
    one-hot draft), which is what greedy drafting and n-gram lookup are.
    """

    tokens: list[int]
    draft_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    name: str

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator | None,
              target_cache: KVCache | None = None) -> None:
        """Begin a new request (reset all per-request state).

        `target_cache` holds the target's keys/values for the prompt (slot 0, committed): drafters derived
        from the target's own weights copy it instead of running their own prefill."""

    def propose(self, context: Sequence[int], max_k: int) -> Proposal:
        """Propose at most `max_k` tokens that continue `context`. May return fewer, or none."""

    def accepted(self, num_accepted: int, context: Sequence[int]) -> None:
        """Told after verification: `num_accepted` leading draft tokens were kept; `context` is the new
        committed sequence (it ends with the target's own correction or bonus token)."""
