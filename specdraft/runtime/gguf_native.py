"""GGUF models in their own quantization (`dtype="gguf"`): linear layers and the embedding keep the file's
quantized blocks and the C kernels dequantize them in registers.

Why: both bundled models ship as 4-bit GGUF files. Expanded to bf16, every decoded token reads 2-3x the bytes
the file holds (SmolLM2-135M: 270 MB against 96 MB), and decoding is bound by those bytes.

Exactness: the weights computed with are the file's own values. Each GGUF block is a scale (and for some types
an offset) times small integers; every GGUF scale, and every product of a super-block scale and its 6- or
8-bit sub-scale, is exact in fp32. So a block is repacked once into one of three layouts of cpu_kernels.c
(`Q4`: fp32 scale + 32 nibbles, the row's fp32 offsets after its blocks; `Q8`: fp32 scale + 32 int8; `Q8H`:
fp32 scale + 16 int8) with
integers recovered from gguf-py's reference dequantization and checked: scale * q (+ offset), computed in
fp32 as the reference does, must reproduce every dequantized weight bit for bit, or the tensor stays dense.

Types: Q4_0, Q4_1, Q4_K -> Q4; Q8_0, Q5_0 -> Q8; Q6_K -> Q8H. Any other type (and a fused qkv or gate/up whose
parts land in different layouts) keeps the bf16 weights of the dense path, with a note in `native_report`.
Rows are matched to the converted checkpoint's (transformers reorders the q/k rows of Llama-family files), so
a native model computes the same function as the dense one up to the weights' bf16 rounding.

The repacked tensors are cached next to the converted checkpoint (`native-v2.safetensors`).
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import ModelLoadError
from specdraft.runtime import cpu_kernels
from specdraft.runtime.cpu_kernels import Q4, Q8, Q8H
from specdraft.runtime.paths import replaced_on_success

FORMAT_NAMES = {Q4: "q4", Q8: "q8", Q8H: "q8h"}
BLOCK_ELEMS = {Q4: 32, Q8: 32, Q8H: 16}
BLOCK_BYTES = {Q4: 24, Q8: 36, Q8H: 20}
CACHE_NAME = "native-v2.safetensors"
EMBED_ROWS_PER_THREAD = 64  # an embedding lookup of fewer rows dequantizes on one thread (no OpenMP start-up)


def _ggml_layouts() -> dict:
    from gguf import GGMLQuantizationType as T

    return {T.Q4_0: Q4, T.Q4_1: Q4, T.Q4_K: Q4, T.Q8_0: Q8, T.Q5_0: Q8, T.Q6_K: Q8H}


# ---- repacking ---------------------------------------------------------------------------------------------


def _half(raw: np.ndarray, start: int) -> np.ndarray:
    """fp16 at byte `start` of every block of raw [..., block_bytes], as fp32."""
    return raw[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of Q4_K super-blocks from their 12 packed bytes (ggml's
    get_scale_min_k4), as int arrays [..., 8]."""
    q = scales.astype(np.int32)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def block_scales(raw: np.ndarray, qtype, in_features: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-block fp32 scale and offset (None: w = scale * q) of a GGUF tensor raw [N, row bytes], one per
    BLOCK_ELEMS weights of the layout the type repacks into."""
    from gguf import GGMLQuantizationType as T

    N = raw.shape[0]
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0):
        size = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34, T.Q5_0: 22}[qtype]
        blocks = raw.reshape(N, in_features // 32, size)
        d = _half(blocks, 0)
        if qtype == T.Q4_0:
            return d, np.float32(-8.0) * d
        if qtype == T.Q4_1:
            return d, _half(blocks, 2)
        return d, None
    if qtype == T.Q4_K:
        blocks = raw.reshape(N, in_features // 256, 144)
        d, dmin = _half(blocks, 0), _half(blocks, 2)
        sc, mn = _q4k_scale_min(blocks[..., 4:16])
        scale = d[..., None] * sc.astype(np.float32)
        offset = -(dmin[..., None] * mn.astype(np.float32))
        return scale.reshape(N, -1), offset.reshape(N, -1)
    if qtype == T.Q6_K:
        blocks = raw.reshape(N, in_features // 256, 210)
        d = _half(blocks, 208)
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        return (d[..., None] * sc).reshape(N, -1), None
    raise ValueError(f"no native layout for {qtype!r}")


def repack(raw: np.ndarray, qtype, in_features: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(layout, packed uint8 [N, row bytes], reference fp32 weights [N, K]) of one GGUF tensor.

    Raises ValueError where the layout cannot hold the file's values exactly."""
    from gguf import quants

    fmt = _ggml_layouts()[qtype]
    E = BLOCK_ELEMS[fmt]
    N = raw.shape[0]
    if in_features % E:
        raise ValueError(f"{in_features} input features are not a multiple of {E}")
    weights = quants.dequantize(raw, qtype).astype(np.float32, copy=False).reshape(N, in_features)
    scale, offset = block_scales(raw, qtype, in_features)
    w = weights.reshape(N, -1, E)
    s = scale[..., None]
    shifted = w if offset is None else w - offset[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s != 0, np.rint(shifted / s), 0.0)
    lo, hi = (0, 15) if fmt == Q4 else (-128, 127)
    if q.min(initial=0) < lo or q.max(initial=0) > hi:
        raise ValueError(f"integers outside {lo}..{hi}")
    q = q.astype(np.float32)
    rebuilt = s * q if offset is None else s * q + offset[..., None]
    if not np.array_equal(rebuilt, w):
        bad = int((rebuilt != w).sum())
        raise ValueError(f"{bad} weights are not scale * q{'' if offset is None else ' + offset'} in fp32")
    head = scale.astype(np.float32)[..., None].view(np.uint8)
    if fmt == Q4:
        qi = q.astype(np.uint8)
        nibbles = qi[..., :16] | (qi[..., 16:] << 4)
        blocks = np.concatenate([head, nibbles], axis=-1).reshape(N, -1)
        packed = np.concatenate([blocks, offset.astype(np.float32).view(np.uint8).reshape(N, -1)], axis=-1)
    else:
        packed = np.concatenate([head, q.astype(np.int8).view(np.uint8)], axis=-1).reshape(N, -1)
    assert packed.shape[1] == in_features // E * BLOCK_BYTES[fmt]
    return fmt, np.ascontiguousarray(packed), weights


def row_order(native: np.ndarray, reference: np.ndarray) -> np.ndarray | None:
    """Indices p with native[p] == reference row for row (bit for bit), or None if the rows do not match."""
    if native.shape != reference.shape:
        return None
    if np.array_equal(native, reference):
        return np.arange(native.shape[0])
    where: dict[bytes, list[int]] = {}
    for i, row in enumerate(native):
        where.setdefault(row.tobytes(), []).append(i)
    order = []
    for row in reference:
        hits = where.get(row.tobytes())
        if not hits:
            return None
        order.append(hits.pop() if len(hits) > 1 else hits[0])
    return np.asarray(order)


def dequantize(packed: torch.Tensor, fmt: int, in_features: int) -> torch.Tensor:
    """fp32 weights [R, K] of packed rows [R, row bytes], with the same fp32 operations as the reference."""
    E, size = BLOCK_ELEMS[fmt], BLOCK_BYTES[fmt]
    rows, nblk = packed.shape[0], in_features // E
    if fmt == Q4:
        blocks = packed[:, :nblk * 20].reshape(rows, nblk, 20)
        scale = blocks[..., 0:4].contiguous().view(torch.float32)
        offset = packed[:, nblk * 20:].contiguous().view(torch.float32).reshape(rows, nblk, 1)
        nibbles = blocks[..., 4:20]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
        w = scale * q + offset
    else:
        blocks = packed.reshape(rows, nblk, size)
        scale = blocks[..., 0:4].contiguous().view(torch.float32)
        w = scale * blocks[..., 4:].contiguous().view(torch.int8).float()
    return w.reshape(rows, in_features)


# ---- modules ------------------------------------------------------------------------------------------------


class QuantMatrix:
    """One GGUF-native matrix: `rows` uint8 [N, row bytes] in layout `fmt`, or, once `keep_panels_only` ran on
    a CPU whose kernels multiply panels (AVX-512), its panels alone.

    The kernels read panels there (`cpu_kernels.q_panels`: 16 outputs interleaved, scales as fp16 where
    exact), and keeping the rows beside them held every weight twice. Rows are rebuilt from the panels bit
    for bit when something needs them (an embedding lookup, the dequantized weights of a prompt's GEMM, a
    reference), so the weights are resident once."""

    def __init__(self, rows: torch.Tensor, fmt: int, in_features: int) -> None:
        self.fmt, self.in_features, self.num_rows = fmt, in_features, rows.shape[0]
        self._rows: torch.Tensor | None = rows.contiguous()
        self._panels: tuple[torch.Tensor, int] | None = None  # (panels, their layout) once the rows are gone

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """All rows, or those at `index` (int64 [n]), in layout `fmt`."""
        if self._rows is not None:
            return self._rows if index is None else self._rows[index]
        panels, layout = self._panels
        if index is not None and index.numel():
            low, high = torch.aminmax(index)
            if int(low) < 0 or int(high) >= self.num_rows:
                raise IndexError(f"row index out of range for a matrix of {self.num_rows} rows")
        return cpu_kernels.q_rows_from_panels(panels, layout, self.in_features,
                                              self.num_rows if index is None else index)

    def kernel_weights(self) -> tuple[torch.Tensor, int]:
        """(tensor, layout) the C kernels multiply: the panels (layout | QPANELS) where they read panels, else
        the rows (layout `fmt`)."""
        if self._panels is not None:
            panels, layout = self._panels
            return panels, layout | cpu_kernels.QPANELS
        if cpu_kernels.available() and cpu_kernels.q_panels_active():
            panels, layout = cpu_kernels.q_panels(self._rows, self.fmt, self.in_features)
            return panels, layout | cpu_kernels.QPANELS
        return self._rows, self.fmt

    def keep_panels_only(self) -> None:
        """Where the kernels read panels: build them and let the rows go (a no-op elsewhere)."""
        if self._rows is None or not (cpu_kernels.available() and cpu_kernels.q_panels_active()):
            return
        self._panels = cpu_kernels.q_panels(self._rows, self.fmt, self.in_features)
        self._rows = None

    @property
    def resident_bytes(self) -> int:
        """Bytes this matrix holds in memory: rows, panels, or both while the kernels' panels sit beside rows."""
        if self._rows is None:
            return self._panels[0].numel()
        panels = cpu_kernels.cached_layout(self._rows, cpu_kernels.q_panels_key(self.fmt))
        return self._rows.numel() + (panels[0].numel() if panels is not None else 0)


def _matrix(packed: torch.Tensor | QuantMatrix, fmt: int, in_features: int, rows: int) -> QuantMatrix:
    matrix = packed if isinstance(packed, QuantMatrix) else QuantMatrix(packed, fmt, in_features)
    row_bytes = in_features // BLOCK_ELEMS[fmt] * BLOCK_BYTES[fmt]
    shape_ok = isinstance(packed, QuantMatrix) or (packed.dtype == torch.uint8
                                                   and tuple(packed.shape) == (rows, row_bytes))
    if (not shape_ok or matrix.fmt != fmt or matrix.in_features != in_features or matrix.num_rows != rows
            or in_features % BLOCK_ELEMS[fmt]):
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else (matrix.num_rows, "panels")
        raise ValueError(f"packed weights {shape} do not hold {rows} x {in_features} weights in layout "
                         f"{FORMAT_NAMES.get(fmt, fmt)}")
    return matrix


class GGUFLinear(nn.Module):
    """A linear layer on GGUF-native weights: `packed` uint8 [out, row bytes] in layout `fmt` (or a
    `QuantMatrix`, shared with a tied embedding).

    The C kernel computes every row with the same operations whatever the number of rows (so verification
    gives each token its decoding bits, as the bf16 kernels do), prefill blocks included. Without the
    kernels it dequantizes and runs an fp32 matmul (correct, slow)."""

    def __init__(self, packed: torch.Tensor | QuantMatrix, fmt: int, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, int8_activations: bool = False) -> None:
        """int8_activations: an 8-bit layout takes int8 activations where the kernels do so
        (`cpu_kernels.q8_int8_activations`): the output layer's, not those inside the model."""
        super().__init__()
        self.matrix = _matrix(packed, fmt, in_features, out_features)
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.int8_activations = int8_activations
        self.register_buffer("bias", bias)

    @property
    def packed(self) -> torch.Tensor:
        """The weights as rows in layout `fmt` (rebuilt from the panels where only those are kept)."""
        return self.matrix.rows()

    def forward(self, x: torch.Tensor, exact_rows: bool = False) -> torch.Tensor:
        """Without exact_rows, a prompt-sized block (more than SMALL_BATCH_ROWS rows, never compared bit for
        bit with decoding) runs as an fp32 GEMM on the dequantized weights: about twice as fast as the
        integer kernel there, whose strength is the few rows of decoding and verification (as `Linear`)."""
        rows = x.numel() // x.shape[-1]
        if rows > cpu_kernels.SMALL_BATCH_ROWS and not exact_rows:
            if x.dtype == torch.bfloat16 and cpu_kernels.bf16_gemm_is_native():
                # bf16 products in hardware (AMX, AVX512-BF16): the weights rounded to bf16, as the bf16 model
                # holds them (measured 2.5x the fp32 GEMM's prefill on Sapphire Rapids)
                bias = None if self.bias is None else self.bias.to(torch.bfloat16)
                return F.linear(x, self.dequantize(torch.bfloat16), bias)
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.dequantize(), bias).to(x.dtype)
        if x.device.type == "cpu" and rows and cpu_kernels.available():
            flat = x.reshape(rows, self.in_features).to(torch.bfloat16)
            weights, layout = self.matrix.kernel_weights()
            y = cpu_kernels.linear_q(flat, weights, layout, self.bias, self.out_features, torch.get_num_threads(),
                                     int8_activations=self.int8_activations)
            return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.dequantize(), bias).to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights [out, in] in fp32, or rounded to bf16 (the C kernel where built: ~10x faster than the
        torch ops, and it writes bf16 directly)."""
        if cpu_kernels.available():
            return cpu_kernels.dequant_q(self.matrix.rows(), self.fmt, self.in_features, torch.get_num_threads(),
                                         dtype)
        return dequantize(self.matrix.rows(), self.fmt, self.in_features).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The weights in bf16 (dequantized on every access: for code that reads a dense matrix once, such as
        training a head on the target's LM head rows)."""
        return self.dequantize().to(torch.bfloat16)

    def kernel_layout(self) -> tuple[int, int]:
        """(bytes, layout) the kernels read for one decoded token: the panels where they multiply those
        (`cpu_kernels.q_panels`: fp16 scales where exact, so fewer bytes than the rows), else the rows."""
        weights, layout = self.matrix.kernel_weights()
        return weights.numel(), layout & ~cpu_kernels.QPANELS

    def extra_repr(self) -> str:
        asks = ", int8_activations=True" if self.int8_activations else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={FORMAT_NAMES[self.fmt]}{asks}")


