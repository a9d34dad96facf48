"""The fused CPU backend: runs a `Transformer`'s layers in one call into the C kernels (cpu_kernels.c).

The model file stays a model read top to bottom; everything that is only about feeding the C library lives
here: the table of raw weight pointers (rebuilt when the model's parameters or modules are replaced), the
per-cache address tables, and the thread governor. The backend applies to bf16 models on CPU for blocks of
up to `SMALL_BATCH_ROWS` tokens per sequence (decoding and verification, any number of sequences); the
model runs its PyTorch modules otherwise.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from specdraft.runtime import cpu_kernels
from specdraft.runtime.cpu_kernels import SMALL_BATCH_ROWS  # noqa: F401  (re-exported: model, engine)
from specdraft.runtime.gguf_native import GGUFLinear
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.quant import Int8Linear
from specdraft.smoothing import ema


class FusedCPUBackend:
    """One per model: see the module docstring."""

    def __init__(self) -> None:
        self._weights: tuple | None = None  # (norm weight, first wqkv module, library, kept tensors, (layers, shape))
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.governors: dict[int, ThreadGovernor] = {}

    def governor_for(self, rows: int) -> ThreadGovernor:
        """The thread governor of forwards of about `rows` rows (one per power-of-two bucket): what one thread
        costs against all of them depends on the rows (a decoding step is bandwidth-bound, a batch or a prompt
        chunk compute-bound), so a mode measured on one size is never applied to another. With one governor
        for single-row steps only, a noisy moment at the end of a serving level (one request left) switched
        a server to one thread, and the batched rounds of the next level, which that governor never timed,
        ran on it: 8 and 16 clients at 0.6x of the other server process in the same run."""
        return self.governors.setdefault(rows.bit_length(), ThreadGovernor())

    @property
    def governor(self) -> ThreadGovernor:
        """The governor of single-row forwards (decoding one sequence)."""
        return self.governor_for(1)

    def applies(self, model: nn.Module, tokens: int, cache: KVCache, max_tokens: int = SMALL_BATCH_ROWS) -> bool:
        """bf16 on CPU, at most max_tokens per sequence (a prompt's causal chunk may be longer than a verified
        block), kernels built, layout readable."""
        if (tokens > max_tokens or model.dtype != torch.bfloat16 or model.device.type != "cpu"
                or cache.k[0].dtype != torch.bfloat16 or not cpu_kernels.available()):
            return False
        return self._weight_table(model) is not None

    def run_layers(self, model: nn.Module, x: torch.Tensor, angles: dict[str, torch.Tensor],
                   masks: dict[str, torch.Tensor], cache: KVCache, slots: torch.Tensor, cache_pos: torch.Tensor,
                   num_layers: int, capture_layers: Sequence[int] = (), seq_lens: Sequence[int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's first `num_layers` layers on x [B, T, dim] in one C call.

        angles: RoPE angles [B, T, head_dim / 2] fp32 per layer kind. Returns the final-normed hidden states
        [B, T, dim] and the residual stream after each of `capture_layers` [len, B, T, dim] (or None).
        seq_lens: x's B * T rows are len(seq_lens) sequences of those many rows, packed one after another
        (`slots` one per sequence; `cache_pos`, masks and angles one per row), rather than B of T rows."""
        B, T, dim = x.shape
        layers, shape = self._weight_table(model)
        k_caches, v_caches, k_panels = self._cache_table(cache)
        shape.max_len = cache.max_len
        ropes = {kind: (a.reshape(B * T, -1).cos(), a.reshape(B * T, -1).sin()) for kind, a in angles.items()}
        residual = x.reshape(B * T, dim).contiguous()
        available = torch.get_num_threads()
        governor = self.governor_for(B * T)
        threads = governor.threads(available)
        start = time.perf_counter()
        normed, captured = cpu_kernels.forward_layers(
            layers, num_layers, shape, k_caches, v_caches, k_panels, residual, slots,
            cache_pos.reshape(-1).contiguous(),
            masks, ropes, B if seq_lens is None else len(seq_lens), T, threads, capture_layers, seq_lens)
        governor.record(threads, available, time.perf_counter() - start)
        if captured is not None:
            captured = captured.view(len(capture_layers), B, T, dim)
        return normed.view(B, T, dim), captured

    def _weight_table(self, model: nn.Module) -> tuple[ctypes.Array, cpu_kernels.ModelShape] | None:
        """Raw pointers to every layer's weights for the C forward (None if some layer has a layout the kernels
        do not read). Rebuilt when the parameters or linear modules are replaced (`.to()`, quantization); the
        cached entry keeps the tensors it points into alive."""
        cached = self._weights
        library = cpu_kernels.load()  # a rebuilt library (tests build each kernel path) may take other layouts
        if (cached is None or cached[0] is not model.norm.weight or cached[1] is not model.layers[0].attn.wqkv
                or cached[2] is not library):
            cached = self._weights = (model.norm.weight, model.layers[0].attn.wqkv, library,
                                      *_build_weight_table(model))
        return cached[4]

    def _cache_table(self, cache: KVCache) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array | None]:
        """The cache's per-layer key, value and key-panel addresses, kept as long as the cache lives. The key
        panels are made on first use where the kernels read them, and dropped where a kernel build that does
        not keep them (tests build each path) would let them go stale."""
        width = cpu_kernels.key_panel_width(cache.k[0].shape[-1])
        if width:
            cache.enable_key_panels(width)
        elif cache.k_panels is not None:
            cache.drop_key_panels()
        table = self._caches.get(cache)
        if table is None or table[3] is not cache.k_panels:
            assert all(t.is_contiguous() for t in (*cache.k, *cache.v))
            panels = cpu_kernels.addresses(cache.k_panels) if cache.k_panels is not None else None
            table = self._caches[cache] = (cpu_kernels.addresses(cache.k), cpu_kernels.addresses(cache.v), panels,
                                           cache.k_panels)
        return table[:3]


