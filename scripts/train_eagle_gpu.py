"""Train an EAGLE-3 head on a GPU for as many steps as fit a time budget (`specdraft train eagle --device cuda`
with the step count chosen by measurement).

A GPU recomputes the target's features for every batch at little cost, so tokens-only distillation data
(`specdraft distill --features none`, a few MB) is all it needs. The run times its first warm-up steps, sets
the step count that fills `--budget-s` (validation included), and trains on: the learning rate of the warm-up
steps does not depend on the step count, so the head is the one `specdraft train eagle --device cuda --steps
S` gives with the same settings (S is printed and saved). Writes the head (fp32, loadable as `eagle:DIR`),
its bf16 copy as shipped in specdraft/heads/ (`DIR/bf16`), history.json, loss.png, accuracy.png and
gpu_run.json (device, budget, step time, steps).

    PYTHONPATH=. python scripts/train_eagle_gpu.py --model M.gguf --data DATA --out DIR --budget-s 330
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from specdraft.drafters.eagle import EagleConfig, EagleHead
from specdraft.runtime.loader import load_model
from specdraft.train.data import model_identity, read_manifest, train_val_split
from specdraft.train.eagle import TrainConfig, train_eagle

TIMING_SKIP = 5  # warm-up steps not timed (CUDA start-up, cuBLAS heuristics)
EVAL_SHARE = 0.12  # of the budget kept for validation passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, required=True, help="seconds of training, validation included")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-name", default=None, help="the catalog name recorded in the head (default --model)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--variant", default="eagle3", choices=["eagle3", "eagle1"])
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--evals", type=int, default=8, help="validation passes over the run")
    ap.add_argument("--max-steps", type=int, default=100_000)
    args = ap.parse_args()
    out = Path(args.out)
    started = time.perf_counter()
    target = load_model(args.model, dtype="bf16", device=args.device)
    info = {**model_identity(args.model), "data_settings": read_manifest(args.data).get("settings", {})}
    if args.model_name:
        info["model"] = args.model_name
    aux = EagleConfig.for_target(target, variant=args.variant).hidden_layers
    train, val = train_val_split(args.data, layers=[])
    loaded = time.perf_counter()
    print(f"{len(train)} train / {len(val)} validation sequences; target on {target.device} "
          f"({loaded - started:.1f} s); aux layers {aux}", flush=True)

    base = TrainConfig(steps=args.max_steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                       warmup=args.warmup, ttt_steps=args.ttt_steps, variant=args.variant, draft_vocab=args.draft_vocab,
                       checkpoint_every=args.max_steps, eval_every=args.max_steps)
    # Time steps TIMING_SKIP..warmup (their learning rate is the same whatever the final step count), less
    # what a resumption costs before its first step (the head, its draft vocabulary, the checkpoint).
    train_eagle(target, train, val, out, base, stop_after=TIMING_SKIP, progress=False, target_info=info)
    setup = timed_run(lambda: train_eagle(target, train, val, out, base, resume=True, stop_after=0,
                                          progress=False, target_info=info))
    timed = args.warmup - TIMING_SKIP
    per_step = (timed_run(lambda: train_eagle(target, train, val, out, base, resume=True, stop_after=timed,
                                              progress=False, target_info=info)) - setup) / timed
    left = args.budget_s - (time.perf_counter() - loaded)
    steps = min(args.max_steps, args.warmup + max(1, int(left * (1 - EVAL_SHARE) / per_step)))
    eval_every = max(1, steps // args.evals)
    config = replace(base, steps=steps, checkpoint_every=max(1, steps // 4), eval_every=eval_every)
    print(f"{per_step * 1000:.1f} ms a step of {args.batch_size} x {args.seq_len}: {steps} steps "
          f"(validation every {eval_every})", flush=True)
    result = train_eagle(target, train, val, out, config, resume=True, target_info=info)
    sync()
    head = EagleHead.load(out).to(torch.bfloat16)
    head.save(out / "bf16")
    val_last = result.history["val_agreement"][-1] if result.history["val_agreement"] else []
    record = {"device": device_name(args.device), "torch": torch.__version__, "python": platform.python_version(),
              "budget_s": args.budget_s, "ms_per_step": per_step * 1000, "steps": steps,
              "epochs": steps * args.batch_size / len(train), "train_sequences": len(train),
              "val_sequences": len(val), "seconds": time.perf_counter() - started, "config": asdict(config),
              "val_agreement": val_last}
    (out / "gpu_run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_run(run) -> float:
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - t0


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
