"""The JSON config accepted everywhere a model is:
`{"model": ..., "speculative_model": "ngram", "num_speculative_tokens": 5, "tree": 16}`.

One name per concept, the same in the API, the config and the CLI (`--speculative-model`,
`--num-speculative-tokens`, `--max-batch`): vLLM's names where vLLM has one. Earlier spellings are still
accepted (`draft_model`, `speculation_length`; `--draft`, `-k` on the command line). Unknown keys are an
error, so a typo never silently falls back to a default; every error names the key as the user wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specdraft.engine.core import MAX_DRAFT_TOKENS, MAX_TREE_NODES
from specdraft.errors import InvalidParameterError, SpecdraftError

SPECDRAFT, TRANSFORMERS = "specdraft", "transformers"
BACKENDS = (SPECDRAFT, TRANSFORMERS)
BACKEND_HELP = ("specdraft (default: the fast runtime) or transformers (any AutoModelForCausalLM as the target, "
                "fp32 by default, for architectures the runtime lacks; drafters: ngram, suffix, draft:REF)")

# Earlier spellings -> the one name.
ALIASES = {"draft_model": "speculative_model", "speculation_length": "num_speculative_tokens"}


@dataclass
class SpecConfig:
    model: str
    speculative_model: str | None = None
    num_speculative_tokens: int = 5
    tree: int = 0  # draft tokens per round as a token tree (0: chains)
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int = 4096
    max_batch: int = 1
    adaptive: bool = True
    min_acceptance: float = 0.4
    drafter_options: dict[str, Any] = field(default_factory=dict)
    backend: str = "specdraft"  # or "transformers": any AutoModelForCausalLM as the target (runtime/hf_backend.py)
    # How the user spelled each key (for error messages); not a config key itself.
    spelled: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        def name(key: str) -> str:
            return self.spelled.get(key, key)

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        checks = [
            (isinstance(self.model, str) and bool(self.model.strip()), "model", "must be a non-empty string"),
            (self.speculative_model is None or isinstance(self.speculative_model, str), "speculative_model",
             "must be a drafter spec string or null"),
            (is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS,
             "num_speculative_tokens", f"must be an integer in [0, {MAX_DRAFT_TOKENS}]"),
            (is_int(self.tree) and 0 <= self.tree <= MAX_TREE_NODES, "tree",
             f"must be an integer in [0, {MAX_TREE_NODES}] (draft tokens per tree; 0 = chains)"),
            (self.dtype in ("auto", "bf16", "gguf", "fp32", "fp16", "bfloat16", "float32", "float16"), "dtype",
             "must be one of auto, bf16, gguf (a GGUF model on its own quantized blocks), fp32, fp16"),
            (self.device is None or isinstance(self.device, str), "device", "must be a string such as 'cpu'"),
            (is_int(self.max_model_len) and self.max_model_len >= 2, "max_model_len", "must be an integer >= 2"),
            (is_int(self.max_batch) and 1 <= self.max_batch <= 256, "max_batch", "must be an integer in [1, 256]"),
            (isinstance(self.adaptive, bool), "adaptive", "must be true or false"),
            (isinstance(self.min_acceptance, (int, float)) and not isinstance(self.min_acceptance, bool)
             and 0.0 <= self.min_acceptance < 1.0, "min_acceptance", "must be a number in [0, 1)"),
            (isinstance(self.drafter_options, dict), "drafter_options", "must be an object"),
            (self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}"),
        ]
        if self.backend == TRANSFORMERS and self.dtype == "gguf":
            raise InvalidParameterError(f"{name('dtype')} 'gguf' needs the specdraft backend (transformers runs "
                                        "dense weights)")
        for ok, key, rule in checks:
            if not ok:
                raise InvalidParameterError(f"{name(key)} {rule}, got {getattr(self, key)!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpecConfig:
        if not isinstance(raw, dict):
            raise SpecdraftError("config must be a JSON object")
        known = {f.name for f in fields(cls)} - {"spelled"}
        unknown = sorted(set(raw) - known - set(ALIASES))
        if unknown:
            raise SpecdraftError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        values: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for key, value in raw.items():
            canonical = ALIASES.get(key, key)
            if canonical in values:
                raise SpecdraftError(f"config gives {canonical!r} twice ({spelled[canonical]!r} and {key!r})")
            values[canonical], spelled[canonical] = value, f"config: {key!r}"
        if "model" not in values:
            raise SpecdraftError("config needs a 'model' key")
        for key in known - set(spelled):
            spelled[key] = f"config: {key!r}"
        return cls(**values, spelled=spelled)

    @classmethod
    def load(cls, source: str | Path | dict[str, Any]) -> SpecConfig:
        if isinstance(source, dict):
            return cls.from_dict(source)
        path = Path(source)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecdraftError(f"config file {path} not found") from None
        except json.JSONDecodeError as exc:
            raise SpecdraftError(f"config file {path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)


DTYPE_HELP = ("auto (default: a GGUF model's own quantized blocks on CPU, else bf16), bf16, gguf (a GGUF model on "
              "its own quantized blocks, CPU), fp32, fp16 (GPU)")


def target_dtype(dtype: str, speculative_model: str | None) -> str:
    """The dtype the target loads in: "auto" stays dense (bf16) for the quant:* self-drafts, which quantize a
    dense target; the loader resolves "auto" otherwise (GGUF-native for a GGUF model on CPU)."""
    if dtype == "auto" and isinstance(speculative_model, str) and speculative_model.startswith("quant:"):
        return "bf16"
    return dtype


def is_config_ref(ref: str) -> bool:
    """A model argument that names a JSON config rather than a model."""
    return isinstance(ref, str) and ref.endswith(".json") and Path(ref).is_file()


# ---- argparse types: a bad value is reported with the flag the user typed ----------------------------------


def arg_int_in(low: int, high: int | None = None):
    """An argparse type for an integer in [low, high] (no upper bound when high is None)."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def arg_draft_length(text: str) -> int:
    return arg_int_in(0, MAX_DRAFT_TOKENS)(text)


def arg_tree_size(text: str) -> int:
    return arg_int_in(0, MAX_TREE_NODES)(text)
