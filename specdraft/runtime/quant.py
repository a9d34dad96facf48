"""Weight-only int8 / int4 quantized linear layers for CPU ("quant:int8" / "quant:int4" drafters).

The target model's own weights, quantized, make a cheap draft model: same tokenizer, same architecture,
roughly 2-4x less memory traffic per decoded token.  Only the weights are quantized; activations stay
floating point and the matmul runs in torch's weight-only CPU kernels:

* int8: ``torch.ops.aten._weight_int8pack_mm(x [M,K], w int8 [N,K], scales [N])`` -- symmetric,
  one scale per output channel; ``y = (x @ w.T) * scales``.
* int4: ``torch.ops.aten._convert_weight_to_int4pack_for_cpu(q int32 [N,K] in 0..15, inner_k_tiles)``
  -> uint8 ``[N, K/2]`` (a CPU-specific blocked layout, blocks of 64 output rows), then
  ``torch.ops.aten._weight_int4pack_mm_for_cpu(x [M,K], packed, group_size, scales_and_zeros [K/G, N, 2])``.
  Asymmetric, one (scale, zero) pair per group of ``group_size`` input features; the kernel dequantizes
  ``w = (q - 8) * scale + zero``.

Kernel constraints found by experiment on torch 2.13 (x86, AVX512 build); they are why the modules pad:

* Both kernels want ``x`` 2-D and contiguous, and ``scales`` in exactly ``x``'s dtype.
* The bf16 int8 kernel walks K in steps of 16 with *aligned* SIMD loads: it returns garbage when
  ``K % 16 != 0`` and segfaults when the activation rows are not 32-byte aligned (e.g. a contiguous view
  with an odd storage offset).  ``Int8Linear`` therefore zero-pads K to a multiple of 16 (padded weight
  columns are zero, so padded activation columns contribute nothing) and copies misaligned inputs.
* int4: ``N % 16 == 0`` (checked by the packing op), ``group_size`` in {32, 64, 128, 256} and
  ``K % group_size == 0`` (checked by the matmul).  ``inner_k_tiles`` is ignored by the CPU packing.
  ``Int4Linear`` picks the largest valid group size not above the requested one that divides K
  (576 -> 64 for a requested 128); if K is not a multiple of 32 it zero-pads K to the next multiple of 32;
  if N is not a multiple of 16 it pads N with zero rows and slices the output.
* fp32 (and fp16) activations are accepted by both kernels but run a scalar fallback on x86 that is 10-30x
  slower than the bf16 path (49152x576, one row, 2 threads: int8 8.1 ms fp32 vs 0.9 ms bf16; int4 22 ms vs
  0.7 ms).  So by default the modules *compute* in bf16 whatever the activation dtype: fp32/fp16 inputs
  are cast to bf16 on the way in and the result cast back to the input dtype on the way out.  The extra
  rounding (~2^-9 relative on activations) is far below the weight-quantization error.  Pass
  ``compute_dtype=torch.float32`` to get fp32 kernels (exact w.r.t. the dequantized weight, slow).

The kernels are CPU-only; these modules raise a clear error for other devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.runtime import cpu_kernels

__all__ = [
    "Int4Linear",
    "Int8Linear",
    "INT4_GROUP_SIZES",
    "choose_int4_group_size",
    "quant_supported",
    "quantize_linears",
]

INT4_GROUP_SIZES = (256, 128, 64, 32)
_INT8_K_MULTIPLE = 16  # bf16 int8 kernel: K stepped by 16 with aligned loads
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: N % 16 == 0
_INT4_PACK_ROW_BLOCK = 64  # packed layout works in blocks of 64 (AVX512) or 32 rows: chunk on multiples
_ROW_CHUNK = 4096  # rows quantized at a time (bounds temporary memory for 262144-row vocab matrices)
_ALIGN = 32  # bytes; activation rows must be 32-byte aligned for the int8 bf16 kernel
_EPS = 1e-10


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


_COMPUTE_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _check_compute_dtype(dtype: torch.dtype) -> None:
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {_COMPUTE_DTYPES}, got {dtype}")


def _check_cpu(x: Tensor) -> None:
    if x.device.type != "cpu":
        raise RuntimeError(
            f"quantized linear layers use torch's CPU-only weight-only kernels; got input on {x.device}"
        )


def _output(y: Tensor, dtype: torch.dtype, bias: Tensor | None, lead: torch.Size) -> Tensor:
    """A quantized matmul's rows [N, out] as the layer's output: the input's dtype, the bias added, the input's
    leading shape."""
    if y.dtype != dtype:
        y = y.to(dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, y.shape[-1])


def _prep_input(x2: Tensor, compute_dtype: torch.dtype, pad_k: int) -> Tensor:
    """[M, K] activations -> contiguous, 32-byte aligned, compute-dtype, K-padded."""
    if x2.dtype != compute_dtype:
        x2 = x2.to(compute_dtype)
    if pad_k:
        x2 = F.pad(x2, (0, pad_k))
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if x2.data_ptr() % _ALIGN:
        x2 = x2.clone()
    return x2


def choose_int4_group_size(in_features: int, group_size: int = 128) -> tuple[int, int]:
    """Return ``(group_size, padded_in_features)`` for the int4 CPU kernel.

    The kernel accepts group sizes 32/64/128/256 that divide K.  We take the largest of those that is
    not above the requested ``group_size`` (smaller groups are only ever *more* accurate) and divides K.
    If K is not a multiple of 32 no group size fits, so K is zero-padded to the next multiple of 32
    (costs one small pad of the activations per call) and the choice is made on the padded K.
    """
    if in_features <= 0:
        raise ValueError(f"in_features must be positive, got {in_features}")
    cap = max(group_size, INT4_GROUP_SIZES[-1])
    k_pad = _round_up(in_features, INT4_GROUP_SIZES[-1])
    for g in INT4_GROUP_SIZES:
        if g <= cap and k_pad % g == 0:
            return g, k_pad
    raise AssertionError("unreachable: 32 always divides the padded K")


class Int8Linear(nn.Module):
    """``nn.Linear`` replacement with int8 weights, symmetric per-output-channel scales.

    Buffers: ``weight_int8`` [out, K_pad] int8, ``scales`` [out] in ``compute_dtype``, optional ``bias``.
    K is zero-padded to a multiple of 16 (see module docstring: the bf16 kernel reads K in 16-wide
    aligned chunks and returns garbage otherwise).
    """

    bits = 8

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 compute_dtype: torch.dtype = torch.bfloat16, bias_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_compute_dtype(compute_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        k_pad = _round_up(in_features, _INT8_K_MULTIPLE)
        self.pad_k = k_pad - in_features
        self.register_buffer("weight_int8", torch.zeros(out_features, k_pad, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=compute_dtype))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype))
        else:
            self.bias = None

    @classmethod
    @torch.no_grad()
    def from_linear_weight(cls, weight: Tensor, bias: Tensor | None = None, group_size: int | None = None,
                           dtype: torch.dtype | None = None,
                           compute_dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        """Quantize ``weight`` [out, in] (any float dtype).  ``group_size`` is ignored (per-channel);
        ``dtype`` is the dtype the bias is kept in (default: the bias' own dtype, else the weight's)."""
        del group_size
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        out_f, in_f = weight.shape
        bias_dtype = dtype or (bias.dtype if bias is not None else weight.dtype)
        mod = cls(in_f, out_f, bias=bias is not None, compute_dtype=compute_dtype, bias_dtype=bias_dtype)
        w = weight.detach().to("cpu")
        for r0 in range(0, out_f, _ROW_CHUNK):
            wc = w[r0:r0 + _ROW_CHUNK].to(torch.float32, copy=True)  # copy: modified in place below
            w_min, w_max = torch.aminmax(wc, dim=1)
            scale = torch.maximum(-w_min, w_max).clamp_min_(_EPS).div_(127.0)
            # round the scale to what the kernel will use, then quantize against that exact value
            scale = scale.to(compute_dtype).float()
            q = wc.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
            mod.weight_int8[r0:r0 + _ROW_CHUNK, :in_f] = q
            mod.scales[r0:r0 + _ROW_CHUNK] = scale.to(compute_dtype)
        if bias is not None:
            mod.bias.copy_(bias.detach().to("cpu", bias_dtype))
        return mod

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The effective float weight [out, in] the kernel multiplies by."""
        w = self.weight_int8[:, :self.in_features].float() * self.scales.float()[:, None]
        return w.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        _check_cpu(x)
        lead = x.shape[:-1]
        rows = x.numel() // x.shape[-1]
        if (x.dtype == torch.bfloat16 and self.compute_dtype == torch.bfloat16 and self.pad_k == 0 and rows
                and rows <= cpu_kernels.SMALL_BATCH_ROWS and cpu_kernels.available()
                and (self.bias is None or self.bias.dtype == torch.bfloat16)):
            # a draft's few rows (its LM head, every draft step): the C kernel reads the int8 bytes at the
            # memory bandwidth (measured 3.7x faster than torch's kernel for a 49152-row head on Sapphire Rapids)
            y = cpu_kernels.linear_i8(x.reshape(rows, -1), self.weight_int8, self.scales, self.bias,
                                      torch.get_num_threads())
            return y.reshape(*lead, self.out_features)
        x2 = _prep_input(x.reshape(-1, x.shape[-1]), self.compute_dtype, self.pad_k)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales)
        return _output(y, x.dtype, self.bias, lead)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, compute_dtype={self.compute_dtype}, pad_k={self.pad_k}")


