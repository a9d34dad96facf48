"""Other engines on the same weights, run as extra methods in `specdraft bench`.

- `hf`: transformers `generate` on the converted checkpoint (`resolve(model)`), bf16 and fp32, plain and with
  prompt-lookup decoding (`prompt_lookup_num_tokens=10`): methods `hf-bf16`, `hf-bf16-pld`, `hf-fp32`,
  `hf-fp32-pld`. `hf-bf16` / `hf-fp32` alone select one dtype.
- `llamacpp`: llama-cpp-python on the GGUF file itself (its own quantized weights), plain and with its
  prompt-lookup draft (`LlamaPromptLookupDecoding`): methods `llamacpp`, `llamacpp-pld`.

A peer that cannot run (library not installed, no GGUF for the model) is skipped with a printed reason; the
benchmark goes on without it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdraft.runtime.tokenizer import Tokenizer
from specdraft.verify.sampling import SamplingParams

PLD_TOKENS = 10
PEER_NAMES = ("hf", "hf-bf16", "hf-fp32", "llamacpp")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _FirstTokenTimer:
    """A transformers streamer that only notes when the first generated token arrives (the first `put`
    is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFMethod:
    kind = "peer"

    def __init__(self, name: str, model, tokenizer: Tokenizer, pld_tokens: int | None, baseline: str) -> None:
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.pld_tokens = pld_tokens
        self.baseline = baseline
        self.eos = sorted(tokenizer.eos_token_ids)

    def run(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict:
        ids = torch.tensor([list(prompt_ids)])
        kwargs: dict = dict(max_new_tokens=params.max_tokens, attention_mask=torch.ones_like(ids))
        if self.eos and not params.ignore_eos:
            kwargs.update(eos_token_id=self.eos, pad_token_id=self.eos[0])
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else None,
                          min_p=params.min_p if params.min_p > 0 else None)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if self.pld_tokens:
            kwargs["prompt_lookup_num_tokens"] = self.pld_tokens
        timer = _FirstTokenTimer()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, streamer=timer, **kwargs)
        wall = time.perf_counter() - t0
        tokens = out[0, ids.shape[1]:].tolist()
        return {
            "token_ids": tokens, "text": self.tokenizer.decode(tokens), "tokens": len(tokens), "time_s": wall,
            "ttft_s": timer.first_token_at - t0 if timer.first_token_at is not None else None,
            "finish_reason": "stop" if tokens and tokens[-1] in self.eos else "length",
        }


class LlamaCppMethod:
    kind = "peer"

    def __init__(self, name: str, llm, tokenizer: Tokenizer, baseline: str) -> None:
        self.name = name
        self.llm = llm
        self.tokenizer = tokenizer
        self.baseline = baseline
        self.eos = set(tokenizer.eos_token_ids)

    def run(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict:
        llm = self.llm
        llm.reset()  # no prefix reuse across requests: every method starts from an empty cache
        if params.seed is not None and hasattr(llm, "set_seed"):
            llm.set_seed(params.seed)
        tokens: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        gen = llm.generate(list(prompt_ids), temp=params.temperature, top_k=max(params.top_k, 0),
                           top_p=params.top_p, min_p=params.min_p, repeat_penalty=1.0, reset=True)
        finish = "length"
        try:
            for token in gen:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.append(int(token))
                if int(token) in self.eos and not params.ignore_eos:
                    finish = "stop"
                    break
                if len(tokens) >= params.max_tokens:
                    break
        finally:
            gen.close()
        wall = time.perf_counter() - t0
        return {"token_ids": tokens, "text": self.tokenizer.decode(tokens), "tokens": len(tokens),
                "time_s": wall, "ttft_s": ttft, "finish_reason": finish}


def parse_peers(spec: str | None) -> list[str]:
    """`hf,llamacpp` -> ['hf-bf16', 'hf-fp32', 'llamacpp']; unknown names are an error."""
    from specdraft.runtime.errors import SpecdraftError

    out: list[str] = []
    for name in (s.strip() for s in (spec or "").split(",")):
        if not name:
            continue
        if name not in PEER_NAMES:
            raise SpecdraftError(f"unknown peer {name!r}; choose from {', '.join(PEER_NAMES)}")
        for expanded in (["hf-bf16", "hf-fp32"] if name == "hf" else [name]):
            if expanded not in out:
                out.append(expanded)
    return out


def load_hf(model_ref: str, dtype_name: str, tokenizer: Tokenizer) -> list[HFMethod]:
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise PeerUnavailable(f"transformers is not importable ({exc})") from exc
    from specdraft.runtime.loader import resolve

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(resolve(model_ref, progress=False), dtype=dtype).eval()
    except Exception as exc:  # transformers raises many kinds for architectures it cannot load
        raise PeerUnavailable(f"transformers could not load {model_ref}: {type(exc).__name__}: {exc}") \
            from exc
    finally:
        hf_logging.enable_progress_bar()
    # The converted checkpoint may carry sampling defaults (top_k=50...): the bench passes every setting.
    model.generation_config.top_k = None
    model.generation_config.top_p = None
    model.generation_config.temperature = None
    base = f"hf-{dtype_name}"
    return [HFMethod(base, model, tokenizer, None, base),
            HFMethod(f"{base}-pld", model, tokenizer, PLD_TOKENS, base)]


def gguf_path(model_ref: str) -> Path:
    from specdraft.runtime.loader import CATALOG

    if model_ref in CATALOG:
        return CATALOG[model_ref].locate()
    path = Path(model_ref).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise PeerUnavailable(f"{model_ref} is not a GGUF model (llama.cpp needs a catalog model or a .gguf "
                          "file)")


def load_llamacpp(model_ref: str, tokenizer: Tokenizer, max_len: int) -> list[LlamaCppMethod]:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        raise PeerUnavailable(f"llama-cpp-python is not installed (pip install llama-cpp-python): {exc}") \
            from exc
    path = gguf_path(model_ref)
    threads = torch.get_num_threads()
    common = dict(model_path=str(path), n_ctx=max_len, n_threads=threads, n_threads_batch=threads,
                  verbose=False, seed=0)
    try:
        plain = Llama(**common)
        pld = Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=PLD_TOKENS))
    except Exception as exc:  # llama.cpp reports a bad or unsupported file as ValueError / RuntimeError
        raise PeerUnavailable(f"llama.cpp could not load {path}: {type(exc).__name__}: {exc}") from exc
    return [LlamaCppMethod("llamacpp", plain, tokenizer, "llamacpp"),
            LlamaCppMethod("llamacpp-pld", pld, tokenizer, "llamacpp")]


class PeerUnavailable(Exception):
    """A peer that cannot run here; the benchmark skips it."""


def load_peers(names: Sequence[str], model_ref: str, tokenizer: Tokenizer, max_len: int,
               log: Callable[[str], None] = _stderr) -> tuple[list, list[dict]]:
    """Build the peers' methods. Returns (methods, skipped) where skipped is [{"peer", "reason"}]."""
    methods: list = []
    skipped: list[dict] = []
    for name in names:
        try:
            if name.startswith("hf-"):
                methods += load_hf(model_ref, name.removeprefix("hf-"), tokenizer)
            elif name == "llamacpp":
                methods += load_llamacpp(model_ref, tokenizer, max_len)
            else:
                raise PeerUnavailable(f"unknown peer {name!r}")
        except PeerUnavailable as exc:
            skipped.append({"peer": name, "reason": str(exc)})
            log(f"peer {name} skipped: {exc}")
    return methods, skipped
