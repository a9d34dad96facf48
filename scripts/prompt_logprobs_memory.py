"""Peak memory and time of scoring a long prompt (`prompt_logprobs`) against the same prompt's first token alone,
each in a fresh process (the peak resident memory during the request, from the RSS it started at; Linux's
/proc): what `Engine._scored_prompt_forward`'s blocks bound.

    .venv/bin/python scripts/prompt_logprobs_memory.py [--model gemma3-270m] [--tokens 3000] [--blocks-of-bytes N]

`--blocks-of-bytes` sets `engine.core.PROMPT_LOGITS_BYTES` (a huge value: the whole prompt's logits at once).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def measure(model: str, tokens: int, scored: bool, block_bytes: int | None) -> dict:
    from specdraft.engine import core
    from specdraft.engine.core import build_engine
    from specdraft.runtime.loader import load_model, load_tokenizer
    from specdraft.verify.sampling import SamplingParams

    if block_bytes is not None:
        core.PROMPT_LOGITS_BYTES = block_bytes
    tokenizer = load_tokenizer(model, progress=False)
    target = load_model(model, dtype="auto", progress=False)
    engine = build_engine(target, tokenizer, None, 0, max_model_len=tokens + 8)
    words = ("the quick brown fox jumps over the lazy dog and keeps running through the field " * 2000).split()
    ids = tokenizer.encode(" ".join(words))[:tokens]
    before = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    start = time.perf_counter()
    result = engine.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1 if scored else None))
    return {"scored": scored, "seconds": round(time.perf_counter() - start, 2), "rss_mb_before": before,
            "peak_rss_mb_during": _status_mb("VmHWM"), "first_token": result.token_ids[0], "prompt_tokens": len(ids)}


def _status_mb(field: str) -> int:
    """A memory field of /proc/self/status (kB there), in MB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--blocks-of-bytes", type=int, default=None)
    parser.add_argument("--one", choices=["scored", "bare"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.tokens, args.one == "scored", args.blocks_of_bytes)))
        return
    for one in ("bare", "scored"):
        extra = [] if args.blocks_of_bytes is None else ["--blocks-of-bytes", str(args.blocks_of_bytes)]
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens),
                              "--one", one, *extra], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
