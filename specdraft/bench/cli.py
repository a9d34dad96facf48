"""Registers the benchmark subcommands on the main CLI: `bench`, `bench-runtime`, `bench-fallback`,
`bench-draft` and `bench-serve`."""

from __future__ import annotations

import argparse
import importlib

# name -> (module in specdraft.bench with add_arguments() and the run function, run function, help, description)
COMMANDS = {
    "bench": (
        "specbench", "run_bench", "Spec-Bench style comparison of decoding methods per category",
        "Runs every method (plain, drafters, optional peer engines) on the same prompts, interleaved, and "
        "writes results.json, report.md, speedup.png and acceptance.png to --out."),
    "bench-runtime": (
        "runtime_bench", "run_runtime_bench",
        "plain decoding speed of our runtime vs transformers, and the bandwidth floor",
        "Greedy decoding tok/s (decode and prefill separately) of our runtime and transformers in bf16 and "
        "fp32, against the memory-bandwidth floor measured in the same run; writes runtime.json."),
    "bench-fallback": (
        "fallback_bench", "run_fallback_bench",
        "cost of an always-wrong drafter with automatic fallback, vs plain decoding",
        "Plain decoding vs a drafter whose tokens are always rejected, with and without adaptive fallback, "
        "interleaved on the same prompts; writes fallback.json."),
    "bench-draft": (
        "draft_cost", "run_draft_cost", "what one draft step of each drafter costs against one target step",
        "Decodes the same prompts plainly and with each drafter at a fixed draft length, interleaved, and "
        "reports the median drafting time per draft token against the median plain step; writes "
        "draft_cost.json."),
    "bench-serve": (
        "serve_bench", "run_serve_bench",
        "the OpenAI server under concurrent streaming clients, speculation off and on",
        "Streams the suite's prompts through the server at each concurrency level, plain and speculative "
        "interleaved; throughput and TTFT/TPOT/ITL p50/p99; writes serve.json and serve.png."),
}


def add_bench_commands(sub: argparse._SubParsersAction) -> None:
    for name, (module_name, run_name, help_text, description) in COMMANDS.items():
        module = importlib.import_module(f"specdraft.bench.{module_name}")
        parser = sub.add_parser(name, help=help_text, description=description)
        module.add_arguments(parser)
        parser.set_defaults(func=_exit_zero(getattr(module, run_name)))


def _exit_zero(run):
    def command(args: argparse.Namespace) -> int:
        run(args)
        return 0

    return command
