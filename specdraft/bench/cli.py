"""Registers the benchmark subcommands on the main CLI: `specdraft bench` and `specdraft bench-runtime`."""

from __future__ import annotations

import argparse


def cmd_bench(args: argparse.Namespace) -> int:
    from specdraft.bench.specbench import run_bench

    run_bench(args)
    return 0


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    from specdraft.bench.runtime_bench import run_runtime_bench

    run_runtime_bench(args)
    return 0


def cmd_bench_fallback(args: argparse.Namespace) -> int:
    from specdraft.bench.fallback_bench import run_fallback_bench

    run_fallback_bench(args)
    return 0


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    from specdraft.bench import fallback_bench, runtime_bench, specbench

    bench = sub.add_parser(
        "bench", help="Spec-Bench style comparison of decoding methods per category",
        description="Runs every method (plain, drafters, optional peer engines) on the same prompts, "
                    "interleaved, and writes results.json, report.md, speedup.png and acceptance.png to "
                    "--out.")
    specbench.add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    runtime = sub.add_parser(
        "bench-runtime", help="plain decoding speed of our runtime vs transformers, and the bandwidth floor",
        description="Greedy decoding tok/s (decode and prefill separately) of our runtime and transformers "
                    "in bf16 and fp32, against the memory-bandwidth floor measured in the same run; writes "
                    "runtime.json.")
    runtime_bench.add_arguments(runtime)
    runtime.set_defaults(func=cmd_bench_runtime)

    fallback = sub.add_parser(
        "bench-fallback", help="cost of an always-wrong drafter with automatic fallback, vs plain decoding",
        description="Plain decoding vs a drafter whose tokens are always rejected, with and without adaptive "
                    "fallback, interleaved on the same prompts; writes fallback.json.")
    fallback_bench.add_arguments(fallback)
    fallback.set_defaults(func=cmd_bench_fallback)
