"""Fused bf16 CPU kernels in C, built on first use with the system C compiler and called through ctypes.

Why: decoding SmolLM2-135M in PyTorch eager mode spends as long dispatching ~35 small operators per layer as
it does reading the weights, and `torch.mv` streams bf16 weights well below the machine's bandwidth. Here one
call (`forward_layers`) runs every layer of a forward pass: linear layers (bf16, or int8 for the quantized
self-draft), residual add + RMSNorm, q/k norm + RoPE + cache write, attention and the gated activation, with
the threads of one OpenMP parallel region. Every token row is computed with the same operations whatever
the number of rows, so verifying K draft tokens gives each one the bits it gets when decoded alone.

Linear layers take the best path the CPU has: AMX tiles (Intel Sapphire Rapids and later: a block of up to 32
tokens costs little more than one, since the tiles do the arithmetic at the speed the weights stream in),
AVX512-BF16 (AMD Zen 4), AVX-512, AVX2 + FMA, or portable C. A process uses one path for every bf16 layer
(decoding one token included), so the bits never depend on the block. `SPECDRAFT_KERNEL_AMX=0` keeps an AMX
CPU on the AVX512-BF16 path. GGUF-native layers multiply with VNNI integer dot products, and blocks of 48
rows or more (24 on 8-bit layers) on AMX-INT8 tiles where the CPU has them (the same bits;
`SPECDRAFT_Q_AMX_ROWS` moves the threshold, 0 keeps them on VNNI). Their activations are int8 per block of
32 as llama.cpp's are, those of 8-bit layers 16 bits, except an 8-bit output layer on CPUs with VNNI and no
AMX-INT8 tiles (`q8_int8_activations`, `SPECDRAFT_Q8_INT8`). Where a CPU retires AVX512-BF16 dot
products at less than half the rate of fp32 FMAs (measured once per CPU, `bf16_dot_pays`), the native build
leaves them out and takes the AVX-512 path.

The library is compiled once per source version and CPU (`-O3 -march=native -fopenmp`) into
`$SPECDRAFT_CACHE/kernels/`. Without a compiler, or with `SPECDRAFT_KERNELS=0`, the model runs its PyTorch
code instead (same results up to bf16 rounding, slower).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from specdraft.runtime.paths import cache_root

SOURCE = Path(__file__).with_name("cpu_kernels.c")

# Up to this many new tokens per sequence, blocks run in the fused kernels (bit-identical rows whatever the
# block); longer blocks (prompts) are compute-bound and go to PyTorch's GEMMs.
SMALL_BATCH_ROWS = 32
PROBE_SOURCE = Path(__file__).with_name("bf16_probe.c")


def _flags() -> list[str]:
    """SPECDRAFT_KERNEL_MARCH picks another target than this CPU (tests build the portable x86-64 variant).
    A native build leaves AVX512-BF16 out where fp32 FMAs are faster (`bf16_dot_pays`)."""
    march = os.environ.get("SPECDRAFT_KERNEL_MARCH", "native")
    flags = ["-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
    if march == "native" and not bf16_dot_pays():
        flags.append("-mno-avx512bf16")
    return flags


def _cpu_flags() -> set[str]:
    line = _cpu_signature()
    return set(line.split(":", 1)[1].split()) if line.startswith("flags") and ":" in line else set()


def _measure_bf16_dot(cpu: str) -> tuple[float, float]:
    """(VDPBF16PS, VFMADD) zmm instructions per second on one core, from bf16_probe.c; cached per CPU."""
    key = hashlib.sha256(PROBE_SOURCE.read_bytes() + cpu.encode()).hexdigest()[:16]
    cached = cache_root() / "kernels" / f"bf16-probe-{key}.txt"
    with contextlib.suppress(OSError, ValueError):
        dot, fma = (float(v) for v in cached.read_text().split()[:2])
        return dot, fma
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        exe = Path(tmp) / "bf16-probe"
        subprocess.run([compiler, "-O3", "-march=native", str(PROBE_SOURCE), "-o", str(exe)], check=True,
                       capture_output=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout
        dot, fma = (float(v) for v in out.split()[:2])
        staged = Path(tmp) / "result"
        staged.write_text(f"{dot} {fma}\n")
        staged.replace(cached)
    return dot, fma


@functools.cache
def bf16_dot_pays() -> bool:
    """Whether the kernels should multiply with AVX512-BF16 dot products on this CPU (native builds).

    Why: one VDPBF16PS does twice the products of one fp32 VFMADD, but CPUs retire them at very different
    rates (bf16_probe.c): on an Intel Xeon of the Emerald Rapids class with AMX hidden (measured: 1.33 G/s
    against 5.4 G/s per core) fp32 multiplies 2x faster, so verification blocks take the AVX-512 fp32 path
    there. Every row of the process takes the same path, so bits still never depend on the block. AMX CPUs
    keep AVX512-BF16 (their tiles need it). `SPECDRAFT_KERNEL_BF16=1` or `0` overrides the measurement."""
    forced = os.environ.get("SPECDRAFT_KERNEL_BF16", "auto")
    if forced in ("0", "1"):
        return forced == "1"
    cpu = _cpu_flags()
    if "avx512_bf16" not in cpu or "amx_tile" in cpu:
        return True  # nothing to choose (no BF16 dot products), or AMX (which needs them)
    try:
        dot, fma = _measure_bf16_dot(_cpu_signature())
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError):
        return True  # no measurement: the widths decide
    return 2 * dot >= fma

_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_enabled = True


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags()).encode() + _cpu_signature().encode())
    return cache_root() / "kernels" / f"specdraft_cpu-{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_flags(), str(SOURCE), "-o", str(out), "-lm"], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        out.replace(target)  # atomic: a concurrent build never sees a half-written library


class LayerPointers(ctypes.Structure):
    """Mirror of `sd_layer` in cpu_kernels.c: one layer's weights (None where absent). A linear layer's
    weight is bf16 [out, in], int8 with one bf16 scale per output feature (`*_scale` set), or GGUF-native
    blocks (`*_fmt` one of the Q_* layouts)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "attn_norm", "bqkv", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm",
        "wqkv", "wo", "w_gate_up", "w_down", "wqkv_scale", "wo_scale", "w_gate_up_scale", "w_down_scale",
    )] + [(name, ctypes.c_int64) for name in ("sliding", "wqkv_fmt", "wo_fmt", "w_gate_up_fmt", "w_down_fmt")]


