"""Drafters: everything that proposes tokens for the target to verify, behind one small interface."""

from __future__ import annotations

from typing import Any

from specdraft.drafters.base import ROOT, Drafter, DraftRequest, Proposal, Verified
from specdraft.errors import SpecdraftError
from specdraft.runtime.model import Transformer
from specdraft.runtime.tokenizer import Tokenizer

DRAFTER_HELP = ("auto | ngram | suffix | recycle[:TABLE_DIR|none] | quant:int4 | quant:int8 | self:N | "
                "eagle[:HEAD_DIR] | medusa[:HEADS_DIR] | draft:MODEL_REF | MODEL_REF | cascade:A,B | "
                "hybrid:ngram,B (eagle / medusa alone: the head shipped for the target; recycle: n-gram lookup, "
                "the target's recycled top-k and the n-gram table shipped for the target (or TABLE_DIR) as one "
                "tree; auto: the shipped head that measured fastest, else ngram; draft:MODEL_REF may use "
                "another tokenizer; cascade: the model drafter B checks guesses of its own drafts from A (ngram or "
                "a cheaper model drafter); hybrid: "
                "n-gram lookup after a match of 2+ tokens, B elsewhere)")

# Drafters made from the target's weights or features: they need the runtime's `Transformer` as the target.
WEIGHT_DRAFTERS = ("quant", "self", "eagle", "medusa")


