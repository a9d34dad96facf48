"""Model configuration: the few numbers our forward pass needs, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.errors import ModelLoadError

# model_type -> family. Llama-like families share one code path; Gemma 3 has its own norms and layer pattern.
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # Gemma 3: sliding-window layers use their own RoPE base.
    rope_local_theta: float | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # One entry per layer: "full" or "sliding".
    layer_types: list[str] = field(default_factory=list)
    attn_scale: float | None = None
    embed_scale: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def is_gemma(self) -> bool:
        return self.family == "gemma3"

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type == "gemma3" and "text_config" in raw:
            raw = {**raw["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported architecture {model_type!r}; supported model_type values: "
                f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            cfg = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type.startswith("gemma"))),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type in ("qwen3", "gemma3_text", "gemma3"),
                hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_list(raw.get("eos_token_id")),
                final_logit_softcapping=raw.get("final_logit_softcapping"),
                attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value for {exc}") from exc
        _read_rope(cfg, raw)
        _read_attention_pattern(cfg, raw)
        if cfg.is_gemma:
            cfg.embed_scale = hidden**0.5
            cfg.attn_scale = float(raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        else:
            cfg.attn_scale = cfg.head_dim**-0.5
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ModelLoadError(f"no config.json at {path}") from exc
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(raw)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _read_rope(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    """RoPE settings live in `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (older)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type (Gemma 3)
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        cfg.rope_theta = float(full.get("rope_theta", raw.get("rope_theta", 1e6)))
        cfg.rope_local_theta = float(local.get("rope_theta", raw.get("rope_local_base_freq", 1e4)))
        cfg.rope_scaling = full if full.get("rope_type", "default") != "default" else None
        return
    if isinstance(params, dict):
        cfg.rope_theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        cfg.rope_theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
    if cfg.is_gemma:
        cfg.rope_local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    cfg.rope_scaling = scaling or None
    if cfg.rope_scaling:
        kind = cfg.rope_scaling.get("rope_type") or cfg.rope_scaling.get("type")
        if kind not in ("linear", "llama3", "default"):
            raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def _read_attention_pattern(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    window = raw.get("sliding_window")
    if cfg.model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    cfg.sliding_window = int(window) if window else None
    types = raw.get("layer_types")
    if types:
        cfg.layer_types = ["sliding" if "sliding" in t else "full" for t in types]
    elif cfg.is_gemma:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        cfg.layer_types = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(cfg.num_layers)]
    else:
        cfg.layer_types = ["sliding" if cfg.sliding_window else "full"] * cfg.num_layers
    if len(cfg.layer_types) != cfg.num_layers:
        raise ModelLoadError("config layer_types does not have one entry per layer")
    if cfg.sliding_window is None:
        cfg.layer_types = ["full"] * cfg.num_layers
