"""`specdraft distill` and `specdraft train eagle`."""

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
    distill.add_argument("--max-batch", type=arg_int_in(1, 256), default=16)
    distill.add_argument("--shard-size", type=arg_int_in(1), default=64)
    distill.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    distill.add_argument("--seed", type=int, default=0)
    distill.set_defaults(func=cmd_distill)

    train = sub.add_parser("train", help="train a drafter on distilled data")
    kinds = train.add_subparsers(dest="kind", required=True)
    eagle = kinds.add_parser("eagle", help="an EAGLE-3 head (use it as --speculative-model eagle:OUT)")
    eagle.add_argument("--model", required=True)
    eagle.add_argument("--data", required=True, help="a `specdraft distill` output directory")
    eagle.add_argument("--out", required=True)
    eagle.add_argument("--steps", type=arg_int_in(1), default=1000)
    eagle.add_argument("--ttt-steps", type=arg_int_in(1, 16), default=3)
    eagle.add_argument("--draft-vocab", type=arg_int_in(1), default=None,
                       help="draft vocabulary size (the most frequent tokens of the data; default: all)")
    eagle.add_argument("--batch-size", type=arg_int_in(1), default=8)
    eagle.add_argument("--seq-len", type=arg_int_in(2), default=512)
    eagle.add_argument("--lr", type=float, default=3e-4)
    eagle.add_argument("--seed", type=int, default=0)
    eagle.add_argument("--checkpoint-every", type=arg_int_in(1), default=100)
    eagle.add_argument("--eval-every", type=arg_int_in(1), default=100)
    eagle.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the target's dtype")
    eagle.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    eagle.set_defaults(func=cmd_train_eagle)


def _identity(model: str) -> dict:
    from specdraft.runtime.loader import resolve
    from specdraft.train.data import model_fingerprint

    return {"model": model, "model_fingerprint": model_fingerprint(resolve(model))}


def cmd_distill(args: argparse.Namespace) -> int:
    from specdraft.engine.core import Engine
    from specdraft.runtime.loader import load_model, load_tokenizer
    from specdraft.train.data import file_sha256
    from specdraft.train.distill import DistillConfig, distill, read_prompts

    config = DistillConfig(max_tokens=args.max_tokens, shard_size=args.shard_size, max_batch=args.max_batch,
                           limit=args.limit, seed=args.seed)
    prompts = read_prompts(args.prompts, args.limit)
    model, tokenizer = load_model(args.model, dtype=args.dtype), load_tokenizer(args.model)
    engine = Engine(model, tokenizer, None, 0, max_batch=args.max_batch)
    identity = {**_identity(args.model), "prompts_sha256": file_sha256(args.prompts), "dtype": args.dtype}
    manifest = distill(engine, tokenizer, prompts, args.out, config, identity)
    print(f"{args.out}: {manifest['train_sequences']} train / {manifest['val_sequences']} validation sequences, "
          f"{manifest['train_tokens'] + manifest['val_tokens']} tokens")
    return 0


def cmd_train_eagle(args: argparse.Namespace) -> int:
    from specdraft.runtime.loader import load_model
    from specdraft.train.data import load_split, read_manifest
    from specdraft.train.eagle import TrainConfig, train_eagle

    manifest = read_manifest(args.data)
    config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                         ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, seed=args.seed,
                         checkpoint_every=args.checkpoint_every, eval_every=args.eval_every)
    target = load_model(args.model, dtype=args.dtype)
    info = {**_identity(args.model), "data_settings": manifest.get("settings", {})}
    result = train_eagle(target, load_split(args.data, "train"), load_split(args.data, "val"), args.out, config,
                         resume=args.resume, target_info=info)
    val = result.history["val_agreement"]
    if val:
        print("validation top-1 agreement per draft step: " + " ".join(f"{a:.3f}" for a in val[-1]))
    print(f"head saved in {args.out}; use it with --speculative-model eagle:{args.out}")
    return 0
