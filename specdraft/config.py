"""The JSON config accepted everywhere a model is: `{"model": ..., "draft_model": ..., "speculation_length": 5}`.

Extra keys configure the drafter and the engine; unknown keys are an error, so a typo never silently falls
back to a default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specdraft.runtime.errors import SpecdraftError


@dataclass
class SpecConfig:
    model: str
    draft_model: str | None = None
    speculation_length: int = 5
    dtype: str = "bf16"
    device: str | None = None
    max_model_len: int = 4096
    adaptive: bool = True
    min_acceptance: float = 0.4
    drafter_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecdraftError("config: 'model' must be a non-empty string")
        if not isinstance(self.speculation_length, int) or not 0 <= self.speculation_length <= 64:
            raise SpecdraftError("config: 'speculation_length' must be an integer in [0, 64]")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise SpecdraftError("config: 'max_model_len' must be an integer >= 2")
        if not isinstance(self.drafter_options, dict):
            raise SpecdraftError("config: 'drafter_options' must be an object")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpecConfig:
        if not isinstance(raw, dict):
            raise SpecdraftError("config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpecdraftError(f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        if "model" not in raw:
            raise SpecdraftError("config needs a 'model' key")
        return cls(**raw)

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


def is_config_ref(ref: str) -> bool:
    """A model argument that names a JSON config rather than a model."""
    return isinstance(ref, str) and ref.endswith(".json") and Path(ref).is_file()
