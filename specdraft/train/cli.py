"""`specdraft self-prompts`, `specdraft distill`, `specdraft train eagle|medusa|ngram-table` and
`specdraft export eagle`."""

from __future__ import annotations

import argparse

from specdraft.config import arg_int_in


def add_commands(sub) -> None:
    distill = sub.add_parser("distill", help="the target's own responses to a prompt file, as token shards")
    distill.add_argument("--model", required=True, help="catalog name, HF directory or .gguf file")
    distill.add_argument("--prompts", required=True, help="JSONL: prompt / text / messages / turns per line")
    distill.add_argument("--out", required=True, help="output directory (rerun to resume)")
    distill.add_argument("--max-tokens", type=arg_int_in(1), default=256)
    distill.add_argument("--limit", type=arg_int_in(1), default=None, help="use the first N prompts")
    distill.add_argument("--shuffle", action="store_true",
                         help="draw the prompts in a seeded random order before --limit (files are often grouped "
                         "by task)")
    distill.add_argument("--max-prompt-tokens", type=arg_int_in(1), default=None,
                         help="skip prompts longer than this (counted in the manifest)")
    distill.add_argument("--features", default="heads", choices=["heads", "none"],
                         help="record the target's hidden states the EAGLE-3 and Medusa heads train on (heads, "
                         "the default: about 4 x hidden size x 2 bytes per token) or tokens only (none: training "
                         "then recomputes them with a target forward per step)")
    distill.add_argument("--max-batch", type=arg_int_in(1, 256), default=32)
    distill.add_argument("--shard-size", type=arg_int_in(1), default=64)
    distill.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "gguf"],
                         help="the target's weights while it generates: auto (the default) is gguf for a GGUF "
                         "model on CPU, as `specdraft serve` runs it, else bf16; gguf, a GGUF model's own "
                         "quantization, is the fastest on CPU; its features are recorded in bf16 like the others")
    distill.add_argument("--seed", type=int, default=0)
    distill.set_defaults(func=cmd_distill)

    prompts = sub.add_parser("self-prompts", help="prompts a chat target writes itself (Magpie), for distill")
    prompts.add_argument("--model", required=True, help="a chat model: catalog name, HF directory or .gguf file")
    prompts.add_argument("--out", required=True, help="the JSONL prompt file to write")
    prompts.add_argument("--num", type=arg_int_in(1), default=2000, help="messages to draw (fewer are kept: "
                         "those the model ended itself, of 16 characters or more, no repeats)")
    prompts.add_argument("--max-tokens", type=arg_int_in(1), default=160)
    prompts.add_argument("--temperature", type=float, default=1.0)
    prompts.add_argument("--top-p", type=float, default=0.95)
    prompts.add_argument("--max-batch", type=arg_int_in(1, 256), default=32)
    prompts.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "gguf"],
                         help="the target's weights while it writes (as for distill)")
    prompts.add_argument("--seed", type=int, default=0)
    prompts.set_defaults(func=cmd_self_prompts)

    train = sub.add_parser("train", help="train a drafter on distilled data")
    kinds = train.add_subparsers(dest="kind", required=True)
    eagle = kinds.add_parser("eagle", help="an EAGLE-3 head (use it as --speculative-model eagle:OUT)")
    _add_training_arguments(eagle, "head", lr=3e-4)
    eagle.add_argument("--ttt-steps", type=arg_int_in(1, 16), default=3)
    eagle.add_argument("--variant", default="eagle3", choices=["eagle3", "eagle1"],
                       help="eagle3: three target streams fused, token loss (exports for vLLM); eagle1: the last "
                            "layer's stream, the target's own readout, feature regression plus token loss")
    eagle.add_argument("--init", default=None, metavar="HEAD_DIR",
                       help="start from a trained head (eagle:PATH, or `eagle` for the one shipped for the target) "
                       "and train it further; its draft vocabulary stays")
    eagle.set_defaults(func=cmd_train_eagle)

    medusa = kinds.add_parser("medusa", help="Medusa-1 heads (use them as --speculative-model medusa:OUT)")
    _add_training_arguments(medusa, "heads", lr=1e-3)
    medusa.add_argument("--heads", type=arg_int_in(1, 16), default=4, help="draft tokens the heads guess")
    medusa.set_defaults(func=cmd_train_medusa)

    table = kinds.add_parser("ngram-table", help="the n-gram table of the target's answers that the recycle "
                             "drafter reads (use it as --speculative-model recycle:OUT)")
    table.add_argument("--model", required=True)
    table.add_argument("--data", required=True, help="a `specdraft distill` output directory (tokens suffice)")
    table.add_argument("--out", required=True)
    table.add_argument("--top", type=arg_int_in(1, 16), default=4, help="next tokens kept per context")
    table.add_argument("--min-count", type=arg_int_in(1), default=2,
                       help="keep contexts seen at least this often in the answers")
    table.set_defaults(func=cmd_train_ngram_table)