class Int4Linear(nn.Module):
    """``nn.Linear`` replacement with int4 weights, asymmetric group-wise (scale, zero) per group.

    Buffers: ``weight_int4`` uint8 [N_pad, K_pad/2] in the CPU kernel's packed layout,
    ``scales_and_zeros`` [K_pad/G, N_pad, 2] in ``compute_dtype``, optional ``bias`` [out].

    Padding (both with zeros, both invisible to callers; see the module docstring for the constraints):
    N is padded to a multiple of 16 because the packing op requires it, and the extra output columns are
    sliced off; K is padded to a multiple of 32 only when no legal group size (32/64/128/256) divides it,
    in which case activations are zero-padded per call.  The group size actually used is
    ``self.group_size`` (the largest legal one <= the requested one that divides K).
    """

    bits = 4

    def __init__(self, in_features: int, out_features: int, *, group_size: int = 128, bias: bool = False,
                 compute_dtype: torch.dtype = torch.bfloat16, bias_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_compute_dtype(compute_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self.requested_group_size = group_size
        self.group_size, k_pad = choose_int4_group_size(in_features, group_size)
        self.pad_k = k_pad - in_features
        n_pad = _round_up(out_features, _INT4_N_MULTIPLE)
        self.pad_n = n_pad - out_features
        self.register_buffer("weight_int4", torch.zeros(n_pad, k_pad // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros",
                             torch.zeros(k_pad // self.group_size, n_pad, 2, dtype=compute_dtype))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype))
        else:
            self.bias = None

    @classmethod
    @torch.no_grad()
    def from_linear_weight(cls, weight: Tensor, bias: Tensor | None = None, group_size: int = 128,
                           dtype: torch.dtype | None = None,
                           compute_dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
        """Quantize ``weight`` [out, in].  ``group_size`` is the requested group (may be reduced to fit
        K, see :func:`choose_int4_group_size`); ``dtype`` is the dtype the bias is kept in."""
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        out_f, in_f = weight.shape
        bias_dtype = dtype or (bias.dtype if bias is not None else weight.dtype)
        mod = cls(in_f, out_f, group_size=group_size, bias=bias is not None,
                  compute_dtype=compute_dtype, bias_dtype=bias_dtype)
        g = mod.group_size
        n_pad, k_pad = mod.weight_int4.shape[0], mod.weight_int4.shape[1] * 2
        w = weight.detach().to("cpu")
        chunk = _round_up(_ROW_CHUNK, _INT4_PACK_ROW_BLOCK)
        for r0 in range(0, n_pad, chunk):
            r1 = min(r0 + chunk, n_pad)
            real = max(0, min(r1, out_f) - r0)
            if real == r1 - r0 and k_pad == in_f:
                wc = w[r0:r1].to(torch.float32, copy=True)  # copy: modified in place below
            else:
                wc = torch.zeros(r1 - r0, k_pad, dtype=torch.float32)
                wc[:real, :in_f] = w[r0:r0 + real]
            wg = wc.view(r1 - r0, k_pad // g, g)
            w_min, w_max = torch.aminmax(wg, dim=2)
            scale = (w_max - w_min).clamp_min_(_EPS).div_(15.0).to(compute_dtype).float()
            # kernel: w = (q - 8) * scale + zero; with zero = min + 8 * scale this is q * scale + min.
            zero = (w_min + 8.0 * scale).to(compute_dtype).float()
            # quantize against the rounded (scale, zero) the kernel will actually use:
            # q = round((w - lo) / scale) with lo = zero - 8 * scale, computed as floor(w * inv + off)
            # with off = 0.5 - lo * inv, clamped to [0, 15] (one fused pass + clamp + int cast)
            inv = scale.reciprocal()
            off = (0.5 - (zero - 8.0 * scale) * inv)
            torch.addcmul(off[..., None], wg, inv[..., None], out=wg)
            q = wg.clamp_(0.0, 15.0).view(r1 - r0, k_pad).to(torch.int32)  # trunc == floor here (>= 0)
            mod.weight_int4[r0:r1] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
            mod.scales_and_zeros[:, r0:r1, 0] = scale.t().to(compute_dtype)
            mod.scales_and_zeros[:, r0:r1, 1] = zero.t().to(compute_dtype)
        if bias is not None:
            mod.bias.copy_(bias.detach().to("cpu", bias_dtype))
        return mod

    # The packed layout depends on the CPU capability torch dispatches to (blocks of 64 rows on AVX512,
    # 32 on AVX2, yet another order on DEFAULT; verified: the same codes pack to different bytes), so a
    # state_dict is only valid on a machine with the same capability.  Record it and refuse mismatches.
    def get_extra_state(self) -> dict:
        return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "group_size": self.group_size,
                "format": "int4pack_for_cpu/v1"}

    def set_extra_state(self, state: dict) -> None:
        here = torch.backends.cpu.get_cpu_capability()
        if state.get("cpu_capability") != here:
            raise RuntimeError(
                f"Int4Linear weights were packed for CPU capability {state.get('cpu_capability')!r} but this "
                f"process dispatches to {here!r}; the packed layouts differ.  Re-quantize from the float "
                "weights instead of loading the packed state_dict.")
        if state.get("group_size") != self.group_size:
            raise RuntimeError(f"group size mismatch: state has {state.get('group_size')}, "
                               f"module has {self.group_size}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The effective float weight [out, in] the kernel multiplies by (for tests/debugging).

        The packed layout is the kernel's business (blocks of 64 rows interleave rows j and j+32, a
        16/32/48-row tail interleaves neighbours), so the 4-bit codes are read back through the kernel
        itself: identity activations with scale 1 and zero 8 give exactly ``q`` (0..15 are exact in
        bf16; the fast bf16 path is used), then ``(q - 8) * scale + zero`` is applied here in fp32.
        """
        n_pad, k_pad = self.weight_int4.shape[0], self.weight_int4.shape[1] * 2
        g = self.group_size
        unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(k_pad // g, n_pad, 2).contiguous()
        eye = torch.eye(k_pad, dtype=torch.bfloat16)
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.weight_int4, g, unit).float().t()
        sz = self.scales_and_zeros.float().repeat_interleave(g, dim=0)  # [K_pad, N_pad, 2]
        w = (q - 8.0) * sz[..., 0].t() + sz[..., 1].t()
        return w[:self.out_features, :self.in_features].contiguous().to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        _check_cpu(x)
        lead = x.shape[:-1]
        x2 = _prep_input(x.reshape(-1, x.shape[-1]), self.compute_dtype, self.pad_k)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight_int4, self.group_size,
                                                       self.scales_and_zeros)
        if self.pad_n:
            y = y[:, :self.out_features]
        return _output(y, x.dtype, self.bias, lead)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group_size={self.group_size}, "
                f"compute_dtype={self.compute_dtype}, pad_k={self.pad_k}, pad_n={self.pad_n}")


@functools.cache
def quant_supported(bits: int) -> bool:
    """Whether this torch build has a working CPU kernel for ``bits`` (8 or 4).

    Runs the op once on a tiny tensor (result cached) and checks the answer, so callers can fail with a
    clear message instead of an obscure dispatcher error (or a silently wrong kernel) later.
    """
    if bits not in (4, 8):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(32, 64, generator=gen) * 0.02
        x = torch.randn(3, 64, generator=gen)
        mod = (Int8Linear if bits == 8 else Int4Linear).from_linear_weight(w, None, group_size=32)
        y = mod(x)
        ref = x @ w.t()
        err = ((y.float() - ref).norm() / ref.norm()).item()
        return bool(torch.isfinite(y).all()) and err < (0.05 if bits == 8 else 0.3)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def quantize_linears(module: nn.Module, bits: int, group_size: int = 128,
                     skip: Callable[[str], bool] | None = None, *,
                     compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every ``nn.Linear`` in ``module`` (recursively) by ``Int8Linear`` / ``Int4Linear``.

    ``skip(name)`` (qualified name as in ``named_modules()``) keeps a Linear in full precision.
    Modifies ``module`` in place and returns it; if ``module`` itself is an ``nn.Linear`` (name ``""``),
    the quantized replacement is returned instead.  Linears that share one weight tensor (tied
    weights) share one quantized module.  Bias is kept in the Linear's own dtype.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not quant_supported(bits):
        raise RuntimeError(f"this torch build ({torch.__version__}) lacks a working int{bits} weight-only "
                           "CPU kernel (_weight_int8pack_mm / _weight_int4pack_mm_for_cpu)")
    cls = Int8Linear if bits == 8 else Int4Linear
    targets = [(name, mod) for name, mod in module.named_modules(remove_duplicate=False)
               if isinstance(mod, nn.Linear) and not (skip is not None and skip(name))]
    done: dict[tuple[int, int | None], nn.Module] = {}
    for name, lin in targets:
        key = (id(lin.weight), None if lin.bias is None else id(lin.bias))
        q = done.get(key)
        if q is None:
            q = cls.from_linear_weight(lin.weight, lin.bias, group_size=group_size,
                                       compute_dtype=compute_dtype)
            done[key] = q
        if name == "":
            return q
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, q)
    return module