# Weight layouts of cpu_kernels.c (SD_W_*): bf16 or int8 rows, GGUF-native blocks (gguf_native.py packs them),
# bf16 panels (`panels`); QPANELS | a GGUF layout (| HALF: scales as fp16): its panels (`q_panels`).
DENSE, Q4, Q8, Q8H, PANELS, QPANELS, HALF = 0, 1, 2, 3, 4, 8, 16
GGUF = 3  # the GGUF layout bits of a panel layout
X8 = 32  # a Q8 layer's activations asked for as int8 (`linear_q(int8_activations=True)`)


class ModelShape(ctypes.Structure):
    """Mirror of `sd_model` in cpu_kernels.c."""

    _fields_ = [(name, ctypes.c_int64) for name in ("dim", "heads", "kv_heads", "head_dim", "inter", "max_len")] \
        + [(name, ctypes.c_float) for name in ("eps", "scale", "softcap")] \
        + [("gemma", ctypes.c_int32), ("gelu", ctypes.c_int32), ("final_norm", ctypes.c_void_p)]


@functools.cache
def bf16_gemm_is_native() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX). Elsewhere (AVX2) torch
    emulates bf16 GEMMs far slower than an fp32 GEMM of the same data, casts included (measured on an AMD
    EPYC with AVX2: a 731-token prompt through a [3072, 576] layer, 156 ms in bf16 against 24 ms), so
    prompt-sized blocks compute in fp32 there and round the result to bf16."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "sd_linear": ([_P, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int], None),
    "sd_forward": ([ctypes.POINTER(LayerPointers), _I, ctypes.POINTER(ModelShape), _P, _P, _P, _P, _P, _P, _P, _P,
                    _P, _I,
                    _P, _P, _P, _P, _I, _P, ctypes.c_int, _P, _P], ctypes.c_int),
    "sd_linear_panels": ([_P, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int], None),
    "sd_dense_panels": ([], ctypes.c_int),
    "sd_panel_width": ([], _I),
    "sd_linear_i8": ([_P, _P, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int], None),
    "sd_linear_q": ([_P, _P, ctypes.c_int, _P, _P, _I, _I, _I, _P, ctypes.c_int], None),
    "sd_q_scratch_floats": ([_I, _I], _I),
    "sd_linear_qp": ([_P, _P, ctypes.c_int, _P, _P, _I, _I, _I, _P, ctypes.c_int], None),
    "sd_q_panels": ([], ctypes.c_int),
    "sd_q_amx": ([], ctypes.c_int),
    "sd_q8_int8_set": ([ctypes.c_int], ctypes.c_int),
    "sd_qp_panel_bytes": ([ctypes.c_int, _I], _I),
    "sd_q_to_panels": ([_P, ctypes.c_int, _I, _I, _P, ctypes.c_int], None),
    "sd_q_rows_from_panels": ([_P, ctypes.c_int, _I, _P, _I, _P, ctypes.c_int], None),
    "sd_q_half_exact": ([_P, ctypes.c_int, _I, _I], ctypes.c_int),
    "sd_dequant_q": ([_P, ctypes.c_int, _I, _I, _P, ctypes.c_int, ctypes.c_int], None),
    "sd_argmax_rows": ([_P, ctypes.c_int, _I, _I, _P], None),
    "sd_topk_rows": ([_P, ctypes.c_int, _I, _I, _I, _P], None),
    "sd_q_row_bytes": ([ctypes.c_int, _I], _I),
    "sd_linear_k_multiple": ([], ctypes.c_int),
    "sd_key_panel_width": ([_I], ctypes.c_int),
    "sd_has_avx512": ([], ctypes.c_int),
    "sd_simd_level": ([], ctypes.c_int),
    "sd_amx_init": ([], ctypes.c_int),
}


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None (with a warning, once) when it cannot be built."""
    global _lib, _load_error
    if _lib is not None or _load_error is not None:
        return _lib
    if os.environ.get("SPECDRAFT_KERNELS", "1") == "0":
        _load_error = "disabled by SPECDRAFT_KERNELS=0"
        return None
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = restype
        if os.environ.get("SPECDRAFT_KERNEL_AMX", "1") != "0":
            lib.sd_amx_init()  # AMX builds use tiles from here on, for every bf16 linear layer, if Linux allows
        _lib = lib
        # GGUF panels on AMX-INT8 tiles from this many rows (0: never); the 8-bit output layer on int8 (1) or
        # 16-bit (0) activations
        _tuning_from_env("SPECDRAFT_Q_AMX_ROWS", "an integer >= 0", str.isdigit, lambda v: q_amx_rows(int(v)),
                         q_amx_rows)
        _tuning_from_env("SPECDRAFT_Q8_INT8", "0 or 1", lambda v: v in ("0", "1"),
                         lambda v: q8_int8_activations(v == "1"), lambda: int(q8_int8_activations()))
    except (OSError, RuntimeError) as exc:
        _load_error = str(exc)
        warnings.warn(f"specdraft: fused CPU kernels unavailable, using PyTorch ops ({exc})", stacklevel=2)
    return _lib


def _tuning_from_env(name: str, expected: str, valid: Callable[[str], bool], apply: Callable[[str], Any],
                     current: Callable[[], Any]) -> None:
    """Apply the kernels' tuning knob `name` from the environment if set; a bad value is a warning (the
    default kept, the kernels kept), not an error."""
    value = os.environ.get(name)
    if value is None:
        return
    if valid(value.strip()):
        apply(value.strip())
    else:
        warnings.warn(f"specdraft: {name} must be {expected}, got {value!r}; keeping {current()}", stacklevel=3)


def available() -> bool:
    return _enabled and load() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the PyTorch ops instead of the kernels inside this block (tests compare both paths)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def unavailable_reason() -> str | None:
    load()
    return _load_error


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias, bf16 in and out, fp32 accumulation (in `panels` of the weight where
    this CPU's kernels multiply those)."""
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16)
    # The AVX512-BF16 kernel reads bf16 x directly; the others widen it to fp32 first, into this.
    scratch = None if k_multiple() == 32 else torch.empty(M * K, dtype=torch.float32)
    if dense_panels():
        _lib.sd_linear_panels(x.data_ptr(), panels(weight).data_ptr(), _ptr(bias), y.data_ptr(), M, N, K,
                              _ptr(scratch), threads)
    else:
        _lib.sd_linear(x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), M, N, K, _ptr(scratch), threads)
    return y


