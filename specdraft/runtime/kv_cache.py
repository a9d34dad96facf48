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
        # A second copy of the keys in the layout the CPU kernels' attention reads (`enable_key_panels`).
        self.k_panels: list[torch.Tensor] | None = None
        super().__init__(max_len, num_slots)

    def enable_key_panels(self, width: int) -> list[torch.Tensor]:
        """Keep each layer's keys also as panels [slots, kv_heads, max_len / width, head_dim / 2, width] of
        bf16 pairs (key t in lane t % width of panel t / width), the layout in which the CPU kernels' attention
        multiplies them: the kernels write both copies as they store keys, and this class mirrors into the
        panels every key it moves; anything else that writes keys calls `sync_key_panels`. The panels of the
        committed entries are made now. Only keys a forward can see need to match: stale entries past a slot's
        length are masked (and the panels' are finite: zeros or old keys)."""
        if self.k_panels is not None:
            return self.k_panels
        num_slots, heads, max_len, head_dim = self.k[0].shape
        if max_len % width or head_dim % 2 or self.k[0].dtype != torch.bfloat16:
            raise ValueError(f"key panels of {width} need bf16 keys, an even head_dim and a max_len that is a "
                             f"multiple of {width}")
        shape = (num_slots, heads, max_len // width, head_dim // 2, width)
        with torch.inference_mode(False):  # made inside a forward, updated outside one (`compact`)
            self.k_panels = [lazy_zeros(shape, torch.int32, self.k[0].device) for _ in self.k]
        for slot, length in enumerate(self.lengths):
            self.sync_key_panels(slot, 0, length)
        return self.k_panels

    def drop_key_panels(self) -> None:
        """Stop keeping key panels (a kernel build that does not read them is writing keys now)."""
        self.k_panels = None

    def sync_key_panels(self, slot: int, start: int, end: int) -> None:
        """Copy the keys of positions [start, end) of `slot` into the key panels (if kept)."""
        if self.k_panels is None or end <= start:
            return
        width = self.k_panels[0].shape[-1]
        positions = torch.arange(start, end)
        blocks, lanes = positions // width, positions % width
        for keys, panels in zip(self.k, self.k_panels):
            words = keys[slot, :, start:end].contiguous().view(torch.int32)        # [kv_heads, n, head_dim / 2]
            panels[slot][:, blocks, :, lanes] = words.transpose(0, 1)              # indexed: [n, kv_heads, words]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the entries at positions [0, length) of slot `src` (committed or left behind by a finished
        request: the caller knows which are intact) into slot `dst`, and commit them there."""
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]
        self.sync_key_panels(dst, 0, length)
        self.commit(dst, length)

    def compact(self, slot: int, src_offsets: Sequence[int]) -> None:
        """Move uncommitted entries at committed+src_offsets[i] to committed+i (accepting a token-tree path),
        then commit them."""
        start = self.lengths[slot]
        src = torch.tensor(src_offsets, dtype=torch.long) + start
        dst = torch.arange(len(src_offsets)) + start
        for cache in (*self.k, *self.v):
            cache[slot, :, dst] = cache[slot, :, src]
        self.sync_key_panels(slot, start, start + len(src_offsets))
        self.commit(slot, start + len(src_offsets))
