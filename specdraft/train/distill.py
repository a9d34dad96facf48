"""The target's own responses to a prompt file, as token shards for drafter training (`specdraft distill`).

Prompts come one JSON object per line: `{"prompt": "..."}` (or `"text"`), `{"messages": [...]}` (a chat)
or Spec-Bench's `{"turns": ["...", ...]}` (the first turn). They are wrapped in the model's chat template
when it has one. Every other prompt is answered greedily, the rest sampled at temperature 0.7 (seeded by the
prompt's index), so the head sees both kinds of continuation. Generation runs batched through
`Engine.generate_many`.

The last `val_fraction` of the prompts (at least one when there are two or more) form the held-out `val`
split. Shards of `shard_size` prompts are written atomically and listed in `manifest.json` (model and prompt
file fingerprints, settings, counts) as they finish; a rerun with the same settings skips finished shards,
and one with different settings is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.train.data import MANIFEST, read_shard, shard_name, write_shard
from specdraft.verify.sampling import SamplingParams

SAMPLED_TEMPERATURE = 0.7


@dataclass
class DistillConfig:
    max_tokens: int = 256
    shard_size: int = 64
    max_batch: int = 16
    val_fraction: float = 0.05
    limit: int | None = None
    seed: int = 0


def read_prompts(path: str | Path, limit: int | None = None) -> list:
    """Each line's prompt: a string or a list of chat messages."""
    prompts: list = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecdraftError(f"{path}:{number}: not JSON: {exc}") from exc
            if isinstance(obj, str):
                prompts.append(obj)
            elif isinstance(obj, dict) and isinstance(obj.get("prompt", obj.get("text")), str):
                prompts.append(obj.get("prompt", obj.get("text")))
            elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
                prompts.append(obj["messages"])
            elif isinstance(obj, dict) and isinstance(obj.get("turns"), list) and obj["turns"]:
                prompts.append(str(obj["turns"][0]))
            else:
                raise SpecdraftError(f"{path}:{number}: expected a 'prompt', 'text', 'messages' or 'turns' key")
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise SpecdraftError(f"{path} holds no prompts")
    return prompts


def encode_prompt(tokenizer, prompt) -> list[int]:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template(messages)
    return tokenizer.encode("\n".join(m["content"] for m in messages))


def sampling_for(index: int, config: DistillConfig) -> SamplingParams:
    if index % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=config.max_tokens)
    return SamplingParams(temperature=SAMPLED_TEMPERATURE, max_tokens=config.max_tokens,
                          seed=config.seed * 1_000_003 + index)


def _plan(num: int, config: DistillConfig) -> list[tuple[str, int, int, int]]:
    """(split, shard index, first prompt, end prompt) of every shard."""
    val = max(1, round(num * config.val_fraction)) if num >= 2 and config.val_fraction > 0 else 0
    plan = []
    for split, lo, hi in (("train", 0, num - val), ("val", num - val, num)):
        for i, start in enumerate(range(lo, hi, config.shard_size)):
            plan.append((split, i, start, min(hi, start + config.shard_size)))
    return plan


def distill(engine, tokenizer, prompts: Sequence, out_dir: str | Path, config: DistillConfig | None = None,
            identity: dict | None = None, progress: bool = True) -> dict:
    """Generate and store the responses; returns the manifest. `identity`: what names the model and prompt
    file (fingerprints), checked against an existing manifest before resuming."""
    config = config or DistillConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = list(prompts)[:config.limit] if config.limit else list(prompts)
    settings = {"max_tokens": config.max_tokens, "shard_size": config.shard_size,
                "val_fraction": config.val_fraction, "seed": config.seed, "num_prompts": len(prompts),
                "sampled_temperature": SAMPLED_TEMPERATURE, **(identity or {})}
    manifest_path = out_dir / MANIFEST
    manifest = {"format": 1, "settings": settings, "shards": [], "complete": False}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("settings") != settings:
            raise SpecdraftError(f"{out_dir} holds a distillation with other settings ({old.get('settings')}); "
                                 f"choose another --out")
        manifest = old
    done = {s["file"] for s in manifest["shards"]}
    plan = _plan(len(prompts), config)
    encoded = None
    bar = None
    if progress:
        from tqdm import tqdm

        finished = sum(hi - lo for split, i, lo, hi in plan if shard_name(split, i) in done)
        bar = tqdm(total=len(prompts), initial=finished, desc="distill", unit="prompt", dynamic_ncols=True)
    t0 = time.perf_counter()
    generated = 0
    for split, index, lo, hi in plan:
        name = shard_name(split, index)
        if name in done and (out_dir / name).exists():
            continue
        if encoded is None:
            encoded = [encode_prompt(tokenizer, p) for p in prompts]
        ids = encoded[lo:hi]
        results = engine.generate_many(ids, [sampling_for(i, config) for i in range(lo, hi)])
        sequences = [list(p) + list(r.token_ids) for p, r in zip(ids, results)]
        write_shard(out_dir / name, sequences, [len(p) for p in ids])
        tokens = sum(len(r.token_ids) for r in results)
        generated += tokens
        manifest["shards"] = [s for s in manifest["shards"] if s["file"] != name]
        manifest["shards"].append({"file": name, "split": split, "prompts": [lo, hi], "sequences": hi - lo,
                                   "response_tokens": tokens, "tokens": sum(len(s) for s in sequences)})
        manifest["shards"].sort(key=lambda s: (s["split"] != "train", s["file"]))
        _write_manifest(manifest_path, manifest)
        if bar is not None:
            bar.update(hi - lo)
            bar.set_postfix(tok_s=f"{generated / max(1e-9, time.perf_counter() - t0):.1f}")
    if bar is not None:
        bar.close()
    for split in ("train", "val"):
        shards = [s for s in manifest["shards"] if s["split"] == split]
        manifest[f"{split}_sequences"] = sum(s["sequences"] for s in shards)
        manifest[f"{split}_tokens"] = sum(s["tokens"] for s in shards)
    manifest["complete"] = True
    _write_manifest(manifest_path, manifest)
    return manifest


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)


__all__ = ["DistillConfig", "distill", "encode_prompt", "read_prompts", "read_shard", "sampling_for"]