def dense_panels() -> bool:
    """Whether bf16 weights are multiplied in panels (`panels`) on this CPU: AVX-512 without AMX tiles. The
    other paths read the weight rows as they are."""
    return bool(_lib.sd_dense_panels())


# (id(tensor), what) -> (weakref to the tensor, its version, its data pointer, the layout made from it); an
# entry leaves with its tensor.
_Layout = TypeVar("_Layout")
_layouts: dict[tuple[int, str], tuple[weakref.ref, int | None, int, Any]] = {}


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


def cached_layout(tensor: torch.Tensor, what: str) -> _Layout | None:
    """The rearrangement `what` of `tensor` if `_layout_of` made it and it is still current (same tensor, not
    changed in place, same storage), else None."""
    entry = _layouts.get((id(tensor), what))
    if (entry is None or entry[0]() is not tensor or entry[1] != _version(tensor)
            or entry[2] != tensor.data_ptr()):
        return None
    return entry[3]


def _layout_of(tensor: torch.Tensor, what: str, make: Callable[[], _Layout]) -> _Layout:
    """make() (a rearrangement of `tensor` for the kernels), made once and kept while the tensor lives; made
    again when the tensor is changed in place (its version counter moves) or its storage is replaced."""
    made = cached_layout(tensor, what)
    if made is not None:
        return made
    made = make()
    key = (id(tensor), what)
    alive = weakref.ref(tensor, lambda _, key=key: _layouts.pop(key, None))
    _layouts[key] = (alive, _version(tensor), tensor.data_ptr(), made)
    return made


