"""A preallocated, position-indexed KV cache holding several independent sequences (slots).

Each slot has a committed length. A forward pass writes the keys/values of its new tokens right after the
committed part and attends to them, but does not commit them: the caller decides afterwards how many to keep
(`commit`), which is how speculative verification rolls back. Entries past the committed length are stale
and are masked out of every later read, so rolling back is just setting a number.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from specdraft.errors import ContextOverflowError

# Reads are padded up to a multiple of this many keys so that a token's attention is computed with the same
# kernel shapes whether it is decoded alone or verified in a block (bf16 results then match bit for bit).
KEY_BLOCK = 64


class SlotLengths:
    """The committed length of each slot, which is all that rolling back changes; every cache of this
    runtime (this one, and the transformers backend's) keeps its entries behind these numbers."""

    def __init__(self, max_len: int, num_slots: int) -> None:
        self.max_len = max_len
        self.num_slots = num_slots
        self.lengths = [0] * num_slots

    def length(self, slot: int = 0) -> int:
        return self.lengths[slot]

    def commit(self, slot: int, length: int) -> None:
        """Set the committed length of `slot` (shrinking it rolls back)."""
        if not 0 <= length <= self.max_len:
            raise ContextOverflowError(f"KV cache length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def reset(self, slot: int | None = None) -> None:
        for s in range(self.num_slots) if slot is None else [slot]:
            self.lengths[s] = 0

    def check_room(self, slots: Sequence[int], num_new: int) -> None:
        for s in slots:
            if self.lengths[s] + num_new > self.max_len:
                raise ContextOverflowError(
                    f"context full: slot {s} holds {self.lengths[s]} tokens, {num_new} more do not fit in "
                    f"{self.max_len}"
                )


def lazy_zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros that cost memory only where written, on CPU: an anonymous mapping reads as zeros and the OS
    commits its pages on first write, so a cache sized for every slot's full context (16 slots of 4096 tokens
    of SmolLM2: 3 GB) holds only what requests fill, and needs no seconds of zero-filling at start-up."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(tuple(shape))  # the tensor keeps the map


class KVCache(SlotLengths):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        num_slots: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        max_len = -(-max_len // KEY_BLOCK) * KEY_BLOCK
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        # Zeros, not empty: masked stale entries are multiplied by 0 and must never be NaN.
        self.k = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        super().__init__(max_len, num_slots)

    def compact(self, slot: int, src_offsets: Sequence[int]) -> None:
        """Move uncommitted entries at committed+src_offsets[i] to committed+i (accepting a token-tree path),
        then commit them."""
        start = self.lengths[slot]
        src = torch.tensor(src_offsets, dtype=torch.long) + start
        dst = torch.arange(len(src_offsets)) + start
        for cache in (*self.k, *self.v):
            cache[slot, :, dst] = cache[slot, :, src]
        self.commit(slot, start + len(src_offsets))