def _add_training_arguments(parser: argparse.ArgumentParser, what: str, lr: float) -> None:
    """The options every head's training takes (`LoopConfig`'s settings, the data, the target)."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a `specdraft distill` output directory, or several "
                        "separated by commas, trained on as one")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=arg_int_in(1), default=1000)
    parser.add_argument("--draft-vocab", type=arg_int_in(1), default=None,
                        help="draft vocabulary size (the most frequent tokens of the data; default: all)")
    parser.add_argument("--batch-size", type=arg_int_in(1), default=8)
    parser.add_argument("--seq-len", type=arg_int_in(2), default=512)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=arg_int_in(1), default=100)
    parser.add_argument("--eval-every", type=arg_int_in(1), default=100)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the target's dtype")
    parser.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    parser.add_argument("--device", default="cpu",
                        help=f"where the target and the {what} train (cpu, or cuda on a GPU machine)")


def _loop_settings(args: argparse.Namespace) -> dict:
    """`LoopConfig`'s fields from the options `_add_training_arguments` made."""
    return {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
            "draft_vocab": args.draft_vocab, "seed": args.seed, "checkpoint_every": args.checkpoint_every,
            "eval_every": args.eval_every}


# transformers' class for a model type, for configs converted from GGUF (which name no architecture).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def cmd_train_medusa(args: argparse.Namespace) -> int:
    from specdraft.runtime.loader import load_model
    from specdraft.train.data import data_dirs, model_identity, train_val_splits
    from specdraft.train.medusa import MedusaTrainConfig, train_medusa

    dirs = data_dirs(args.data)
    config = MedusaTrainConfig(**_loop_settings(args), heads=args.heads)
    target = load_model(args.model, dtype=args.dtype, device=args.device)
    info = {**model_identity(args.model), "data_settings": _data_settings(dirs)}
    train, val = train_val_splits(dirs, layers=_recorded(dirs, [-1]))
    _, history = train_medusa(target, train, val, args.out, config, resume=args.resume, target_info=info)
    if history["val_agreement"]:
        print("validation top-1 agreement per head: " + " ".join(f"{a:.3f}" for a in history["val_agreement"][-1]))
    print(f"heads saved in {args.out}; use them with --speculative-model medusa:{args.out}")
    return 0


def cmd_train_ngram_table(args: argparse.Namespace) -> int:
    from specdraft.runtime.loader import load_model
    from specdraft.train.data import model_identity
    from specdraft.train.ngram_table import build_ngram_table

    target = load_model(args.model, dtype="bf16", progress=False)
    table = build_ngram_table(target, args.data, args.out, top=args.top, min_count=args.min_count,
                              target_info=model_identity(args.model))
    meta = table.meta
    print(f"{args.out}: {len(table)} contexts from {meta['answer_tokens']} answer tokens of {meta['sequences']} "
          f"sequences; use it with --speculative-model recycle:{args.out}")
    return 0


def add_export_command(sub) -> None:
    export = sub.add_parser("export", help="write a trained drafter in a format GPU serving engines load")
    kinds = export.add_subparsers(dest="kind", required=True)
    eagle = kinds.add_parser("eagle", help="an EAGLE-3 head, for vLLM / SGLang (speculators format)")
    eagle.add_argument("--model", required=True, help="the target the head drafts for (catalog name, HF "
                       "directory or .gguf file); its Hub name goes into the config as the verifier")
    eagle.add_argument("--head", required=True, help="the head directory (eagle:PATH also accepted)")
    eagle.add_argument("--format", default="speculators", choices=["speculators", "eagle3"])
    eagle.add_argument("--out", required=True)
    eagle.add_argument("--num-speculative-tokens", type=arg_int_in(1, 64), default=3,
                       help="draft tokens per round the config proposes to the serving engine")
    eagle.set_defaults(func=cmd_export_eagle)