def panels(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] in the kernels' panel layout, [ceil(N / P), K / 2, P, 2] with P outputs per panel
    (cpu_kernels.c says why), zero rows past N; kept with the weight (`_layout_of`)."""
    N, K = weight.shape
    if weight.dtype != torch.bfloat16 or K % 2:
        raise ValueError(f"panels need a bf16 weight with an even input width, not {weight.dtype} [{N}, {K}]")

    def make() -> torch.Tensor:
        width = int(_lib.sd_panel_width())
        padded = -(-N // width) * width
        rows = weight.detach()
        if padded != N:
            rows = torch.cat([rows, rows.new_zeros(padded - N, K)])
        return rows.view(padded // width, width, K // 2, 2).transpose(1, 2).contiguous()

    return _layout_of(weight, "panels", make)


def q_panels_active() -> bool:
    """Whether GGUF-native weights are multiplied in panels (`q_panels`) on this CPU (AVX-512)."""
    return bool(_lib.sd_q_panels())


def q_amx_rows(rows: int | None = None) -> int:
    """The block size from which GGUF-native panels multiply on AMX-INT8 tiles, 8-bit layers from half as many
    (0: never; always 0 where the build or the CPU has no AMX, or SPECDRAFT_KERNEL_AMX=0). Both paths give every
    row the same bits, so this is only about speed. `rows` sets it (benchmarks, tests, `SPECDRAFT_Q_AMX_ROWS`);
    returns the value before."""
    setting = ctypes.c_int64.in_dll(_lib, "sd_q_amx_rows")
    previous = setting.value if _lib.sd_q_amx() else 0
    if rows is not None:
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ValueError(f"rows must be an integer >= 0, got {rows!r}")
        setting.value = rows
    return previous


def q8_int8_activations(on: bool | None = None) -> bool:
    """Whether GGUF-native 8-bit layers (Q8_0, Q5_0) that ask for it (`linear_q(int8_activations=True)`: the
    output layer, `gguf_native.attach_native`) take their activations as int8 per block of 32, as llama.cpp's
    Q8_0 dot products do, with half the multiplies of 16-bit activations: on by default where the CPU has
    AVX512-VNNI and no AMX-INT8 tiles (which multiply large blocks of 16-bit activations, and must give every
    row the bits the panels give it). Every row gets the same bits in any block either way. `on` sets it (as
    `SPECDRAFT_Q8_INT8=0|1` does at load; no effect without VNNI); returns the value before."""
    return bool(_lib.sd_q8_int8_set(-1 if on is None else int(bool(on))))


def q_panels(packed: torch.Tensor, fmt: int, in_features: int, half_scales: bool = True
             ) -> tuple[torch.Tensor, int]:
    """GGUF-native rows (uint8 [N, row bytes] in layout `fmt`) as the kernels' panels of 16 outputs, uint8
    [ceil(N / 16), panel bytes] (cpu_kernels.c: the same integers and scales, rearranged), and their layout:
    `fmt | HALF` where every scale is an fp16 value (the same weights in fewer bytes; half_scales=False keeps
    them fp32), else `fmt`. Kept with `packed`."""

    def make() -> tuple[torch.Tensor, int]:
        rows = packed.contiguous()
        half = half_scales and _lib.sd_q_half_exact(rows.data_ptr(), fmt, rows.shape[0], in_features)
        layout = fmt | HALF if half else fmt
        npanels = -(-packed.shape[0] // 16)
        out = torch.empty(npanels, _lib.sd_qp_panel_bytes(layout, in_features), dtype=torch.uint8)
        _lib.sd_q_to_panels(rows.data_ptr(), layout, rows.shape[0], in_features, out.data_ptr(),
                            torch.get_num_threads())
        return out, layout

    return _layout_of(packed, q_panels_key(fmt, half_scales), make)


def q_panels_key(fmt: int, half_scales: bool = True) -> str:
    """The name `q_panels` keeps its panels of a layout-`fmt` matrix under (`cached_layout`)."""
    return f"q{fmt}{'h' if half_scales else ''}"


def q_rows_from_panels(panels: torch.Tensor, layout: int, in_features: int, rows: int | torch.Tensor
                       ) -> torch.Tensor:
    """The rows (uint8 [n, row bytes] in layout `layout & GGUF`) of a matrix held as `panels` (of that layout,
    from `q_panels`): rows 0 .. rows - 1, or the rows at the int64 indices `rows`; the bytes `q_panels` read."""
    base = layout & GGUF
    index = None if isinstance(rows, int) else rows.to(torch.int64).contiguous()
    n = rows if index is None else index.numel()
    out = torch.empty(n, _lib.sd_q_row_bytes(base, in_features), dtype=torch.uint8)
    _lib.sd_q_rows_from_panels(panels.data_ptr(), layout & (GGUF | HALF), in_features, _ptr(index), n,
                               out.data_ptr(), torch.get_num_threads())
    return out


def linear_i8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
              threads: int) -> torch.Tensor:
    """x [M, K] bf16 @ (int8 weight [N, K] * bf16 scales [N])^T + bias, bf16 out (the fused layers' int8 path,
    for a quant:int8 draft's LM head: it streams the int8 bytes at the memory bandwidth)."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, weight.shape[0], dtype=torch.bfloat16)
    scratch = torch.empty(M * K, dtype=torch.float32)
    _lib.sd_linear_i8(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), _ptr(bias), y.data_ptr(), M,
                      weight.shape[0], K, scratch.data_ptr(), threads)
    return y


