"""Draft heads and tables that ship inside the package, made for the bundled models (`eagle`, `medusa` and
`recycle` without a path pick the one made for the loaded target).

Each lives in `specdraft/heads/<model>/<kind>/` (config.json, the weights or table as safetensors, CARD.md:
the data, the exact commands that rebuilt it, training time, validation agreement and measured speedups). It
records the signature of the target it was made for (the architecture numbers below), so it is found for
that model however it was loaded (catalog name, converted directory, GGUF file). The one that measured
fastest on the dev suite (heads only, so far) is marked `"default": true` in its config's `specdraft` section:
the `auto` drafter takes it, and `ngram` where none is marked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
HEAD_KINDS = ("eagle", "medusa")


def target_signature(target: Transformer) -> dict[str, Any]:
    """The architecture numbers a head depends on (not the weights: a head trained on one copy of a model
    drafts for another copy of it)."""
    cfg = target.config
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
            "intermediate_size": cfg.intermediate_size, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size}


def _specdraft_section(config_file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return raw.get("specdraft", {}) if isinstance(raw, dict) else {}


def _recorded_signature(config_file: Path) -> dict[str, Any] | None:
    return _specdraft_section(config_file).get("target", {}).get("signature")


def shipped_heads(kind: str | None = None) -> list[Path]:
    """Every shipped head directory (of one kind)."""
    kinds = HEAD_KINDS if kind is None else (kind,)
    return sorted(p.parent for k in kinds for p in HEADS_DIR.glob(f"*/{k}/config.json"))


def shipped_head(kind: str, target: Transformer) -> Path | None:
    """The shipped head of `kind` made for this target, or None."""
    signature = target_signature(target)
    for path in shipped_heads(kind):
        if _recorded_signature(path / "config.json") == signature:
            return path
    return None


def require_shipped_head(kind: str, target: Transformer) -> Path:
    path = shipped_head(kind, target)
    if path is None:
        have = ", ".join(p.parent.name for p in shipped_heads(kind)) or "none"
        raise SpecdraftError(f"no {kind} head ships for this target (shipped {kind} heads: {have}); train one with "
                             f"`specdraft distill` and `specdraft train {kind}`, then use {kind}:DIR")
    return path


def default_drafter(target: Transformer) -> str:
    """The drafter `auto` means for this target: its shipped head marked default, else `ngram`."""
    for kind in HEAD_KINDS:
        path = shipped_head(kind, target)
        if path is not None and _specdraft_section(path / "config.json").get("default"):
            return kind
    return "ngram"


__all__ = ["HEADS_DIR", "HEAD_KINDS", "default_drafter", "require_shipped_head", "shipped_head", "shipped_heads",
           "target_signature"]