def make_drafter(spec: str, target: Transformer, target_tokenizer: Tokenizer, max_len: int = 4096,
                 options: dict[str, Any] | None = None, dtype: str | None = None, max_batch: int = 1) -> Drafter:
    """Build a drafter from its spec string (`auto`, `ngram`, `quant:int4`, `self:8`, `eagle[:DIR]`,
    `medusa[:DIR]`, `draft:REF` or a model ref, `cascade:A,B`, `hybrid:ngram,B`) for up to `max_batch`
    concurrent requests.
    A draft model with another tokenizer drafts through text (cross_tokenizer.py).

    options: drafter-specific keyword options (ngram: max_n, min_n, max_occurrences; recycle: max_n,
    max_occurrences, target_topk; suffix: ngram's and the shared cache's max_tokens, cache_min_n,
    cache_max_n; model drafters: min_confidence; quant: group_size; eagle: weights (float, int8,
    int4); hybrid: min_match and B's). Unknown options are an error.
    """
    options = dict(options or {})
    if not isinstance(spec, str) or not spec.strip():
        raise SpecdraftError(f"empty drafter spec; expected one of: {DRAFTER_HELP}")
    runtime_target = isinstance(target, Transformer)
    if spec == "auto":
        from specdraft.drafters.shipped import default_drafter

        spec = default_drafter(target) if runtime_target else "ngram"
    kind, _, arg = spec.partition(":")
    if not runtime_target and kind in WEIGHT_DRAFTERS:
        raise SpecdraftError(f"drafter {spec!r} is built from the target's own weights or hidden states, which "
                             "only the specdraft backend exposes; with the transformers backend use ngram, suffix "
                             "or draft:MODEL_REF")

    def take(allowed: set[str]) -> dict[str, Any]:
        unknown = set(options) - allowed
        if unknown:
            raise SpecdraftError(
                f"unknown option(s) {sorted(unknown)} for drafter {spec!r}; allowed: {sorted(allowed)}")
        return options

    if kind == "cascade":
        return _make_cascade(spec, arg, target, target_tokenizer, max_len, options, dtype, max_batch)
    if kind == "hybrid":
        return _make_hybrid(spec, arg, target, target_tokenizer, max_len, options, dtype, max_batch)
    if kind == "ngram":
        from specdraft.drafters.ngram import NgramDrafter

        opts = take({"max_n", "min_n", "max_occurrences"})
        if arg:
            opts.setdefault("max_n", _int_arg(spec, arg))
        try:
            return NgramDrafter(**opts)
        except ValueError as exc:
            raise SpecdraftError(str(exc)) from exc
    if kind == "suffix":
        from specdraft.drafters.suffix import SuffixDrafter

        opts = take({"max_n", "min_n", "max_occurrences", "max_tokens", "cache_min_n", "cache_max_n"})
        try:
            return SuffixDrafter(**opts)
        except ValueError as exc:
            raise SpecdraftError(str(exc)) from exc
    if kind == "recycle":
        from specdraft.drafters.recycle import NgramTable, RecycleDrafter
        from specdraft.drafters.shipped import shipped_head

        opts = take({"max_n", "max_occurrences", "target_topk"})
        if arg == "none":
            table = None
        elif arg:
            table = NgramTable.load(arg)
        else:
            shipped = shipped_head("recycle", target) if runtime_target else None
            table = NgramTable.load(shipped) if shipped is not None else None
        try:
            return RecycleDrafter(table, name=spec, **opts)
        except ValueError as exc:
            raise SpecdraftError(str(exc)) from exc
    if kind == "quant":
        from specdraft.drafters.quant import make_quant_drafter

        bits = {"int4": 4, "int8": 8, "4": 4, "8": 8}.get(arg)
        if bits is None:
            raise SpecdraftError(f"quant drafter takes int4 or int8, got {spec!r}")
        return make_quant_drafter(target, bits, max_len=max_len, max_batch=max_batch,
                                  **take({"min_confidence", "group_size"}))
    if kind == "self":
        from specdraft.drafters.self_draft import make_self_drafter

        return make_self_drafter(target, _int_arg(spec, arg), max_len=max_len, max_batch=max_batch,
                                 **take({"min_confidence"}))
    if kind == "eagle":
        from specdraft.drafters.eagle import make_eagle_drafter
        from specdraft.drafters.shipped import require_shipped_head

        path = arg or str(require_shipped_head("eagle", target))
        return make_eagle_drafter(path, target, max_len=max_len, max_batch=max_batch, name=spec,
                                  **take({"weights"}))
    if kind == "medusa":
        from specdraft.drafters.medusa import make_medusa_drafter
        from specdraft.drafters.shipped import require_shipped_head

        take(set())
        return make_medusa_drafter(arg or str(require_shipped_head("medusa", target)), target, name=spec)
    ref = arg if kind == "draft" else spec
    from specdraft.drafters.draft_model import ModelDrafter, tokenizers_match
    from specdraft.runtime.loader import load_model, load_tokenizer

    draft_tokenizer = load_tokenizer(ref)
    opts = take({"min_confidence"})
    model = load_model(ref, dtype=dtype or target.dtype, device=target.device)
    if tokenizers_match(target_tokenizer, draft_tokenizer):
        return ModelDrafter(model, name=f"draft:{ref}", max_len=max_len, max_batch=max_batch, **opts)
    from specdraft.drafters.cross_tokenizer import CrossTokenizerDrafter

    # Another vocabulary: the draft's context is the target's text in its own tokens, often more of them.
    draft = ModelDrafter(model, name=f"draft:{ref}", max_len=max_len * 3 // 2, max_batch=max_batch, **opts)
    return CrossTokenizerDrafter(draft, draft_tokenizer, target_tokenizer, name=f"draft:{ref}")


def split_drafter_list(text: str) -> list[str]:
    """A comma list of drafter specs (bench methods), where `cascade:A,B` and `hybrid:A,B` are one spec with
    its own comma."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    specs: list[str] = []
    while parts:
        part = parts.pop(0)
        if part.startswith(("cascade:", "hybrid:")) and "," not in part and parts:
            part = f"{part},{parts.pop(0)}"
        specs.append(part)
    return specs


def _make_cascade(spec: str, arg: str, target: Transformer, target_tokenizer: Tokenizer, max_len: int,
                  options: dict[str, Any], dtype: str | None, max_batch: int) -> Drafter:
    """`cascade:A,B`: the model drafter B drafts its chains checking A's guesses several tokens per forward
    (draft_model.py). A is `ngram[:N]` or a cheaper model drafter with the target's tokenizer (`quant:int4`
    before `quant:int8`, say), which guesses through `ModelGuesser`. Options go to B."""
    from specdraft.drafters.draft_model import ModelDrafter, ModelGuesser

    parts = [part.strip() for part in arg.split(",")]
    if len(parts) != 2 or not all(parts):
        raise SpecdraftError(f"bad drafter spec {spec!r}: a cascade is 'cascade:A,B' with A ngram or a model "
                             "drafter and B a model drafter, e.g. cascade:ngram,quant:int8")
    first_spec, second_spec = parts

    def model_stage(stage_spec: str, which: str, stage_options: dict[str, Any]) -> ModelDrafter:
        if stage_spec.partition(":")[0] in ("ngram", "suffix", "recycle", "hybrid", "cascade", "auto"):
            drafter = None
        else:
            drafter = make_drafter(stage_spec, target, target_tokenizer, max_len=max_len, options=stage_options,
                                   dtype=dtype, max_batch=max_batch)
        if type(drafter) is not ModelDrafter:
            raise SpecdraftError(f"cascade {spec!r}: the {which} stage must be a draft model with the target's "
                                 "tokenizer (quant:int4, quant:int8, self:N, draft:REF)"
                                 + (" or ngram" if which == "first" else "") + f", got {stage_spec!r}")
        return drafter

    if first_spec.partition(":")[0] == "ngram":
        guesser, second_spec = _ngram_pair(spec, arg, "cascade", "quant:int8",
                                           "a lookup that can guess past uncommitted tokens", part="stage")
    else:
        guesser = ModelGuesser(model_stage(first_spec, "first", {}))
    second = model_stage(second_spec, "second", options)
    second.guesser, second.name = guesser, spec
    return second


def _make_hybrid(spec: str, arg: str, target: Transformer, target_tokenizer: Tokenizer, max_len: int,
                 options: dict[str, Any], dtype: str | None, max_batch: int) -> Drafter:
    """`hybrid:ngram[:N],B`: n-gram lookup after a match of `min_match` tokens (an option, default 2), the
    drafter B otherwise (hybrid.py). Other options go to B."""
    from specdraft.drafters.hybrid import HybridDrafter

    lookup, model_spec = _ngram_pair(spec, arg, "hybrid", "eagle", "its match length decides who drafts")
    options = dict(options)
    min_match = options.pop("min_match", 2)
    if model_spec.partition(":")[0] in ("ngram", "suffix", "recycle", "hybrid", "cascade", "auto"):
        raise SpecdraftError(f"hybrid {spec!r}: the second part must be a model drafter (eagle, medusa, quant, "
                             f"self, draft), got {model_spec!r}")
    model = make_drafter(model_spec, target, target_tokenizer, max_len=max_len, options=options, dtype=dtype,
                         max_batch=max_batch)
    try:
        return HybridDrafter(lookup, model, min_match=min_match, name=spec)
    except ValueError as exc:
        raise SpecdraftError(str(exc)) from exc


def _ngram_pair(spec: str, arg: str, kind: str, example: str, why: str, part: str = "part") -> tuple[Any, str]:
    """`ngram[:N],B` of a two-part spec: the n-gram drafter and B's spec."""
    from specdraft.drafters.ngram import NgramDrafter

    parts = [part.strip() for part in arg.split(",")]
    if len(parts) != 2 or not all(parts):
        raise SpecdraftError(f"bad drafter spec {spec!r}: a {kind} is '{kind}:ngram,B' with B a model drafter, "
                             f"e.g. {kind}:ngram,{example}")
    first_kind, _, first_arg = parts[0].partition(":")
    if first_kind != "ngram":
        raise SpecdraftError(f"{kind} {spec!r}: the first {part} must be 'ngram' ({why}), got {parts[0]!r}")
    return (NgramDrafter(max_n=_int_arg(spec, first_arg)) if first_arg else NgramDrafter()), parts[1]


def _int_arg(spec: str, arg: str) -> int:
    try:
        return int(arg)
    except ValueError:
        raise SpecdraftError(f"bad drafter spec {spec!r}: expected an integer after ':'") from None


__all__ = ["DRAFTER_HELP", "ROOT", "DraftRequest", "Drafter", "Proposal", "Verified", "make_drafter",
           "split_drafter_list"]