def linear_q(x: torch.Tensor, packed: torch.Tensor, fmt: int, bias: torch.Tensor | None, out_features: int,
             threads: int, half_scales: bool = True, int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] bf16 @ the GGUF-native weight `packed` (uint8 [N, row bytes] in layout `fmt`, or its panels
    with fmt = QPANELS | their layout)^T + bias, bf16 out:
    the file's exact weights, activations as int8 (Q4 layouts; Q8 ones with `int8_activations` where
    `q8_int8_activations()`) or 16-bit integers per block (see cpu_kernels.c); each row's bits independent of
    M, and of `half_scales` (panels holding fp16 scales where they are exact: `q_panels`)."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, out_features, dtype=torch.bfloat16)
    scratch = torch.empty(_lib.sd_q_scratch_floats(M, K), dtype=torch.float32)
    asked = X8 if int8_activations else 0
    if fmt & QPANELS:  # `packed` holds panels already (`q_panels`), in layout fmt & ~QPANELS
        _lib.sd_linear_qp(x.data_ptr(), packed.data_ptr(), fmt & ~QPANELS | asked, _ptr(bias), y.data_ptr(), M,
                          out_features, K, scratch.data_ptr(), threads)
    elif q_panels_active():
        weights, layout = q_panels(packed, fmt, K, half_scales)
        _lib.sd_linear_qp(x.data_ptr(), weights.data_ptr(), layout | asked, _ptr(bias), y.data_ptr(), M,
                          out_features, K, scratch.data_ptr(), threads)
    else:
        _lib.sd_linear_q(x.data_ptr(), packed.data_ptr(), fmt, _ptr(bias), y.data_ptr(), M, out_features, K,
                         scratch.data_ptr(), threads)
    return y


