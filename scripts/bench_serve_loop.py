"""The server's own CPU per streamed token, without a model's forwards competing for the cores: a tiny random
model whose every round sleeps `--round-ms` (standing in for a forward that holds no GIL), served in a thread
of this process, one client streaming in another process. Prints the CPU time per token of the uvicorn
thread, of the engine thread and of the client's process, streamed and not, medians of `--rounds`.

    .venv/bin/python scripts/bench_serve_loop.py [--tokens 200] [--requests 8] [--round-ms 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serve_cpu import cpu_seconds  # noqa: E402  (scripts/, on the path as this script's folder)
from test_cpu_kernels import kernel_model  # noqa: E402
from test_server import CharHF, SlowEngine, make_engine  # noqa: E402

from specdraft.bench.serve_bench import _run_level  # noqa: E402
from specdraft.runtime.tokenizer import Tokenizer  # noqa: E402
from specdraft.server import create_app, serve_in_thread  # noqa: E402


def cpu_s(stat: str, system: bool = False) -> float:
    """User + system seconds (system alone with `system`) of the /proc/.../stat file at `stat`."""
    return cpu_seconds(Path(stat).read_text(), system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--round-ms", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=1, help="clients at once (the engine batches them)")
    args = parser.parse_args()
    tokenizer = Tokenizer(CharHF())
    engine = SlowEngine(make_engine(kernel_model("llama"), tokenizer, max_batch=args.concurrency, drafter=False),
                        args.round_ms / 1e3)
    prompts = ["abcabcabd"] * args.requests
    clients = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with serve_in_thread(create_app(engine, tokenizer, "tiny"), log_level="warning") as url:
        threads = {t.name: t.native_id for t in threading.enumerate()}
        client_pid = clients.submit(os.getpid).result()
        watched = {"uvicorn": f"/proc/self/task/{threads['specdraft-uvicorn']}/stat",
                   "engine": f"/proc/self/task/{threads['specdraft-engine']}/stat",
                   "client": f"/proc/{client_pid}/stat"}
        watched = {**watched, **{f"{name} (system)": stat for name, stat in watched.items()}}
        clients.submit(_run_level, url, "tiny", prompts[:1], 1, 4, None).result()
        per_token: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for way, stream in (("streamed", True), ("not", False)):
                before = {n: cpu_s(stat, n.endswith("(system)")) for n, stat in watched.items()}
                start = time.perf_counter()
                results, _ = clients.submit(_run_level, url, "tiny", prompts, args.concurrency, args.tokens, None,
                                            stream).result()
                wall = time.perf_counter() - start
                tokens = sum(r["tokens"] for r in results)
                for name, stat in watched.items():
                    per_token.setdefault((name, way), []).append((cpu_s(stat, name.endswith("(system)")) - before[name])
                                                                   / tokens * 1e3)
                per_token.setdefault(("wall", way), []).append(wall / tokens * 1e3)
    clients.shutdown()
    print(f"ms per token, medians of {args.rounds} rounds of {args.requests} x {args.tokens} tokens, "
          f"{args.concurrency} at a time, rounds of {args.round_ms} ms asleep")
    for name in ("uvicorn", "uvicorn (system)", "engine", "engine (system)", "client", "client (system)", "wall"):
        print(f"{name:17} streamed {statistics.median(per_token[name, 'streamed']):.3f}  "
              f"not {statistics.median(per_token[name, 'not']):.3f}")


if __name__ == "__main__":
    main()