def _build_weight_table(model: nn.Module) -> tuple[list, tuple[ctypes.Array, cpu_kernels.ModelShape] | None]:
    cfg = model.config
    widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size)
    linears = [(layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down) for layer in model.layers]
    weights = [[_kernel_weight(m) for m in four] for four in linears]
    if (cfg.head_dim % 16 or any(w % cpu_kernels.k_multiple() for w in widths)
            or any(w is None for four in weights for w in four)):
        return [], None
    keep: list[torch.Tensor] = []

    def ptr(tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        keep.append(tensor)
        return tensor.data_ptr()

    def norm(module: nn.Module | None) -> int | None:
        return None if module is None else ptr(module.weight)

    layers = (cpu_kernels.LayerPointers * len(model.layers))()
    for i, (layer, entry) in enumerate(zip(model.layers, layers)):
        attn = layer.attn
        entry.attn_norm, entry.mlp_norm = norm(layer.attn_norm), norm(layer.mlp_norm)
        entry.post_attn_norm, entry.post_mlp_norm = norm(layer.post_attn_norm), norm(layer.post_mlp_norm)
        entry.q_norm, entry.k_norm = norm(attn.q_norm), norm(attn.k_norm)
        entry.bqkv = ptr(attn.wqkv.bias)
        for name, (weight, scale, fmt) in zip(("wqkv", "wo", "w_gate_up", "w_down"), weights[i]):
            setattr(entry, name, ptr(weight))
            setattr(entry, f"{name}_scale", ptr(scale))
            setattr(entry, f"{name}_fmt", fmt)
        entry.sliding = int(cfg.layer_types[i] == "sliding")
    first = model.layers[0]
    shape = cpu_kernels.ModelShape(
        dim=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        inter=cfg.intermediate_size, max_len=0, eps=cfg.rms_norm_eps, scale=first.attn.scale,
        softcap=first.attn.softcap or 0.0, gemma=int(cfg.is_gemma), gelu=int(cfg.hidden_act not in ("silu", "swish")),
        final_norm=norm(model.norm))
    return keep, (layers, shape)


def _kernel_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """(weight, per-output scale or None, layout) of a linear layer in a layout the C kernels read: a bf16
    nn.Linear (the model's own), an int8 weight-only layer (the quant:int8 draft) with unpadded input, or a
    GGUF-native layer (bf16 and GGUF weights in panels where the kernels multiply those); None otherwise."""
    if isinstance(module, nn.Linear) and module.weight.dtype == torch.bfloat16 and module.weight.is_contiguous():
        if cpu_kernels.dense_panels():
            return cpu_kernels.panels(module.weight), None, cpu_kernels.PANELS
        return module.weight, None, cpu_kernels.DENSE
    if (isinstance(module, Int8Linear) and module.pad_k == 0 and module.scales.dtype == torch.bfloat16
            and module.weight_int8.is_contiguous() and (module.bias is None or module.bias.dtype == torch.bfloat16)):
        return module.weight_int8, module.scales, cpu_kernels.DENSE
    if isinstance(module, GGUFLinear):
        weights, layout = module.matrix.kernel_weights()
        return weights, None, layout
    return None


class ThreadGovernor:
    """Chooses, by measurement, between all of torch's threads and one thread for the fused forward.

    The threads of one forward meet at a barrier about ten times per layer. When another process keeps one of
    the cores busy, the descheduled thread stalls every barrier: an 11 ms decoding step measured 570 ms on two
    shared cores, where one thread, which waits at no barrier, takes about 18 ms. So, like the draft-length
    controller, the governor keeps a running estimate of the forward time (of one size of forward: each size
    has its own, `FusedCPUBackend.governor_for`) in the mode it runs, and now and then times one forward in
    the other mode: after `first_probe`
    forwards, then every `interval` forwards, doubling the interval (up to `max_interval`) while the other
    mode keeps losing, and at once when the current mode has become `react` times slower than the other
    mode's last time. Results do not depend on the thread count (each output is computed by one thread, in
    the same order), so switching never changes a bit.
    """

    def __init__(self, first_probe: int = 8, interval: int = 64, max_interval: int = 1024, react: float = 2.0,
                 smoothing: float = 0.3) -> None:
        self.min_interval, self.max_interval, self.interval = interval, max_interval, interval
        self.react, self.smoothing = react, smoothing
        self.countdown = first_probe
        self.single = False  # the mode it runs in
        self.estimate: dict[bool, float | None] = {False: None, True: None}  # seconds per forward, by mode
        self.switches = 0

    def threads(self, available: int) -> int:
        if available == 1:
            return 1
        single = self.single if self.countdown > 0 else not self.single  # countdown over: probe the other
        return 1 if single else available

    def record(self, threads: int, available: int, seconds: float) -> None:
        """One forward's time with `threads` of `available` (forwards of one size: `governor_for`)."""
        if available == 1:
            return
        single = threads == 1
        if single != self.single:  # a probe of the other mode
            self.estimate[single] = seconds
            current = self.estimate[self.single]
            if current is None or seconds < current:
                self.single, self.interval = single, self.min_interval
                self.switches += 1
            else:
                self.interval = min(2 * self.interval, self.max_interval)
            self.countdown = self.interval
            return
        current = self.estimate[single] = ema(self.estimate[single], seconds, self.smoothing)
        self.countdown -= 1
        other = self.estimate[not single]
        if other is not None and current > self.react * other:
            self.countdown = 0