def cmd_export_eagle(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from specdraft.drafters.eagle import EagleHead
    from specdraft.errors import SpecdraftError
    from specdraft.runtime.loader import CATALOG, load_model, resolve

    head_dir = args.head.removeprefix("eagle:")
    if Path(args.out).resolve() == Path(head_dir).resolve():
        raise SpecdraftError("--out must differ from --head (the export would overwrite the head it reads)")
    head = EagleHead.load(head_dir)
    head.check_target(load_model(args.model, dtype="bf16", progress=False))
    entry = CATALOG.get(args.model)
    verifier = entry.hf_repo if entry is not None and entry.hf_repo else args.model
    raw = json.loads((resolve(args.model, progress=False) / "config.json").read_text())
    known = ARCHITECTURES.get(raw.get("model_type", ""))
    architectures = raw.get("architectures") or ([known] if known else [])
    out = head.save(args.out, format=args.format, verifier=verifier, verifier_architectures=architectures,
                    speculative_tokens=args.num_speculative_tokens)
    print(f"{out}: EAGLE-3 head in the {args.format} format, verifier {verifier}")
    return 0


def _recorded(dirs: list[str], layers: list[int]) -> list[int]:
    """`layers` when every distillation recorded them all (training reads them), else [] (training recomputes
    the target's features with a forward per batch, several times slower), with a message either way."""
    from specdraft.train.data import recorded_layers

    where = ", ".join(dirs)
    missing = sorted({layer for d in dirs for layer in set(layers) - set(recorded_layers(d))})
    if not missing:
        print(f"training on the target features recorded in {where} (layers {sorted(layers)})")
        return sorted(layers)
    print(f"{where}: no recorded features for layers {missing}: recomputing them with a target forward per batch "
          f"(distill with --features heads to record them)")
    return []


def _data_settings(dirs: list[str]) -> dict | list[dict]:
    """What the head's card keeps of its data: the distillation's settings (a list of them for several)."""
    from specdraft.train.data import read_manifest

    settings = [read_manifest(d).get("settings", {}) for d in dirs]
    return settings[0] if len(settings) == 1 else settings


def cmd_self_prompts(args: argparse.Namespace) -> int:
    from specdraft.runtime.loader import load_model, load_tokenizer
    from specdraft.train.self_prompts import SelfPromptConfig, self_prompts, user_turn_prefix, write_prompts

    config = SelfPromptConfig(num=args.num, max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, max_batch=args.max_batch)
    tokenizer = load_tokenizer(args.model)
    prefix = user_turn_prefix(tokenizer)  # before loading the weights: a base model is refused at once
    kept, counts = self_prompts(load_model(args.model, dtype=args.dtype), tokenizer, config, prefix)
    write_prompts(args.out, kept)
    print(f"{args.out}: {counts['kept']} prompts kept of {counts['drawn']} drawn ({counts['tokens']} tokens in "
          f"{counts['seconds']:.0f} s, {counts['tokens'] / max(counts['seconds'], 1e-9):.0f} tok/s)")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdraft.runtime.loader import load_model, load_tokenizer
    from specdraft.train.data import file_sha256, model_identity
    from specdraft.train.distill import DistillConfig, distill, head_feature_layers, read_prompts

    prompts = read_prompts(args.prompts, None if args.shuffle else args.limit)
    model, tokenizer = load_model(args.model, dtype=args.dtype), load_tokenizer(args.model)
    layers = head_feature_layers(model) if args.features == "heads" else []
    config = DistillConfig(max_tokens=args.max_tokens, shard_size=args.shard_size, max_batch=args.max_batch,
                           limit=args.limit, seed=args.seed, shuffle=args.shuffle,
                           max_prompt_tokens=args.max_prompt_tokens, hidden_layers=layers)
    # what "auto" resolved to, so the manifest (and a resumed run's check) names the weights that generated
    weights = args.dtype if args.dtype != "auto" else "gguf" if model.native_report is not None else "bf16"
    identity = {**model_identity(args.model), "prompts_sha256": file_sha256(args.prompts), "dtype": weights}
    manifest = distill(model, tokenizer, prompts, args.out, config, identity)
    disk = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    print(f"{args.out}: {manifest['train_sequences']} train / {manifest['val_sequences']} validation sequences, "
          f"{manifest['train_tokens'] + manifest['val_tokens']} tokens, {manifest['skipped_prompts']} prompts "
          f"skipped; {disk / 2**20:.0f} MiB on disk")
    return 0


def _head_path(ref: str, target) -> str:
    """A head directory from `eagle` (the one shipped for the target), `eagle:PATH` or PATH."""
    from specdraft.drafters.shipped import require_shipped_head

    if ref == "eagle":
        return str(require_shipped_head("eagle", target))
    return ref.removeprefix("eagle:")


def cmd_train_eagle(args: argparse.Namespace) -> int:
    from specdraft.drafters.eagle import EagleConfig
    from specdraft.runtime.loader import load_model
    from specdraft.train.data import data_dirs, model_identity, train_val_splits
    from specdraft.train.eagle import TrainConfig, train_eagle

    dirs = data_dirs(args.data)
    config = TrainConfig(**_loop_settings(args), ttt_steps=args.ttt_steps, variant=args.variant)
    target = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.init is not None:
        config.init_head = _head_path(args.init, target)
    info = {**model_identity(args.model), "data_settings": _data_settings(dirs)}
    aux = EagleConfig.for_target(target, variant=args.variant).hidden_layers
    train, val = train_val_splits(dirs, layers=_recorded(dirs, [*aux, -1]))
    result = train_eagle(target, train, val, args.out, config, resume=args.resume, target_info=info)
    val = result.history["val_agreement"]
    if val:
        print("validation top-1 agreement per draft step: " + " ".join(f"{a:.3f}" for a in val[-1]))
    print(f"head saved in {args.out}; use it with --speculative-model eagle:{args.out}")
    return 0
