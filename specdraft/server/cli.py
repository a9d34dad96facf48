"""`specdraft serve`: the OpenAI-compatible server on uvicorn, bound to localhost unless told otherwise."""

from __future__ import annotations

import argparse
import logging
import sys

from specdraft.config import BACKEND_HELP, BACKENDS, DTYPE_HELP, arg_int_in


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdraft.cli import add_speculation_arguments

    parser.add_argument("--model", default="smollm2-135m", help="catalog name, HF directory or .gguf file")
    add_speculation_arguments(parser)
    parser.add_argument("--config", help="JSON config file (replaces the model and speculation options)")
    parser.add_argument("--served-model-name", help="the name clients send as 'model' (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=arg_int_in(0, 65535), default=8000)
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    parser.add_argument("--max-batch", type=arg_int_in(1, 256), default=8,
                        help="requests generating at once (one KV-cache slot each); others wait")
    parser.add_argument("--max-model-len", type=arg_int_in(2), default=4096)
    parser.add_argument("--stream-interval", type=arg_int_in(1), default=1,
                        help="send a stream's tokens this many at a time (its first at once): fewer events, "
                             "less CPU taken from the forwards on a small host")
    parser.add_argument("--backend", default="specdraft", choices=BACKENDS, help=BACKEND_HELP)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "gguf", "fp32", "fp16"], help=DTYPE_HELP)
    parser.add_argument("--no-adaptive", action="store_true", help="fixed K, no fallback to plain decoding")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                        help="uvicorn's HTTP protocol (auto: httptools where installed)")
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                        help="uvicorn's event loop (auto: uvloop where installed)")


def loader(args: argparse.Namespace, name: str):
    """Builds the engine when called (in the server's background thread, so /health answers meanwhile)."""

    def load():
        from specdraft.api import LLM
        from specdraft.server.app import ServedModel

        if args.config:
            llm = LLM(args.config, progress=False)
        else:
            llm = LLM(model=args.model, speculative_model=args.speculative_model,
                      num_speculative_tokens=args.num_speculative_tokens, tree=args.tree, dtype=args.dtype,
                      max_model_len=args.max_model_len, max_batch=args.max_batch, adaptive=not args.no_adaptive,
                      progress=False, backend=args.backend)
        return ServedModel(llm.engine, llm.tokenizer, name)

    return load


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.config:
        from specdraft.config import SpecConfig

        return SpecConfig.load(args.config).model
    return args.model


def cmd_serve(args: argparse.Namespace) -> int:
    from specdraft.errors import SpecdraftError
    from specdraft.server.app import create_app_lazy, make_server

    name = served_name(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = create_app_lazy(loader(args, name), name, api_key=args.api_key, stream_interval=args.stream_interval)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level, http=args.http,
                         loop=args.loop)
    state = app.state.server

    def load_failed(message: str) -> None:  # a server that can never answer should not keep running
        server.should_exit = True

    state.on_load_error = load_failed
    server.run()
    if state.load_error is not None:
        raise SpecdraftError(f"could not load the model: {state.load_error}")
    return 0
