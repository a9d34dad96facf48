"""Greedy verification: keep the draft exactly as long as it agrees with the target's argmax.

With temperature 0 the target's output is a deterministic function of the prefix, so the only lossless rule
is "accept while equal, then emit the target's own choice". It is kept separate from rejection sampling
because it needs only logits (no softmax) and uses no randomness at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify K draft tokens per row against the target's argmax.

    `target_logits[:, i]` must be the target's logits for the position of `draft_tokens[:, i]` (i.e. computed
    from the prefix ending just before it); `target_logits[:, K]` is the position after the last draft token
    and supplies the bonus token when everything is accepted.

    Returns `(accepted_len [B], out_tokens [B, K+1])`, both int64 on the logits' device. The caller emits
    `out_tokens[b, :accepted_len[b] + 1]`; later entries are padding. Everything stays on the device (no
    host sync), so the caller decides when to read the lengths back.
    """
    if draft_tokens.dim() != 2 or target_logits.dim() != 3:
        raise ValueError(
            f"expected draft_tokens [B, K] and target_logits [B, K+1, V], got {tuple(draft_tokens.shape)} "
            f"and {tuple(target_logits.shape)}"
        )
    batch, num_draft = draft_tokens.shape
    if target_logits.shape[0] != batch or target_logits.shape[1] != num_draft + 1:
        raise ValueError(
            f"target_logits must be [B, K+1, V] = [{batch}, {num_draft + 1}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    target_argmax = argmax(target_logits)  # [B, K+1]
    matches = draft_tokens.to(target_argmax.device, torch.long) == target_argmax[:, :num_draft]
    # The leading run of matches: cumprod turns everything after the first mismatch into 0.
    accepted_len = matches.long().cumprod(-1).sum(-1)
    # Accepted draft tokens are by definition equal to the target's argmax at their positions, and the
    # token after them is the target's argmax too, so the argmax row already is the output.
    return accepted_len, target_argmax


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common start of two token sequences: a greedy draft's accepted length against the
    target's argmax row, a cache to rewind, a prompt's cached start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# Vocabulary chunk of the two-stage reductions below.
CHUNK = 128


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same indices (first maximum; NaN counts as the maximum).

    On CPU, torch's argmax walks a row element by element (about 40 us for a 49,152-token row, 0.22 ms for an
    8-token block: 2-3% of a verification step), while its max is vectorized. So: each chunk's maximum, the
    first chunk holding the row's maximum, then the first maximum inside it, which is the row's first maximum
    (a NaN is the maximum of its chunk, so the first NaN is found the same way). Half-precision logits go
    through fp32, which is exact."""
    x = for_reduction(logits)
    if not _chunked(x, 1):
        return x.argmax(-1)
    chunks = x.reshape(-1, x.shape[-1] // CHUNK, CHUNK)
    best_chunk = chunks.amax(-1).argmax(-1)
    within = chunks[torch.arange(chunks.shape[0]), best_chunk].argmax(-1)
    return (best_chunk * CHUNK + within).reshape(x.shape[:-1])


def topk_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits.topk(k, dim=-1).indices, best first (among equal logits, in no guaranteed order, as torch's).

    Two-stage on CPU, as `argmax`: the k best entries of a row lie in the k chunks with the largest maxima (a
    chunk outside them has k entries at least as large elsewhere), so only those k chunks are ranked."""
    x = for_reduction(logits)
    if not _chunked(x, k):
        return x.topk(k, dim=-1).indices
    chunks = x.reshape(-1, x.shape[-1] // CHUNK, CHUNK)
    top_chunks = chunks.amax(-1).topk(k, dim=-1).indices                                   # [R, k]
    candidates = chunks.gather(1, top_chunks[..., None].expand(-1, -1, CHUNK)).flatten(1)  # [R, k * CHUNK]
    best = candidates.topk(k, dim=-1).indices
    indices = top_chunks.gather(1, best // CHUNK) * CHUNK + best % CHUNK
    return indices.reshape(*x.shape[:-1], k)


def _chunked(x: torch.Tensor, k: int) -> bool:
    """Whether the two-stage reductions apply: CPU, a vocabulary of more than k whole chunks."""
    return x.device.type == "cpu" and x.dim() > 0 and x.shape[-1] % CHUNK == 0 and x.shape[-1] // CHUNK > k


def for_reduction(logits: torch.Tensor) -> torch.Tensor:
    """fp32 on CPU for half-precision logits (exact, and faster to reduce there); as they are otherwise."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        return logits.float()
    return logits