def dequant_q(packed: torch.Tensor, fmt: int, in_features: int, threads: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights [N, K] of a GGUF-native matrix: the reference dequantization's fp32 values, or those rounded
    to bf16 (dtype=torch.bfloat16) without an fp32 copy in between."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequant_q gives fp32 or bf16, not {dtype}")
    out = torch.empty(packed.shape[0], in_features, dtype=dtype)
    _lib.sd_dequant_q(packed.data_ptr(), fmt, packed.shape[0], in_features, out.data_ptr(),
                      int(dtype == torch.bfloat16), threads)
    return out


def reduces(logits: torch.Tensor) -> bool:
    """Whether `argmax_rows` / `topk_rows` take these logits: bf16 or fp32 on CPU, with the kernels built."""
    return logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32) and available()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (the first maximum, a NaN counting as the maximum) of bf16 or fp32 CPU logits [..., V]
    in one call: after a forward pass torch's few reduction ops per row cost about 90 us a decoded token."""
    _check_logits(logits, "argmax_rows")
    x = logits.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.long)
    vocab = x.shape[-1]
    _lib.sd_argmax_rows(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // vocab, vocab, out.data_ptr())
    return out


TOPK_MAX = 64  # the largest k sd_topk_rows takes


def topk_rows(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits.topk(k, dim=-1).indices of bf16 or fp32 CPU logits [..., V] in one call: the same values, best
    first (equal values by lower index), a NaN above every number; 1 <= k <= min(V, TOPK_MAX)."""
    _check_logits(logits, "topk_rows")
    vocab = logits.shape[-1]
    if not 1 <= k <= min(vocab, TOPK_MAX):
        raise ValueError(f"topk_rows takes 1 <= k <= {min(vocab, TOPK_MAX)}, not {k}")
    x = logits.contiguous()
    out = torch.empty(*x.shape[:-1], k, dtype=torch.long)
    _lib.sd_topk_rows(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // vocab, vocab, k, out.data_ptr())
    return out


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if logits.dtype not in (torch.bfloat16, torch.float32) or logits.device.type != "cpu" or not logits.shape[-1]:
        raise ValueError(f"{name} takes bf16 or fp32 CPU logits with a vocabulary, not {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")


def q_row_bytes(fmt: int, in_features: int) -> int:
    """Bytes of one output feature's row in GGUF-native layout `fmt`, as the kernels read it."""
    return _lib.sd_q_row_bytes(fmt, in_features)


SIMD_PATHS = ("portable", "avx2", "avx512", "avx512bf16", "amx")


def simd_path() -> str:
    """The code path the linear layers take on this CPU: amx (tiles), avx512bf16, avx512, avx2 (+FMA) or
    portable. AMX builds take the avx512bf16 path where Linux refuses the tile state or SPECDRAFT_KERNEL_AMX=0."""
    return SIMD_PATHS[_lib.sd_simd_level()]


def k_multiple() -> int:
    """Input widths of linear layers must be multiples of this (32 with AVX512-BF16, else 16)."""
    return _lib.sd_linear_k_multiple()


def key_panel_width(head_dim: int) -> int:
    """Keys per panel of the key-panel copy the kernels keep current and read (cpu_kernels.c: key_to_panels);
    0 where their attention reads the key cache itself (AVX2, portable, AMX tiles)."""
    return int(_lib.sd_key_panel_width(head_dim))


def addresses(tensors: list[torch.Tensor]) -> ctypes.Array:
    """A C array of the tensors' data pointers (the caller keeps the tensors alive)."""
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


@functools.lru_cache(maxsize=256)
def _uniform_starts(batch: int, tokens: int) -> torch.Tensor:
    """seq_start of `batch` sequences of `tokens` rows each (read-only: shared between forwards)."""
    return torch.arange(batch + 1, dtype=torch.int64) * tokens


def forward_layers(layers: ctypes.Array, num_layers: int, shape: ModelShape, k_caches: ctypes.Array,
                   v_caches: ctypes.Array, k_panels: ctypes.Array | None, x: torch.Tensor, slots: torch.Tensor,
                   cache_pos: torch.Tensor,
                   masks: dict[str, torch.Tensor], ropes: dict[str, tuple], batch: int, tokens: int,
                   threads: int, capture_layers: Sequence[int] = (), seq_lens: Sequence[int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the first `num_layers` layers on the residual stream x [rows, dim] in place; returns the final-normed
    hidden states and, when `capture_layers` names layers, the residual stream after each of them
    [len(capture_layers), rows, dim] (else None).
    The rows are `batch` sequences of `tokens` rows each, or, given `seq_lens`, of those many rows each,
    packed one after another (a ragged batch: each sequence's real rows only); `slots` has one entry per
    sequence, `cache_pos`, the masks and the RoPE tables one per row.
    k_caches/v_caches: `addresses` of each layer's cache tensors, contiguous bf16 [slots, kv_heads, L, D];
    k_panels: those of the cache's key panels (`KVCache.enable_key_panels`, kept current by the kernels), or
    None where the kernels keep none (`key_panel_width` 0)."""
    normed = torch.empty_like(x)
    captured = capture_at = None
    if capture_layers:
        captured = torch.empty(len(capture_layers), *x.shape, dtype=x.dtype)
        capture_at = torch.full((num_layers,), -1, dtype=torch.int64)
        for i, layer in enumerate(capture_layers):
            capture_at[layer] = i
    full, sliding = masks.get("full"), masks.get("sliding")
    key_len = (full if full is not None else sliding).shape[-1]
    cos_full, sin_full = ropes.get("full", (None, None))
    cos_sliding, sin_sliding = ropes.get("sliding", (None, None))
    if seq_lens is None:
        lens_ok = tokens >= 1 and batch * tokens == x.shape[0]
        seq_start = _uniform_starts(batch, tokens)  # decoding's case: no allocation per forward
    else:
        lens = list(seq_lens)
        lens_ok = len(lens) == batch and min(lens, default=0) >= 1 and sum(lens) == x.shape[0]
        seq_start = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)
    if not lens_ok or slots.numel() != batch:
        raise ValueError(f"forward_layers: {x.shape[0]} rows, {slots.numel()} slots and sequence lengths "
                         f"{seq_lens or [tokens] * batch} do not make {batch} non-empty sequences")
    status = _lib.sd_forward(layers, num_layers, ctypes.byref(shape), k_caches, v_caches, k_panels, x.data_ptr(),
                             normed.data_ptr(),
                             slots.data_ptr(), cache_pos.data_ptr(), _ptr(full), _ptr(sliding), key_len,
                             _ptr(cos_full), _ptr(sin_full), _ptr(cos_sliding), _ptr(sin_sliding), batch,
                             seq_start.data_ptr(), threads, _ptr(capture_at), _ptr(captured))
    if status != 0:
        raise MemoryError("cpu_kernels: could not allocate scratch memory for the forward pass")
    return normed, captured
