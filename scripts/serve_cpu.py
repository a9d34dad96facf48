"""CPU time per generated token, thread by thread, of a `specdraft serve` process at one client: where the
server's own cost goes (event loop, engine thread, kernel workers) streamed and not, and the client's.

    .venv/bin/python scripts/serve_cpu.py [--model smollm2-135m] [--requests 8] [--max-tokens 64] [--rounds 3]

Starts the server as `bench-serve` does (its own process), sends the dev suite's first prompts one at a time
with `bench-serve`'s client (streamed, then not), and reads each thread's user + system time from
/proc/PID/task/*/stat before and after. CPU time is steadier than wall time on a noisy VM: a change to the
server's per-token work shows here first.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections import defaultdict
from pathlib import Path

from specdraft.bench.serve_bench import _run_level, _serve_process
from specdraft.bench.suite import load_suite

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat: str, system: bool = False) -> float:
    """User + system seconds (system alone with `system`) from the text of a /proc/.../stat file."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[12]) + (0 if system else int(fields[11]))) / TICK


def thread_cpu(pid: int) -> dict[str, float]:
    """Seconds of CPU (user + system) per thread of process `pid`, keyed by name and thread id."""
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        out[f"{stat[stat.index('(') + 1:stat.rindex(')')]} {task.name}"] += cpu_seconds(stat)
    return out


def server_pid(port: str) -> int:
    """The pid of the `specdraft serve` process listening on `port` (started by this script)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and port.encode() in argv:
            return int(proc.name)
    raise RuntimeError("the server process is gone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    serve_args = argparse.Namespace(model=args.model, dtype="auto", api_key=None, num_speculative_tokens=5)
    prompts = [q.turns[0] for q in load_suite(args.suite)][:args.requests]
    with _serve_process(serve_args, 1, None) as url:
        pid = server_pid(url.rsplit(":", 1)[1])
        _run_level(url, args.model, prompts[:1], 1, 4, None)  # warm-up
        per_token: dict[str, dict[str, list[float]]] = {"stream": defaultdict(list), "whole": defaultdict(list)}
        walls: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.rounds):
            for way, stream in (("stream", True), ("whole", False)):
                before, client_before = thread_cpu(pid), resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                results, _ = _run_level(url, args.model, prompts, 1, args.max_tokens, None, stream)
                walls[way].append(time.perf_counter() - start)
                after, client_after = thread_cpu(pid), resource.getrusage(resource.RUSAGE_SELF)
                tokens = sum(r["tokens"] for r in results)
                for name in after:
                    per_token[way][name].append((after[name] - before.get(name, 0.0)) / tokens * 1e3)
                client = (client_after.ru_utime + client_after.ru_stime - client_before.ru_utime
                          - client_before.ru_stime)
                per_token[way]["(client)"].append(client / tokens * 1e3)
                per_token[way]["(wall)"].append(walls[way][-1] / tokens * 1e3)
    print(f"ms of CPU per generated token, medians of {args.rounds} rounds of {len(prompts)} requests x "
          f"{args.max_tokens} tokens (thread CPU has 10 ms ticks: read totals, not small threads)")
    names = sorted(set(per_token["stream"]) | set(per_token["whole"]))
    print(f"{'thread':24} {'streamed':>9} {'not':>9}")
    for name in names:
        s = statistics.median(per_token["stream"].get(name, [0.0]))
        w = statistics.median(per_token["whole"].get(name, [0.0]))
        if s or w:
            print(f"{name:24} {s:9.3f} {w:9.3f}")


if __name__ == "__main__":
    main()
