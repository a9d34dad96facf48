"""Command line: `specdraft generate | models | convert | demo | serve | bench | bench-runtime`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from specdraft.config import BACKEND_HELP, BACKENDS, DTYPE_HELP, arg_draft_length, arg_int_in, arg_tree_size
from specdraft.drafters import DRAFTER_HELP
from specdraft.errors import SpecdraftError
from specdraft.verify.logprobs import MAX_LOGPROBS, TokenLogprobs
from specdraft.verify.sampling import SamplingParams

# ANSI colours for --show-drafts: accepted draft tokens, the target's corrections, bonus tokens.
ORIGIN_COLOURS = {"draft": "\033[32m", "correction": "\033[31m", "bonus": "\033[34m", "target": ""}
RESET = "\033[0m"


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=args.stop or (),
                          logprobs=args.logprobs, repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                          logit_bias=dict(args.logit_bias or ()))


def _token_bias(text: str) -> tuple[int, float]:
    """An argparse type for `--logit-bias ID=BIAS`."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 42=-100), got {text!r}") from None


def _build_llm(args: argparse.Namespace):
    from specdraft.api import LLM

    if args.config:
        return LLM(args.config)
    return LLM(model=args.model, speculative_model=args.speculative_model,
               num_speculative_tokens=args.num_speculative_tokens, tree=args.tree, dtype=args.dtype,
               max_model_len=args.max_model_len, max_batch=args.max_batch, adaptive=not args.no_adaptive,
               backend=args.backend)


def add_speculation_arguments(parser: argparse.ArgumentParser, default_drafter: str | None = None) -> None:
    """The drafter and its draft length, spelled the same on every command (and in the API and config)."""
    parser.add_argument("--speculative-model", "--draft", dest="speculative_model", default=default_drafter,
                        metavar="DRAFTER", help=DRAFTER_HELP)
    parser.add_argument("--num-speculative-tokens", "-k", dest="num_speculative_tokens", type=arg_draft_length,
                        default=5, metavar="K", help="draft tokens per round (the maximum, when adaptive)")
    parser.add_argument("--tree", type=arg_tree_size, default=0, metavar="N",
                        help="draft a token tree of at most N tokens, K deep (0: a chain); with adaptation each "
                             "request picks chain or tree by measured speed")


def cmd_generate(args: argparse.Namespace) -> int:
    from specdraft.runtime.tokenizer import StreamDecoder, check_text

    params = _sampling_params(args)
    check_text(args.prompt, "prompt")
    llm = _build_llm(args)
    stream = llm.stream(args.prompt, params, chat=args.chat)
    result = None
    decoder = StreamDecoder(llm.tokenizer) if args.show_drafts else None
    for chunk in stream:
        if decoder is not None:
            for token, origin in zip(chunk.token_ids, chunk.origins):
                piece = decoder.push([token])
                sys.stdout.write(f"{ORIGIN_COLOURS[origin]}{piece}{RESET if ORIGIN_COLOURS[origin] else ''}")
        else:
            sys.stdout.write(chunk.text)
        sys.stdout.flush()
        result = chunk.result or result
    sys.stdout.write("\n")
    sys.stdout.flush()  # before the report on stderr
    if args.show_drafts:
        print("legend: " + " ".join(f"{c}{name}{RESET}" for name, c in ORIGIN_COLOURS.items() if c),
              file=sys.stderr)
    if result.logprobs is not None:
        print(logprob_table(result.logprobs, llm.tokenizer.token_piece), file=sys.stderr)
    print(f"[{result.finish_reason}] {result.metrics.summary()}", file=sys.stderr)
    for line in result.adaptation_log:
        print(f"  adaptive: {line}", file=sys.stderr)
    return 0


def logprob_table(logprobs: Sequence[TokenLogprobs], piece: Callable[[int], str]) -> str:
    """One line per generated token: its text, log-probability and rank, then the most likely ones."""
    lines = [f"{'#':>4}  {'token':<16} {'logprob':>8} {'rank':>5}  most likely"]
    for i, entry in enumerate(logprobs):
        alternatives = "  ".join(f"{piece(t)!r} {value:.3f}" for t, value in entry.top)
        lines.append(f"{i:>4}  {piece(entry.token_id)!r:<16} {entry.logprob:>8.3f} {entry.rank:>5}  {alternatives}")
    return "\n".join(lines)


