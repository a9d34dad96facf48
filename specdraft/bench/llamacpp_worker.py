"""The llama.cpp peer of `specdraft bench`, in a process of its own.

llama.cpp runs native code (and its own OpenMP threads) that can crash the whole process: llama-cpp-python
0.3.36 on a CPU with AMX dies with SIGSEGV in its first batched forward (see `probe`). So the bench never
loads llama.cpp itself: it starts this module as a subprocess and talks to it in JSON lines, and a worker
that dies only costs the bench its llama.cpp figures.

Run as `python specdraft/bench/llamacpp_worker.py` (or `python -m specdraft.bench.llamacpp_worker`). It
uses only the standard library and llama_cpp (no torch, no specdraft import), so it starts fast.

Protocol: one JSON object per line on stdin, one reply per request on stdout (the worker moves its own
stdout, fd 1, to stderr first, so nothing that llama.cpp prints can corrupt the replies).

    -> {"cmd": "load", "config": {"model_path": str, "n_ctx": int, "n_threads": int, "pld_tokens": int,
                                  "extra_bufts": bool|null (null: llama.cpp's default)}}
    <- {"ok": true, "methods": ["llamacpp", "llamacpp-pld"], "info": {...}}
    -> {"cmd": "run", "method": str, "prompt_ids": [int], "eos": [int],
        "params": {"temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "ignore_eos"}}
    <- {"ok": true, "token_ids": [int], "time_s": float, "ttft_s": float|null, "finish_reason": str}
    -> {"cmd": "exit"}                      (or end of stdin: the worker exits)

A request that fails with a Python exception gets {"ok": false, "error": str, "kind": "import"|"error"}.
Times are measured here, around generation only: the IPC is not in them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import IO

PROTOCOL_VERSION = 1
# Tokens evaluated in one batch right after loading: llama.cpp's batched matmul kernels (AMX tiles, repacked
# weights) only run for batches of 2+ tokens, and that is where a broken build crashes.
PROBE_TEXT = b"The quick brown fox jumps over the lazy dog. Then it runs away into the forest."


class LlamaBackend:
    """The two methods of the peer: llama.cpp plain (`llamacpp`) and with its prompt-lookup draft
    (`llamacpp-pld`), each a `Llama` on the same GGUF file."""

    def __init__(self, config: dict) -> None:
        import llama_cpp.llama_cpp as llama_c
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        extra = config.get("extra_bufts")
        if extra is not None:
            _set_extra_bufts(llama_c, bool(extra))
        threads = int(config["n_threads"])
        common = dict(model_path=str(config["model_path"]), n_ctx=int(config["n_ctx"]), n_threads=threads,
                      n_threads_batch=threads, verbose=False, seed=0)
        pld = LlamaPromptLookupDecoding(num_pred_tokens=int(config["pld_tokens"]))
        # logits_all=True for the draft model's Llama: llama-cpp-python 0.3.36 evaluates it with all logits but
        # sizes its score buffer from the argument (n_batch rows), so prompts over 512 tokens fail with
        # "could not broadcast input array ... into shape (0,)".
        self.models = {"llamacpp": Llama(**common),
                       "llamacpp-pld": Llama(**common, draft_model=pld, logits_all=True)}
        self.info = {"extra_bufts": bool(self.models["llamacpp"].model_params.use_extra_bufts)
                     if hasattr(self.models["llamacpp"].model_params, "use_extra_bufts") else None,
                     "n_threads": threads, "pid": os.getpid()}
        if config.get("probe", True):
            self.probe()

    def probe(self) -> None:
        for llm in self.models.values():
            llm.reset()
            llm.eval(llm.tokenize(PROBE_TEXT))
            llm.reset()

    def run(self, method: str, prompt_ids: list[int], params: dict, eos: list[int]) -> dict:
        llm = self.models[method]
        llm.reset()  # no prefix reuse across requests: every method starts from an empty cache
        if params.get("seed") is not None:
            llm.set_seed(int(params["seed"]))
        eos_ids = set(eos)
        max_tokens = int(params["max_tokens"])
        ignore_eos = bool(params.get("ignore_eos"))
        tokens: list[int] = []
        ttft = None
        finish = "length"
        t0 = time.perf_counter()
        gen = llm.generate(list(prompt_ids), temp=float(params["temperature"]),
                           top_k=max(int(params["top_k"]), 0), top_p=float(params["top_p"]),
                           min_p=float(params["min_p"]), repeat_penalty=1.0, reset=True)
        try:
            for token in gen:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.append(int(token))
                if int(token) in eos_ids and not ignore_eos:
                    finish = "stop"
                    break
                if len(tokens) >= max_tokens:
                    break
        finally:
            gen.close()
        wall = time.perf_counter() - t0
        return {"token_ids": tokens, "time_s": wall, "ttft_s": ttft, "finish_reason": finish}


def _set_extra_bufts(llama_c, enabled: bool) -> None:
    """Make `Llama` load models with `use_extra_bufts=enabled` (llama-cpp-python has no argument for it)."""
    default = llama_c.llama_model_default_params
    if not hasattr(default(), "use_extra_bufts"):
        raise RuntimeError("this llama-cpp-python has no use_extra_bufts model parameter")

    def params():
        p = default()
        p.use_extra_bufts = enabled
        return p

    llama_c.llama_model_default_params = params


def serve(make_backend: Callable[[dict], object], inp: IO[str], out: IO[str]) -> int:
    """Answer requests from `inp` on `out` until `exit` or end of input."""
    backend = None

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "exit":
                break
            if cmd == "load":
                backend = make_backend(req["config"])
                reply({"ok": True, "protocol": PROTOCOL_VERSION, "methods": sorted(backend.models),
                       "info": getattr(backend, "info", {})})
            elif cmd == "run":
                if backend is None:
                    raise RuntimeError("run before load")
                result = backend.run(req["method"], req["prompt_ids"], req["params"], req.get("eos", []))
                reply({"ok": True, **result})
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except ImportError as exc:
            reply({"ok": False, "kind": "import", "error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # reported to the bench, which gives up on the peer
            traceback.print_exc(file=sys.stderr)
            reply({"ok": False, "kind": "error", "error": f"{type(exc).__name__}: {exc}"})
    return 0


def protocol_streams() -> tuple[IO[str], IO[str]]:
    """(requests, replies): stdin, and the original stdout; fd 1 and sys.stdout then go to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return sys.stdin, replies


def main(make_backend: Callable[[dict], object] = LlamaBackend) -> int:
    import faulthandler

    faulthandler.enable()  # a native crash leaves the Python stack on stderr, which the bench shows
    inp, out = protocol_streams()
    return serve(make_backend, inp, out)


if __name__ == "__main__":
    sys.exit(main())
