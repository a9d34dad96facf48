"""Streamed against not streamed through one `specdraft serve` process, alternated: what streaming costs the
server at each concurrency (the same requests, `bench-serve`'s client, medians of the passes). With several
`--stream-interval`s, a server each, streamed alike and alternated, the first also not streamed; with
`--server-flags`, a server for each set of `specdraft serve` flags (e.g. uvicorn's `--http`, `--loop`), each
streamed and not.

On Linux it also says where the CPU goes, per output token: the server's event-loop thread (HTTP, SSE, the
loopback sends; its main thread), the rest of the server (the engine thread and the kernels' OpenMP workers)
and the client (this process). On 2 cores every microsecond the first and last spend is taken from a forward
that keeps both cores busy, so their sum over a token's time is about what streaming costs.

    .venv/bin/python scripts/serve_stream_ab.py [--model smollm2-135m] [--concurrency 1,8] [--passes 4]
        [--max-tokens 64] [--stream-interval 1[,2,...]] [--server-flags "--http h11;--http httptools"]
"""

from __future__ import annotations

import argparse
import os
import statistics
from contextlib import ExitStack
from pathlib import Path

from specdraft.bench.serve_bench import _run_level, _serve_process
from specdraft.bench.suite import load_suite


def _children() -> set[int]:
    """The processes this one started (empty where /proc cannot tell)."""
    me, out = str(os.getpid()), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            out.add(int(stat.parent.name))
    return out


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process `pid`."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _cpu_split(pid: int | None, before: dict[int, float], client_s: float, tokens: int) -> dict[str, float]:
    """ms of CPU per output token since `before`: the server's event loop, the rest of the server, the client."""
    if pid is None or not tokens:
        return {}
    after = _thread_cpu(pid)
    spent = {tid: s - before.get(tid, 0.0) for tid, s in after.items()}
    loop = spent.pop(pid, 0.0)
    return {"event loop": 1e3 * loop / tokens, "engine + workers": 1e3 * sum(spent.values()) / tokens,
            "client": 1e3 * client_s / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suite", default="../shared/data/specbench-dev.jsonl")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream-interval", default="1",
                        help="the servers' --stream-interval; several (1,2) start a server each, streamed alike")
    parser.add_argument("--server-flags", default=None,
                        help="';'-separated sets of serve flags, a server each (instead of --stream-interval)")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    intervals = [int(n) for n in args.stream_interval.split(",")]
    prompts = [q.turns[0] for q in load_suite(args.suite)]
    with ExitStack() as stack:
        flag_sets = [flags.split() for flags in args.server_flags.split(";")] if args.server_flags else None
        settings = [(1, flags) for flags in flag_sets] if flag_sets else [(n, []) for n in intervals]
        servers = []  # (label, url, pid)
        for interval, flags in settings:
            serve_args = argparse.Namespace(model=args.model, dtype="auto", api_key=None, num_speculative_tokens=5,
                                            stream_interval=interval, server_flags=flags)
            before = _children()
            url = stack.enter_context(_serve_process(serve_args, max(levels), None))
            started = _children() - before
            label = " ".join(flags) if flag_sets else f"interval {interval}" if len(intervals) > 1 else ""
            servers.append((label, url, started.pop() if len(started) == 1 else None))
            _run_level(url, args.model, prompts[:1], 1, 4, None)  # warm-up
        # every server streamed, and the first one (each one, with --server-flags) not streamed:
        # (label, url, pid, stream)
        modes = [(f"streamed, {label}" if label else "streamed", url, pid, True) for label, url, pid in servers]
        modes += [(f"not streamed, {label}" if flag_sets else "not streamed", url, pid, False)
                  for label, url, pid in (servers if flag_sets else servers[:1])]
        for concurrency in levels:
            batch = [prompts[i % len(prompts)] for i in range(max(8, 2 * concurrency))]
            rates: dict[str, list[float]] = {label: [] for label, *_ in modes}
            cpu: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in modes}
            for _ in range(args.passes):
                for label, url, pid, stream in modes:
                    before, client = _thread_cpu(pid) if pid else {}, os.times()
                    results, wall = _run_level(url, args.model, batch, concurrency, args.max_tokens, None, stream)
                    client_s = sum(os.times()[:2]) - sum(client[:2])
                    if any("error" in r for r in results):
                        raise SystemExit(f"a request failed: {next(r for r in results if 'error' in r)}")
                    tokens = sum(r["tokens"] for r in results)
                    rates[label].append(tokens / wall)
                    cpu[label].append(_cpu_split(pid, before, client_s, tokens))
            for label, runs in rates.items():
                split = "".join(f", {part} {statistics.median(c[part] for c in cpu[label]):.3f}"
                                for part in (cpu[label][0] if cpu[label] else {}))
                print(f"c={concurrency} {label:22} output tok/s median {statistics.median(runs):.1f}  "
                      f"runs {' '.join(f'{r:.0f}' for r in runs)}"
                      + (f"\n      ms of CPU per token (medians){split}" if split else ""), flush=True)
            unstreamed = modes[len(servers)][0]
            for label, runs in rates.items():
                if label != unstreamed:
                    ratios = [a / b for a, b in zip(runs, rates[unstreamed])]
                    print(f"c={concurrency} {label} / {unstreamed}, median of each pass's ratio "
                          f"{statistics.median(ratios):.3f}", flush=True)


if __name__ == "__main__":
    main()
