"""One decoder-only transformer for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3) and
Gemma 3 text. Read top to bottom: norms, RoPE, attention over the KV cache, MLP, block, model.

The single entry point `Transformer.forward` scores T new tokens per sequence at given positions against the
KV cache and returns their logits: prefill, decoding, verification of K draft tokens and token trees
(through `tree_mask`) are all the same call.

Numerics: activations run in the weights' dtype (bf16 by default on CPU), norms, RoPE tables and softmax in
fp32. Every token's result must not depend on how many tokens share the forward pass, so that speculative
output equals plain decoding bit for bit in bf16, not just up to near-ties. Two paths give that on CPU:
- bf16 blocks of up to SMALL_BATCH_ROWS tokens (a prompt: causal chunks of PREFILL_CHUNK_TOKENS) run all
  layers in one call into the fused C kernels (fused.py, cpu_kernels.c), which compute each row with the same
  operations whatever the row count; a GGUF-native model (gguf_native.py: linear layers and embedding on the
  file's quantized blocks) too;
- otherwise (no compiler, fp32, GPU) the PyTorch modules below, whose attention is two matmuls over a key
  range padded to KEY_BLOCK.
Prompts longer than CHUNKED_PREFILL_TOKENS (32,768: none of the bundled models') run the PyTorch modules with
GEMMs and SDPA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.runtime import cpu_kernels
from specdraft.runtime.config import ModelConfig
from specdraft.runtime.cpu_kernels import bf16_gemm_is_native
from specdraft.runtime.fused import SMALL_BATCH_ROWS, FusedCPUBackend
from specdraft.runtime.gguf_native import GGUFLinear
from specdraft.runtime.kv_cache import KEY_BLOCK, KVCache

# Padded blocks are computed row by row (`Transformer._forward_ragged`) when that skips at least an eighth of
# the rows. One-token entries lose attention's grouping of a block's queries per key panel: on a Zen 4
# (scripts/bench_ragged.py, SmolLM2 bf16) 16 blocks of 5-6 tokens (88 of 96 rows real) took 134 ms ragged
# against 120 padded, while 46 of 96 took 73 against 119 and 21 of 96 took 39 against 117.
RAGGED_BELOW = 7 / 8

# Prompts of up to this many tokens are prefilled through the fused kernels, PREFILL_CHUNK_TOKENS at a time,
# rather than by GEMMs over the whole prompt (scripts/bench_prefill.py on a Zen 4, both bundled models, bf16
# and GGUF-native: 1.4-1.75x faster at 40 tokens, 1.06-1.31x at 200-1000; at stop 53, GGUF-native, SmolLM2
# 1.66 / 1.56 / 1.54 / 1.62x at 2,000 / 3,000 / 4,500 / 6,000 tokens, bf16 1.38x at 3,000 and 1.42x at 6,000,
# Gemma 3 1.69 / 2.12 / 2.46 / 2.86x at 2,000-6,000 and 4.2x at 12,000: the GEMM path's attention and the
# dequantized weights grow with the prompt). So every prompt up to Gemma 3's context takes the chunks; on a CPU
# with AMX tiles, whose GEMMs are faster, only prompts up to 1,000 tokens have been measured.
CHUNKED_PREFILL_TOKENS = 32768
# Tokens per chunk of such a prefill: one call of the fused kernels over a causal block reads every weight
# once, so a longer chunk spreads that read over more tokens; the kernels' rows keep their bits at any block
# size. scripts/bench_prefill.py --chunks 32,64,128,256 on a Sapphire Rapids (AMX), SmolLM2 bf16, 200-1000
# tokens: chunks of 128 1.5-1.8x faster than chunks of 32 (256: within 3% of 128); GGUF-native 1.15-1.25x.
PREFILL_CHUNK_TOKENS = 128


class RMSNorm(nn.Module):
    """Llama style scales after casting back (`w * x.to(dtype)`); Gemma style scales by (1 + w) in fp32."""

    def __init__(self, dim: int, eps: float, gemma_style: bool) -> None:
        super().__init__()
        self.eps = eps
        self.gemma_style = gemma_style
        self.weight = nn.Parameter(torch.zeros(dim) if gemma_style else torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma_style:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.type_as(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos, signed_sin [B, T, 1, D]. Rotate-half convention (as in HF checkpoints):
    rotate_half(x) * sin == roll(x, D/2) * signed_sin, with the first half of signed_sin negated."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class Linear(nn.Linear):
    """nn.Linear with a CPU small-batch path for up to SMALL_BATCH_ROWS rows: the C kernel in bf16 when it is
    available, else `mv` for one row and `W @ X^T` for more.

    Decoding one token and verifying K+1 tokens must produce bit-identical rows, or speculative output drifts
    away from plain decoding at near-ties; both paths give each row the same bits whatever the row count.
    """

    def forward(self, x: torch.Tensor, exact_rows: bool = False) -> torch.Tensor:
        """exact_rows: take the row-invariant path whatever the row count (the LM head over a batch of
        verification blocks; prefill-sized blocks inside the layers prefer the GEMM)."""
        rows = x.numel() // x.shape[-1]
        if ((rows > SMALL_BATCH_ROWS and not exact_rows) or x.device.type != "cpu" or rows == 0
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_gemm_is_native():
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if (self.weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and cpu_kernels.available()
                and x.shape[-1] % cpu_kernels.k_multiple() == 0):
            y = cpu_kernels.linear(flat, self.weight, self.bias, torch.get_num_threads())
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if rows == 1:
            y = torch.mv(self.weight, flat[0])[None]
        else:
            # Row-major again: later reductions over a strided last dim would round differently per T.
            y = torch.mm(self.weight, flat.t()).t().contiguous()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.wo = Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.is_gemma) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.is_gemma) if cfg.qk_norm else None
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_logit_softcapping

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: tuple[int, ...], index: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """k_cache/v_cache [S, Hkv, L, D] of this layer, or None (cache-free: the block sees only itself);
        index = (slot [B, 1], cache position [B, T]) of each new token; mask [B, 1, T, 1, key_len] additive;
        causal: the mask is plain causal from key 0 (a prompt's prefill), which SDPA computes faster without
        it."""
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, H + 2 * Hkv, D)
        if self.q_norm is None:  # one RoPE call rotates queries and keys together
            qk, v = apply_rope(qkv[:, :, :H + Hkv], *rope), qkv[:, :, H + Hkv:]
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
            q, k = apply_rope(self.q_norm(q), *rope), apply_rope(self.k_norm(k), *rope)

        key_len = mask.shape[-1]
        if k_cache is None:  # cache-free (training): the block attends to itself
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        else:
            # One indexed write per cache for the whole batch: [S, L, Hkv, D] view, indexed by (slot, position).
            k_cache.transpose(1, 2)[index] = k
            v_cache.transpose(1, 2)[index] = v
            keys, values = _rows(k_cache, slots, key_len), _rows(v_cache, slots, key_len)

        # Grouped-query attention without repeating K/V: query heads of one KV head form one matmul.
        if T > SMALL_BATCH_ROWS and not self.softcap:
            # Prefill-sized blocks are never compared bit for bit with decoding: use the fused kernel.
            # The additive fp32 mask as is: a boolean one would be converted back to it in every layer.
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                 attn_mask=None if causal else mask[:, :, :, 0],
                                                 is_causal=causal, scale=self.scale, enable_gqa=True)
            return self.wo(out.transpose(1, 2).reshape(B, T, H * D))
        # Grouped-query attention without repeating K/V: the G query heads of one KV head share its matmul.
        # Rows are token-major (token t owns rows t*G .. t*G+G-1) so a block can be split by tokens.
        G = H // Hkv
        q = q.view(B, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
        scores = _row_chunked_matmul(q, keys.transpose(-1, -2), G, T).view(B, Hkv, T, G, key_len)
        if self.softcap:
            scores = torch.tanh(scores.float() * (self.scale / self.softcap)) * self.softcap + mask
        else:
            scores = torch.add(mask, scores, alpha=self.scale)  # fp32: mask + scale * scores in one op
        probs = torch.softmax(scores, dim=-1).to(values.dtype).view(B, Hkv, T * G, key_len)
        out = _row_chunked_matmul(probs, values, G, T).view(B, Hkv, T, G, D)
        out = out.permute(0, 2, 1, 3, 4).reshape(B, T, H * D)
        return self.wo(out)


def _row_chunked_matmul(a: torch.Tensor, b: torch.Tensor, group: int, tokens: int) -> torch.Tensor:
    """a @ b, with a's rows (token-major, `group` per token) fed at most SMALL_BATCH_ROWS at a time for small
    blocks: bf16 matmuls keep each row's bits only up to that many rows, and a verified token must get the
    bits it would get when decoded alone. Prefill-sized blocks (never compared bit for bit) run in one call."""
    per_call = max(1, SMALL_BATCH_ROWS // group)
    if tokens <= per_call or tokens > SMALL_BATCH_ROWS:
        return torch.matmul(a, b)
    rows = per_call * group
    return torch.cat([torch.matmul(a[..., i:i + rows, :], b) for i in range(0, a.shape[-2], rows)], dim=-2)


def _rows(cache: torch.Tensor, slots: Sequence[int], key_len: int) -> torch.Tensor:
    if len(slots) == 1:
        return cache[slots[0]:slots[0] + 1, :, :key_len]
    if list(slots) == list(range(slots[0], slots[0] + len(slots))):
        return cache[slots[0]:slots[0] + len(slots), :, :key_len]
    return cache[list(slots), :, :key_len]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act in ("silu", "swish"):
            self.act = F.silu
        elif cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            self.act = lambda t: F.gelu(t, approximate="tanh")
        else:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(self.act(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        gemma = cfg.is_gemma
        self.attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        # Gemma 3 also normalizes each sublayer's output before adding it to the residual stream.
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma) if gemma else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma) if gemma else None

    def forward(self, x: torch.Tensor, rope, k_cache, v_cache, slots, index, mask, causal=False) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), rope, k_cache, v_cache, slots, index, mask, causal)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [B, T', vocab]
    hidden: torch.Tensor  # final-normed hidden states of the same rows [B, T', dim]
    captured: torch.Tensor | None  # residual stream after each requested layer [layers, B, T, dim], or None


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.is_gemma)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", None, persistent=False)
        self.register_buffer("inv_freq_local", None, persistent=False)
        self.init_rope_tables(torch.get_default_device())
        self.requires_grad_(False)
        self.fused = FusedCPUBackend()  # the C kernels' view of this model (weight tables, thread governor)
        self.native_report = None  # GGUF-native weights: what stayed quantized (gguf_native.attach_native)

    def init_rope_tables(self, device: torch.device | str) -> None:
        """(Re)compute the RoPE inverse frequencies in fp32 on `device`: at construction, after a load onto
        the meta device, and after every `.to()` (which would otherwise cast them to the weights' dtype;
        bf16 angles put every position off)."""
        cfg = self.config
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        self.inv_freq_local = rope_inv_freq(cfg.head_dim, local_theta, None).to(device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.init_rope_tables(self.inv_freq.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the final norm's: GGUF-native models hold no dense embedding)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, max_len: int, num_slots: int = 1) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len, num_slots, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        slots: Sequence[int] | None = None,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        exit_layer: int | None = None,
        logits_from: int = 0,
        return_hidden: bool = False,
        capture_layers: Sequence[int] = (),
        branch_mask: torch.Tensor | None = None,
        lengths: Sequence[int] | None = None,
    ) -> torch.Tensor | ForwardOutput:
        """Score `tokens` [B, T] appended after each slot's committed length; nothing is committed.

        positions: RoPE positions [B, T] (default: committed length + 0..T-1; a token tree passes depths).
        tree_mask: bool [T, T] or [B, T, T], True where new token i may see new token j (default: causal).
        branch_mask: bool [B, T, m]: the last m committed keys of each slot are nodes of a token tree grown
            level by level (a drafter's); new token i sees the j-th of them only where branch_mask[b, i, j]
            (its ancestors). Committed keys are otherwise visible to every new token.
        exit_layer: run only the first N layers, then the final norm and head (early-exit self-drafting).
        logits_from: compute logits for rows logits_from.. only (prefill needs just the last one).
        return_hidden / capture_layers: return a `ForwardOutput` with the final-normed hidden states of those
        rows and the residual stream after each layer in `capture_layers` (all T rows), which is what
        feature-level drafters read; asking for nothing costs nothing.
        lengths: the real rows of each block (the rest is padding, whose outputs are then left unset): the
            fused kernels compute only the real rows where that skips enough of them (`RAGGED_BELOW`): a
            batch of drafts is as wide as its longest.
        Returns logits [B, T - logits_from, vocab] (fp32 only if the model runs in fp32).
        """
        B, T = tokens.shape
        slots = list(range(B)) if slots is None else list(slots)
        cache.check_room(slots, T)
        device = self.device  # callers build their index tensors on the CPU, wherever the model runs
        tokens = tokens.to(device)
        positions, tree_mask, branch_mask = (None if t is None else t.to(device)
                                             for t in (positions, tree_mask, branch_mask))
        causal_block = positions is None and tree_mask is None and branch_mask is None
        chunk = PREFILL_CHUNK_TOKENS
        if (chunk < T <= CHUNKED_PREFILL_TOKENS and causal_block and self.fused.applies(self, chunk, cache, chunk)):
            return self._forward_chunked(tokens, cache, slots, exit_layer, logits_from, return_hidden,
                                         capture_layers)
        starts = [cache.lengths[s] for s in slots]
        # A prompt on an empty cache: every layer kind whose window covers the block is plainly causal.
        from_start = positions is None and tree_mask is None and branch_mask is None and max(starts) == 0
        if positions is None:
            offsets = torch.tensor(starts, device=tokens.device)[:, None]
            positions = offsets + torch.arange(T, device=tokens.device)[None, :]
        key_len = min(cache.max_len, -(-(max(starts) + T) // KEY_BLOCK) * KEY_BLOCK)
        masks = attention_masks(self.config, starts, positions, tree_mask, key_len, branch_mask)

        rows = torch.tensor(slots, device=tokens.device)[:, None]
        index = (rows, torch.tensor(starts, device=tokens.device)[:, None] + torch.arange(T, device=tokens.device))
        num_layers = len(self.layers) if exit_layer is None else exit_layer
        self._check_capture(capture_layers, num_layers)
        if (lengths is not None and logits_from == 0 and sum(lengths) <= RAGGED_BELOW * B * T
                and self.fused.applies(self, 1, cache)):
            return self._forward_ragged(tokens, lengths, positions, masks, cache, index, num_layers,
                                        return_hidden, capture_layers)
        x = self.embed_tokens(tokens)
        if self.fused.applies(self, T, cache, chunk if causal_block else SMALL_BATCH_ROWS):
            angles = {kind: self._rope_angles(positions, kind) for kind in set(self.config.layer_types)}
            normed, captured = self.fused.run_layers(self, x, angles, masks, cache, rows[:, 0], index[1],
                                                     num_layers, capture_layers)
            hidden = normed[:, logits_from:]
        else:
            ropes = {kind: self._rope(positions, kind) for kind in set(self.config.layer_types)}
            caches = list(zip(cache.k[:num_layers], cache.v[:num_layers]))
            x, captured = self._run_layers(x, ropes, masks, self._causal(T, from_start), caches, tuple(slots), index,
                                           capture_layers)
            for slot, start in zip(slots, starts):  # keys the kernels' copy has not seen (if it keeps one)
                cache.sync_key_panels(slot, start, start + T)
            hidden = self.norm(x[:, logits_from:])
        if hidden.shape[1]:
            logits = self._head(hidden)
        else:  # a prompt's leading chunks (_forward_chunked) need no logits
            logits = torch.empty(B, 0, self.config.vocab_size, dtype=hidden.dtype, device=hidden.device)
        if return_hidden or capture_layers:
            return ForwardOutput(logits, hidden, captured)
        return logits

    def _forward_chunked(self, tokens: torch.Tensor, cache: KVCache, slots: list[int], exit_layer: int | None,
                         logits_from: int, return_hidden: bool, capture_layers: Sequence[int]
                         ) -> torch.Tensor | ForwardOutput:
        """`forward` over a prompt-sized causal block as consecutive blocks of PREFILL_CHUNK_TOKENS on the
        fused kernels (see CHUNKED_PREFILL_TOKENS). Each block is committed so that the next one sees it, and
        the slots' lengths are put back at the end: like any forward, this one commits nothing."""
        B, T = tokens.shape
        starts = [cache.lengths[s] for s in slots]
        parts = []
        try:
            for lo in range(0, T, PREFILL_CHUNK_TOKENS):
                hi = min(T, lo + PREFILL_CHUNK_TOKENS)
                parts.append(self.forward(tokens[:, lo:hi], cache, slots, exit_layer=exit_layer,
                                          logits_from=min(hi - lo, max(0, logits_from - lo)),
                                          return_hidden=return_hidden, capture_layers=capture_layers))
                for slot, start in zip(slots, starts):
                    cache.commit(slot, start + hi)
        finally:
            for slot, start in zip(slots, starts):
                cache.commit(slot, start)
        if not (return_hidden or capture_layers):
            return torch.cat(parts, dim=1)
        captured = torch.cat([p.captured for p in parts], dim=2) if capture_layers else None
        return ForwardOutput(torch.cat([p.logits for p in parts], dim=1), torch.cat([p.hidden for p in parts], dim=1),
                             captured)

    def _forward_ragged(self, tokens: torch.Tensor, lengths: Sequence[int], positions: torch.Tensor,
                        masks: dict[str, torch.Tensor], cache: KVCache, index: tuple[torch.Tensor, torch.Tensor],
                        num_layers: int, return_hidden: bool, capture_layers: Sequence[int]
                        ) -> torch.Tensor | ForwardOutput:
        """`forward` over the real rows of padded blocks only: each block's real tokens become one packed
        sequence of the fused forward, each token with its own cache position and row of the block's mask.
        Every sequence's keys and values are stored before any attention reads them, so a token sees the
        block's earlier tokens as in the padded layout, and each row gets the bits it gets there (the
        kernels' row invariance). Outputs come back in the padded layout; padding rows are left unset."""
        B, T = tokens.shape
        real = (torch.arange(T)[None, :] < torch.tensor(list(lengths))[:, None]).reshape(-1)
        flat = real.nonzero().squeeze(1)                                           # [N] into the B*T rows
        entry_masks = {kind: m[:, 0, :, 0, :].reshape(B * T, -1)[flat][:, None, None, None, :].contiguous()
                       for kind, m in masks.items()}
        entry_positions = positions.reshape(-1)[flat][:, None]
        angles = {kind: self._rope_angles(entry_positions, kind) for kind in set(self.config.layer_types)}
        seq_lens = [n for n in lengths if n > 0]
        slots = index[0][:, 0][torch.tensor(list(lengths)) > 0]                    # one per packed sequence
        x = self.embed_tokens(tokens.reshape(-1)[flat][:, None])                   # [N, 1, dim]
        normed, captured = self.fused.run_layers(self, x, angles, entry_masks, cache, slots,
                                                 index[1].reshape(-1)[flat][:, None], num_layers, capture_layers,
                                                 seq_lens)
        logits = self._head(normed[:, 0])

        def padded(rows: torch.Tensor) -> torch.Tensor:  # [..., N, width] -> [..., B, T, width]
            out = rows.new_empty(*rows.shape[:-2], B * T, rows.shape[-1])
            out[..., flat, :] = rows
            return out.view(*rows.shape[:-2], B, T, rows.shape[-1])

        if return_hidden or capture_layers:
            return ForwardOutput(padded(logits), padded(normed[:, 0]),
                                 padded(captured[:, :, 0]) if captured is not None else None)
        return padded(logits)

    def reuses_cache_entries(self, cache: KVCache, prompt_tokens: int) -> bool:
        """Whether the cache entries a prompt of this length writes, and those of every token decoded after it,
        are the bits any forward over the same tokens writes: on the fused kernels (row invariance), with the
        prompt run in their chunks (not a GEMM). Then a later prompt that starts with the same tokens may copy
        them instead of computing them again."""
        return prompt_tokens <= CHUNKED_PREFILL_TOKENS and self.fused.applies(self, 1, cache)

    def forward_sequence(self, tokens: torch.Tensor, capture_layers: Sequence[int] = ()) -> ForwardOutput:
        """Cache-free forward over whole sequences [B, T] from position 0, usable with autograd (no inference
        mode, no cache writes): training drafters on the target's features needs gradients through it. The
        PyTorch modules only; decoding goes through `forward`."""
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device)[None, :].expand(B, T)
        masks = attention_masks(self.config, [0] * B, positions, None, T)
        ropes = {kind: self._rope(positions, kind) for kind in set(self.config.layer_types)}
        self._check_capture(capture_layers, len(self.layers))
        x, captured = self._run_layers(self.embed_tokens(tokens), ropes, masks, self._causal(T, True), None, (), None,
                                       capture_layers)
        hidden = self.norm(x)
        return ForwardOutput(self._head(hidden, exact_rows=False), hidden, captured)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the first layer receives them (Gemma's scale included); draft heads that
        share the target's embeddings read them here."""
        x = self.embed(tokens)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def _head(self, hidden: torch.Tensor, exact_rows: bool = True) -> torch.Tensor:
        """Logits of every row; exact_rows: each with the bits it gets alone, whatever the batch size."""
        # The quantized drafts swap in their own head modules (row-invariant by their own kernels).
        head = self.lm_head
        logits = head(hidden, exact_rows=exact_rows) if isinstance(head, (Linear, GGUFLinear)) else head(hidden)
        if self.config.final_logit_softcapping:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _causal(self, tokens: int, from_start: bool) -> dict[str, bool]:
        """Per layer kind: the mask is plainly causal from key 0 (a prompt whose block fits the window)."""
        window = self.config.sliding_window
        return {kind: from_start and (kind == "full" or window is None or tokens <= window)
                for kind in self.config.layer_types}

    def _check_capture(self, capture_layers: Sequence[int], num_layers: int) -> None:
        if any(not 0 <= layer < num_layers for layer in capture_layers):
            raise ValueError(f"capture_layers {list(capture_layers)} outside the {num_layers} layers run")

    def _run_layers(self, x: torch.Tensor, ropes: dict, masks: dict, causal: dict,
                    caches: list[tuple[torch.Tensor, torch.Tensor]] | None, slots: tuple[int, ...],
                    index: tuple[torch.Tensor, torch.Tensor] | None, capture_layers: Sequence[int] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hot loop: every layer reads its own slice of the KV cache (or none: `caches` None). Returns the
        residual stream and, stacked, its value after each layer in `capture_layers` (else None)."""
        num_layers = len(caches) if caches is not None else len(self.layers)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers[:num_layers]):
            k_cache, v_cache = caches[i] if caches is not None else (None, None)
            kind = self.config.layer_types[i]
            x = layer(x, ropes[kind], k_cache, v_cache, slots, index, masks[kind], causal[kind])
            if i in capture_layers:
                captured[i] = x
        return x, torch.stack([captured[i] for i in capture_layers]) if capture_layers else None

    def _rope_angles(self, positions: torch.Tensor, kind: str) -> torch.Tensor:
        """[B, T, head_dim / 2] fp32 rotation angles of each position (sliding layers have their own base)."""
        inv_freq = self.inv_freq_local if kind == "sliding" else self.inv_freq
        return positions.float()[..., None] * inv_freq

    def _rope(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self._rope_angles(positions, kind)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        sin = emb.sin()
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return emb.cos().to(self.dtype), signed_sin.to(self.dtype)


def attention_masks(config: ModelConfig, starts: list[int], positions: torch.Tensor, tree_mask: torch.Tensor | None,
                    key_len: int, branch_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Additive fp32 masks [B, 1, T, 1, key_len] per layer kind.

    A new token sees every committed key (within the sliding window, by position) and the new keys that
    `tree_mask` allows; stale keys past the new block and the padding up to key_len are hidden.
    """
    B, T = positions.shape
    device = positions.device
    key_idx = torch.arange(key_len, device=device)
    start_t = torch.tensor(starts, device=device)[:, None]                      # [B, 1]
    rel = key_idx[None, :] - start_t                                            # [B, L]: key - block start
    committed = rel < 0                                                         # [B, L]
    visible = committed[:, None, :].expand(B, T, key_len)
    if branch_mask is not None:  # committed tree nodes: visible to their descendants only
        m = branch_mask.shape[-1]
        branch_rel = rel + m                                                    # [B, L]
        in_branch = ((branch_rel >= 0) & (branch_rel < m))[:, None, :]
        branch_vis = torch.gather(branch_mask.to(device), 2,
                                  branch_rel.clamp(0, m - 1)[:, None, :].expand(B, T, key_len))
        visible = visible & (~in_branch | branch_vis)
    in_block = (rel >= 0) & (rel < T)
    if tree_mask is None:  # causal: new token i sees new keys 0..i
        block_vis = (rel >= 0)[:, None, :] & (rel[:, None, :] <= torch.arange(T, device=device)[None, :, None])
    else:
        block_vis = in_block[:, None, :] & torch.gather(tree_mask.expand(B, T, T), 2,
                                                        rel.clamp(0, T - 1)[:, None, :].expand(B, T, key_len))
    visible = visible | block_vis
    out = {"full": _additive(visible)}
    if "sliding" in config.layer_types:
        key_pos = torch.where(committed, key_idx[None, :], torch.zeros_like(key_idx)[None, :])
        new_pos = torch.gather(positions, 1, rel.clamp(0, T - 1))
        key_pos = torch.where(in_block, new_pos, key_pos)                       # [B, L]
        window = config.sliding_window
        near = key_pos[:, None, :] > positions[:, :, None] - window             # [B, T, L]
        out["sliding"] = _additive(visible & near)
    return out


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """[B, T, L] bool -> additive fp32 [B, 1, T, 1, L], broadcasting over KV heads and the query group."""
    return torch.where(visible, 0.0, float("-inf"))[:, None, :, None]