class GGUFEmbedding(nn.Module):
    """Token embeddings on GGUF-native rows: a lookup dequantizes only the rows it reads (to bf16, the bits
    the bf16 model's table holds). Shares its `QuantMatrix` with a tied LM head."""

    def __init__(self, packed: torch.Tensor | QuantMatrix, fmt: int, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.matrix = _matrix(packed, fmt, embedding_dim, num_embeddings)
        self.fmt, self.num_embeddings, self.embedding_dim = fmt, num_embeddings, embedding_dim

    @property
    def packed(self) -> torch.Tensor:
        return self.matrix.rows()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.matrix.rows(tokens.reshape(-1).long())
        if cpu_kernels.available():  # the same bits in one call, where the torch ops cost 50 us a decoded token
            threads = 1 if rows.shape[0] < EMBED_ROWS_PER_THREAD else torch.get_num_threads()
            x = cpu_kernels.dequant_q(rows, self.fmt, self.embedding_dim, threads, torch.bfloat16)
        else:
            x = dequantize(rows, self.fmt, self.embedding_dim).to(torch.bfloat16)
        return x.reshape(*tokens.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in bf16 (dequantized on every access)."""
        return dequantize(self.matrix.rows(), self.fmt, self.embedding_dim).to(torch.bfloat16)


# ---- attaching native weights to a model ----------------------------------------------------------------------


@dataclass
class NativeReport:
    """What a native load kept quantized (ours name -> layout) and what stayed dense (name -> why)."""

    native: dict[str, str] = field(default_factory=dict)
    dense: dict[str, str] = field(default_factory=dict)


def _gguf_parts(cfg) -> dict[str, list[tuple[str, str]]]:
    """Our linear name -> [(GGUF tensor, Hugging Face tensor)] of its parts, concatenated along rows."""
    parts: dict[str, list[tuple[str, str]]] = {"embed": [("token_embd.weight", "model.embed_tokens.weight")]}
    if not cfg.tie_word_embeddings:
        parts["lm_head"] = [("output.weight", "lm_head.weight")]
    for i in range(cfg.num_layers):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        parts[f"layers.{i}.attn.wqkv"] = [(g + f"attn_{n}.weight", h + f"self_attn.{n}_proj.weight") for n in "qkv"]
        parts[f"layers.{i}.attn.wo"] = [(g + "attn_output.weight", h + "self_attn.o_proj.weight")]
        parts[f"layers.{i}.mlp.w_gate_up"] = [(g + "ffn_gate.weight", h + "mlp.gate_proj.weight"),
                                              (g + "ffn_up.weight", h + "mlp.up_proj.weight")]
        parts[f"layers.{i}.mlp.w_down"] = [(g + "ffn_down.weight", h + "mlp.down_proj.weight")]
    return parts


def build_native(gguf_path: Path, cfg, hf_state: dict[str, torch.Tensor], progress: bool = True
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """Repack a GGUF file's tensors for `cfg`: ({name: packed uint8}, metadata {"formats", "dense"})."""
    import gguf
    from tqdm import tqdm

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf-py raises many kinds of errors for a damaged file
        raise ModelLoadError(f"could not read GGUF file {gguf_path}: {type(exc).__name__}: {exc}") from exc
    tensors = {t.name: t for t in reader.tensors}
    layouts = _ggml_layouts()
    packed: dict[str, torch.Tensor] = {}
    meta: dict = {"version": 1, "formats": {}, "dense": {}}
    plan = _gguf_parts(cfg)
    for name, parts in tqdm(plan.items(), desc=f"repacking {gguf_path.name} (one time)", disable=not progress,
                            file=sys.stderr):
        pieces, why = [], None
        for gguf_name, hf_name in parts:
            t = tensors.get(gguf_name)
            if t is None or hf_name not in hf_state:
                why = f"{gguf_name} missing"
                break
            if t.tensor_type not in layouts:
                why = f"{gguf_name} is {t.tensor_type.name}, which has no native layout"
                break
            reference = hf_state[hf_name].float().numpy()
            try:
                fmt, rows, weights = repack(np.asarray(t.data), t.tensor_type, reference.shape[1])
            except ValueError as exc:
                why = f"{gguf_name} ({t.tensor_type.name}): {exc}"
                break
            order = row_order(weights, reference)
            if order is None:
                why = f"{gguf_name}: dequantized rows do not match the converted checkpoint"
                break
            pieces.append((fmt, rows[order]))
        if why is None and len({fmt for fmt, _ in pieces}) > 1:
            why = "its parts are in different layouts (" + ", ".join(FORMAT_NAMES[f] for f, _ in pieces) + ")"
        if why is not None:
            meta["dense"][name] = why
            continue
        packed[name] = torch.from_numpy(np.concatenate([rows for _, rows in pieces]))
        meta["formats"][name] = pieces[0][0]
    return packed, meta


def load_native(gguf_path: Path, converted: Path, cfg, hf_state: dict[str, torch.Tensor],
                progress: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """The repacked tensors from the cache next to the converted checkpoint, built on first use."""
    from safetensors.torch import load_file, save_file

    cache = converted / CACHE_NAME
    if cache.exists():
        try:
            from safetensors import safe_open

            with safe_open(str(cache), "pt") as f:
                meta = json.loads(f.metadata()["specdraft"])
            return load_file(str(cache)), meta
        except Exception as exc:  # a damaged cache entry is rebuilt
            warnings.warn(f"specdraft: rebuilding damaged {cache} ({exc})", stacklevel=2)
    packed, meta = build_native(gguf_path, cfg, hf_state, progress)
    with replaced_on_success(cache) as tmp:  # an interrupted build leaves no half-written cache
        save_file(packed, str(tmp), metadata={"specdraft": json.dumps(meta)})
    return packed, meta


def attach_native(model: nn.Module, packed: dict[str, torch.Tensor], meta: dict) -> NativeReport:
    """Swap the model's dense linear layers and embedding for GGUF-native ones where `packed` has them."""
    cfg = model.config
    report = NativeReport(dense=dict(meta.get("dense", {})))
    formats = {name: int(fmt) for name, fmt in meta["formats"].items()}
    if "embed" in packed:
        fmt = formats["embed"]
        model.embed = GGUFEmbedding(packed["embed"], fmt, cfg.vocab_size, cfg.hidden_size)
        report.native["embed"] = FORMAT_NAMES[fmt]
        if cfg.tie_word_embeddings:
            model.lm_head = GGUFLinear(model.embed.matrix, fmt, cfg.hidden_size, cfg.vocab_size,
                                       int8_activations=True)
            report.native["lm_head"] = FORMAT_NAMES[fmt]
    if "lm_head" in packed:
        model.lm_head = GGUFLinear(packed["lm_head"], formats["lm_head"], cfg.hidden_size, cfg.vocab_size,
                                   int8_activations=True)
        report.native["lm_head"] = FORMAT_NAMES[formats["lm_head"]]
    for name, tensor in packed.items():
        if not name.startswith("layers."):
            continue
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, attr)
        bias = None if dense.bias is None else dense.bias.detach().to(torch.bfloat16)
        setattr(parent, attr, GGUFLinear(tensor, formats[name], dense.in_features, dense.out_features, bias))
        report.native[name] = FORMAT_NAMES[formats[name]]
    for matrix in native_matrices(model):
        matrix.keep_panels_only()
    model.native_report = report
    return report


def native_matrices(model: nn.Module) -> list[QuantMatrix]:
    """The model's GGUF-native matrices, each once (a tied head shares the embedding's)."""
    found = {id(m.matrix): m.matrix for m in model.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))}
    return list(found.values())