def cmd_models(args: argparse.Namespace) -> int:
    from specdraft.runtime.loader import CATALOG, cache_root

    converted_dir = cache_root() / "converted"
    converted = sorted(p.name for p in converted_dir.iterdir()) if converted_dir.exists() else []
    print("catalog:")
    for entry in CATALOG.values():
        print(f"  {entry.name:<14} {entry.description}   (install: {entry.install_hint})")
    print(f"converted in {converted_dir}:")
    for name in converted:
        size = sum(f.stat().st_size for f in (converted_dir / name).iterdir()) / 1e6
        print(f"  {name}  ({size:.0f} MB)")
    if not converted:
        print("  (none yet: the first use of a model converts it)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from specdraft.runtime.loader import resolve

    for ref in args.models:
        print(f"{ref}: {resolve(ref)}")
    return 0


DEMO_PROMPTS = (
    # Open-ended: little of the answer is in the prompt, so a drafter that copies has little to offer and the
    # engine falls back to plain decoding.
    "Explain in a few sentences why the sky is blue.",
    # Grounded in its input, as summaries, edits and retrieval answers are: much of the answer repeats it.
    "Fix the spelling mistakes in this paragraph and return the corrected paragraph: The sky apears blue "
    "becuase molecules in the air scatter blue light from the sun more then they scatter red light. When we "
    "look toward the sky away from the sun, we see this scatered blue light comming from every direction. At "
    "sunset, sunlight pases through more air, so most of the blue is scattered away and the sky looks red and "
    "orange.",
)


def cmd_demo(args: argparse.Namespace) -> int:
    """Speculative generation with the default drafter next to plain decoding of the same prompts: one
    open-ended, one grounded in its input (or the one `--prompt`)."""
    from specdraft.api import LLM
    from specdraft.engine.core import Engine

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    drafter, k = args.speculative_model, args.num_speculative_tokens
    llm = LLM(model=args.model, speculative_model=drafter, num_speculative_tokens=k, tree=args.tree,
              backend=args.backend)
    plain_engine = Engine(llm.target, llm.tokenizer, None, 0, max_model_len=llm.engine.max_model_len)
    if llm.engine.drafter is not None:  # `auto` resolved: the shipped head marked default, else ngram
        drafter = llm.engine.drafter.name
    shape = f"trees of up to {args.tree} tokens" if args.tree else "chains"
    weights = "GGUF-native" if llm.target.native_report is not None else str(llm.target.dtype).removeprefix("torch.")
    print(f"model {args.model} ({weights} weights), drafter {drafter}, K={k}, {shape}, greedy, "
          f"up to {args.max_tokens} tokens")
    all_same = True
    for prompt in [args.prompt] if args.prompt else DEMO_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        # The same warm-up for both engines: each then finds the prompt in its cache (prefix reuse).
        warm = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8))[0]
        plain_engine.generate(warm.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=8))
        print(f"\nprompt: {prompt}\n")
        spec = llm.chat(messages, params)[0]
        plain = plain_engine.generate(spec.prompt_token_ids, params)
        print(spec.text.strip(), "\n")
        print(f"speculative ({drafter}): {spec.metrics.summary()}")
        print(f"plain decoding:           {plain.metrics.summary()}")
        same = spec.outputs[0].token_ids == plain.token_ids
        all_same = all_same and same
        speedup = plain.metrics.total_time / spec.metrics.total_time
        print(f"identical output: {'yes' if same else 'NO'}; speedup {speedup:.2f}x")
    return 0 if all_same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdraft", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, streaming it")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2-135m", help="catalog name, HF directory or .gguf file")
    add_speculation_arguments(gen)
    gen.add_argument("--config", help="JSON config file (replaces the model and speculation options)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=arg_int_in(1), default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="HF's: divide (or multiply, if negative) the logits of tokens already in the prompt or "
                          "output (1: none)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="OpenAI's: subtract this times a token's count in the output (-2 to 2)")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="OpenAI's: subtract this from tokens already in the output (-2 to 2)")
    gen.add_argument("--logit-bias", type=_token_bias, action="append", metavar="ID=BIAS",
                     help="OpenAI's: add BIAS (-100 to 100) to token ID's logit (repeatable)")
    gen.add_argument("--logprobs", type=arg_int_in(0, MAX_LOGPROBS), default=None, metavar="N",
                     help="after the text, each token's log-probability under the target and its N most likely "
                          "alternatives (on stderr)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "bf16", "gguf", "fp32", "fp16"], help=DTYPE_HELP)
    gen.add_argument("--backend", default="specdraft", choices=BACKENDS, help=BACKEND_HELP)
    gen.add_argument("--max-model-len", type=arg_int_in(2), default=4096)
    gen.add_argument("--max-batch", type=arg_int_in(1, 256), default=1, help="requests in flight at once")
    gen.add_argument("--no-adaptive", action="store_true", help="fixed K, no fallback to plain decoding")
    gen.add_argument("--show-drafts", action="store_true",
                     help="colour tokens: green accepted draft, red target correction, blue bonus")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list the catalog and the converted cache")
    models.set_defaults(func=cmd_models)

    conv = sub.add_parser("convert", help="convert models into the cache now (GGUF -> safetensors)")
    conv.add_argument("models", nargs="+")
    conv.set_defaults(func=cmd_convert)

    demo = sub.add_parser("demo", help="speculative vs plain decoding on one prompt")
    demo.add_argument("--model", default="smollm2-135m")
    add_speculation_arguments(demo, default_drafter="auto")
    demo.add_argument("--max-tokens", type=arg_int_in(1), default=128)
    demo.add_argument("--prompt", default=None, help="one prompt instead of the two built in")
    demo.add_argument("--backend", default="specdraft", choices=BACKENDS, help=BACKEND_HELP)
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'server' extra)")
    from specdraft.server.cli import add_arguments as add_serve_arguments
    from specdraft.server.cli import cmd_serve

    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    from specdraft.bench.cli import add_bench_commands

    add_bench_commands(sub)

    from specdraft.train.cli import add_commands as add_train_commands
    from specdraft.train.cli import add_export_command

    add_train_commands(sub)  # distill, train eagle
    add_export_command(sub)  # export eagle

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecdraftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
