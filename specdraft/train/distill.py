"""The target's own responses to a prompt file, as token shards for drafter training (`specdraft distill`),
with the target's hidden states recorded as it generates them.

Prompts come one JSON object per line: `{"prompt": "..."}` (or `"text"`), `{"messages": [...]}` (a chat)
or Spec-Bench's `{"turns": ["...", ...]}` (the first turn). They are wrapped in the model's chat template
when it has one. Every other prompt is answered greedily, the rest sampled at temperature 0.7 (seeded by the
prompt's index), so the head sees both kinds of continuation. `shuffle` draws the prompts in a seeded random
order first (prompt files are often grouped by task), and prompts longer than `max_prompt_tokens` are
skipped (counted in the manifest).

Generation runs through the engine with continuous batching across shards: up to `max_batch` requests are
in flight at once, each new one admitted as another finishes, and a shard is written as soon as its last
prompt is done. The features a drafter head trains on (the residual streams after `hidden_layers`, -1 the
final-normed output) are the ones the target computes anyway while generating: a drafter that drafts
nothing (`FeatureRecorder`) keeps them from the prefill and from every decoding round, so training needs no
target forward of its own. Measured on SmolLM2-135M (AMD Zen 3, 2 cores): a batched forward over the same
sequences costs about as much as generating them, so recording instead of recomputing halves the work.

The last `val_fraction` of the prompts (at least one when there are two or more) form the held-out `val`
split. Shards of `shard_size` prompts are written atomically and listed in `manifest.json` (model and prompt
file fingerprints, settings, counts) as they finish; a rerun with the same settings skips finished shards,
and one with different settings is refused.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft.drafters.base import DraftRequest, Proposal, Verified
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer
from specdraft.train.data import MANIFEST, read_shard, shard_name, write_shard, write_text_atomically
from specdraft.verify.sampling import SamplingParams

SAMPLED_TEMPERATURE = 0.7
FEATURE_DTYPE = torch.bfloat16


@dataclass
class DistillConfig:
    max_tokens: int = 256
    shard_size: int = 64
    max_batch: int = 16
    val_fraction: float = 0.05
    limit: int | None = None
    seed: int = 0
    shuffle: bool = False
    max_prompt_tokens: int | None = None
    hidden_layers: list[int] = field(default_factory=list)  # target features to record (-1: final-normed)


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


def head_feature_layers(target: Transformer) -> list[int]:
    """The target features the bundled head kinds train on: EAGLE-3's three aux streams (its default layer
    ids) and the final-normed output (Medusa's input, and every head's soft labels through the lm_head)."""
    from specdraft.drafters.eagle import default_aux_layer_ids

    return sorted({i - 1 for i in default_aux_layer_ids(target.config.num_layers)} | {-1})


def select_prompts(prompts: Sequence, config: DistillConfig) -> list:
    """The prompts this distillation answers, in order: seeded shuffle (optional), then the first `limit`."""
    prompts = list(prompts)
    if config.shuffle:
        random.Random(config.seed).shuffle(prompts)
    return prompts[:config.limit] if config.limit else prompts


def _plan(num: int, config: DistillConfig) -> list[tuple[str, int, int, int]]:
    """(split, shard index, first prompt, end prompt) of every shard."""
    val = max(1, round(num * config.val_fraction)) if num >= 2 and config.val_fraction > 0 else 0
    plan = []
    for split, lo, hi in (("train", 0, num - val), ("val", num - val, num)):
        for i, start in enumerate(range(lo, hi, config.shard_size)):
            plan.append((split, i, start, min(hi, start + config.shard_size)))
    return plan


class FeatureRecorder:
    """A drafter that drafts nothing and keeps what the target computed: per request, the hidden states of
    `hidden_layers` at every position the target has scored (the prompt at prefill, then the pending token
    of each round). A finished request's last scored position is not observed (the engine tells drafters
    nothing after a request ends), so a sequence of n tokens has features for its first n - 2 positions."""

    name = "record"

    def __init__(self, hidden_layers: Sequence[int]) -> None:
        self.hidden_layers = tuple(sorted(set(hidden_layers)))
        self._rows: dict[int, dict[int, list[torch.Tensor]]] = {}

    def add_request(self, request: DraftRequest) -> None:
        self._rows[request.request_id] = {layer: [request.prompt_hidden[layer].to(FEATURE_DTYPE).clone()]
                                          for layer in self.hidden_layers}

    def propose(self, request_ids: Sequence[int], contexts: Sequence[Sequence[int]], max_ks: Sequence[int],
                max_nodes: Sequence[int] | None = None) -> list[Proposal]:
        return [Proposal([]) for _ in request_ids]

    def observe(self, request_id: int, verified: Verified) -> None:
        rows = self._rows[request_id]
        for layer in self.hidden_layers:
            rows[layer].append(verified.hidden[layer][:1].to(FEATURE_DTYPE).clone())

    def remove_request(self, request_id: int) -> None:
        pass  # kept until `take`: the engine removes a request before its caller sees the result

    def take(self, request_id: int, dim: int) -> dict[int, torch.Tensor]:
        """{layer: [positions, dim]} of a request, forgotten afterwards (empty rows for a request that ended at
        its first token, which no drafter hears of)."""
        rows = self._rows.pop(request_id, None)
        if rows is None:
            return {layer: torch.zeros(0, dim, dtype=FEATURE_DTYPE) for layer in self.hidden_layers}
        return {layer: torch.cat(parts) for layer, parts in rows.items()}


def distill(target: Transformer, tokenizer, prompts: Sequence, out_dir: str | Path,
            config: DistillConfig | None = None, identity: dict | None = None, progress: bool = True,
            max_model_len: int | None = None) -> dict:
    """Generate and store the responses (and the target's features when `config.hidden_layers` names any);
    returns the manifest. `identity`: what names the model and prompt file (fingerprints), checked against
    an existing manifest before resuming."""
    config = config or DistillConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = select_prompts(prompts, config)
    layers = sorted(set(config.hidden_layers))
    settings = {"max_tokens": config.max_tokens, "shard_size": config.shard_size,
                "val_fraction": config.val_fraction, "seed": config.seed, "num_prompts": len(prompts),
                "shuffle": config.shuffle, "max_prompt_tokens": config.max_prompt_tokens, "hidden_layers": layers,
                "sampled_temperature": SAMPLED_TEMPERATURE, **(identity or {})}
    manifest_path = out_dir / MANIFEST
    manifest = {"format": 2, "settings": settings, "shards": [], "complete": False}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("settings") != settings:
            raise SpecdraftError(f"{out_dir} holds a distillation with other settings ({old.get('settings')}); "
                                 f"choose another --out")
        manifest = old
    done = {s["file"] for s in manifest["shards"] if (out_dir / s["file"]).exists()}
    todo = [shard for shard in _plan(len(prompts), config) if shard_name(shard[0], shard[1]) not in done]
    recorder = FeatureRecorder(layers) if layers else None
    engine = Engine(target, tokenizer, recorder, 1 if recorder else 0, AdaptiveConfig(enabled=False),
                    max_model_len, max_batch=config.max_batch)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), initial=len(prompts) - sum(hi - lo for *_, lo, hi in todo), desc="distill",
                   unit="prompt", dynamic_ncols=True)
    queue: list[tuple[int, list[int]]] = []  # (prompt index, ids) still to admit, in plan order
    skipped: dict[int, str] = {}
    limit = config.max_prompt_tokens
    for *_, lo, hi in todo:
        for i in range(lo, hi):
            ids = encode_prompt(tokenizer, prompts[i])
            params = sampling_for(i, config)
            try:
                if limit is not None and len(ids) > limit:
                    raise SpecdraftError(f"prompt of {len(ids)} tokens, over max_prompt_tokens={limit}")
                engine.validate(ids, params)
                queue.append((i, ids))
            except SpecdraftError as exc:
                skipped[i] = str(exc)
    queue.reverse()
    finished: dict[int, tuple[list[int], list[int], dict[int, torch.Tensor]]] = {}  # index -> (prompt, out, feats)
    active: dict[int, tuple[int, object]] = {}  # request id -> (prompt index, request)
    t0, generated = time.perf_counter(), 0
    dim = target.config.hidden_size

    def flush() -> None:
        """Write every shard whose prompts are all done, in whatever order shards complete."""
        for shard in [s for s in todo if all(i in finished or i in skipped for i in range(s[2], s[3]))]:
            todo.remove(shard)
            split, index, lo, hi = shard
            kept = [i for i in range(lo, hi) if i in finished]
            _write(out_dir, manifest, split, index, lo, hi, [finished.pop(i) for i in kept], layers,
                   hi - lo - len(kept))

    if bar is not None:
        bar.update(len(skipped))
    try:
        flush()  # shards whose prompts were all skipped
        while queue or active:
            while queue and engine.free_slots:
                i, ids = queue.pop()
                request = engine.add_request(ids, sampling_for(i, config))
                active[request.id] = (i, request)
            for chunk in engine.step([r for _, r in active.values()]):
                if chunk.result is None:
                    continue
                i, _ = active.pop(chunk.request_id)
                feats = recorder.take(chunk.request_id, dim) if recorder else {}
                finished[i] = (chunk.result.prompt_token_ids, chunk.result.token_ids, feats)
                generated += len(chunk.result.token_ids)
                if bar is not None:  # per prompt, so the rate and ETA move between shards
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{generated / max(1e-9, time.perf_counter() - t0):.1f}")
            flush()
    finally:
        for _, request in active.values():
            engine.release(request)
        if bar is not None:
            bar.close()
    for split in ("train", "val"):
        shards = [s for s in manifest["shards"] if s["split"] == split]
        manifest[f"{split}_sequences"] = sum(s["sequences"] for s in shards)
        manifest[f"{split}_tokens"] = sum(s["tokens"] for s in shards)
    manifest["skipped_prompts"] = sum(s.get("skipped", 0) for s in manifest["shards"])
    manifest["complete"] = True
    _write_manifest(manifest_path, manifest)
    return manifest


def _write(out_dir: Path, manifest: dict, split: str, index: int, lo: int, hi: int,
           results: list[tuple[list[int], list[int], dict[int, torch.Tensor]]], layers: list[int],
           skipped: int) -> None:
    name = shard_name(split, index)
    sequences = [list(p) + list(out) for p, out, _ in results]
    features = {layer: [feats[layer] for *_, feats in results] for layer in layers} if layers else None
    write_shard(out_dir / name, sequences, [len(p) for p, _, _ in results], features)
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] != name]
    manifest["shards"].append({"file": name, "split": split, "prompts": [lo, hi], "sequences": len(results),
                               "skipped": skipped, "response_tokens": sum(len(out) for _, out, _ in results),
                               "tokens": sum(len(s) for s in sequences)})
    manifest["shards"].sort(key=lambda s: (s["split"] != "train", s["file"]))
    _write_manifest(out_dir / MANIFEST, manifest)


def _write_manifest(path: Path, manifest: dict) -> None:
    write_text_atomically(path, json.dumps(manifest, indent=2) + "\n")


__all__ = ["DistillConfig", "FeatureRecorder", "distill", "encode_prompt", "read_prompts", "read_shard",
           "head_feature_layers", "sampling_for", "select_prompts"]