def resident_bytes(model: nn.Module) -> int:
    """Bytes of weights the model holds in memory: GGUF-native matrices as they are kept (`QuantMatrix`),
    dense parameters and buffers at their size plus the bf16 panels the kernels made of them, each tensor
    once. (The bf16 panels sit beside the parameters: transformers-shaped code reads `weight`.)"""
    seen: set[int] = set()
    total = sum(m.resident_bytes for m in native_matrices(model))
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
            panels = cpu_kernels.cached_layout(t, "panels")
            total += panels.numel() * panels.element_size() if panels is not None else 0
    return total


def read_per_token(model: nn.Module) -> tuple[int, int]:
    """(bytes, weights) one decoded token reads from a native model: each packed tensor once (a tied head
    shares the embedding's) in the layout the kernels read (`GGUFLinear.kernel_layout`), dense parameters
    at their size, the embedding lookup counted as nothing."""
    seen: set[tuple[str, int]] = set()
    nbytes = weights = 0
    for module in model.modules():
        if isinstance(module, GGUFEmbedding):
            continue
        if isinstance(module, GGUFLinear):
            tensors = [(("matrix", id(module.matrix)), module.kernel_layout()[0],
                        module.in_features * module.out_features)]
        else:
            tensors = [(("tensor", t.data_ptr()), t.numel() * t.element_size(), t.numel())
                       for t in module.parameters(recurse=False)]
        for key, size, count in tensors:
            if key not in seen:
                seen.add(key)
                nbytes += size
                weights += count
    return nbytes, weights


def native_bytes(model: nn.Module) -> int:
    """Bytes of weights one decoded token reads from a native model (see read_per_token)."""
    return read_per_token(model)[0]


def native_weights(model: nn.Module) -> int:
    """Weights one decoded token multiplies (see read_per_token)."""
    return read_per_token(model)[1]
