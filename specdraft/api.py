"""The Python API, shaped like vLLM's:

    from specdraft import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", speculative_model="ngram", num_speculative_tokens=5, tree=16)
    out = llm.generate(["Tell me a story"], SamplingParams(temperature=0.7, max_tokens=200))
    print(out[0].outputs[0].text, out[0].metrics.acceptance_rate)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.config import TRANSFORMERS, SpecConfig, is_config_ref, target_dtype
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.core import Engine, GenerationResult, StreamChunk, build_engine
from specdraft.engine.metrics import SpecMetrics
from specdraft.errors import SpecdraftError
from specdraft.runtime.hf_backend import load_hf_target
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.logprobs import TokenLogprobs
from specdraft.verify.sampling import SamplingParams


@dataclass
class Logprob:
    """A token's log-probability under the target, its rank (1: the most likely) and its text (vLLM's shape)."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    # Where `SamplingParams.logprobs` asked: per generated token, {token id: Logprob} for the token chosen
    # (first) and the `logprobs` most likely ones, as vLLM returns them.
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: SpecMetrics
    result: GenerationResult
    # Where `SamplingParams.prompt_logprobs` asked: per prompt token as `CompletionOutput.logprobs`, None first.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text


Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    def __init__(
        self,
        model: str | dict[str, Any] | Path,
        speculative_model: str | None = None,
        num_speculative_tokens: int = 5,
        tree: int = 0,
        dtype: str = "auto",
        device: str | None = None,
        max_model_len: int = 4096,
        max_batch: int = 1,
        adaptive: bool = True,
        min_acceptance: float = 0.4,
        drafter_options: dict[str, Any] | None = None,
        progress: bool = True,
        backend: str = "specdraft",
    ) -> None:
        """`model` is a model reference (catalog name, HF directory, .gguf file) or a JSON config (path or
        dict, see `SpecConfig`); explicit arguments are used when no config is given. `max_batch` requests
        run at once (one KV-cache slot each): `generate` and `chat` with several prompts batch them. `tree`:
        up to this many draft tokens per round as a token tree, `num_speculative_tokens` deep (0: chains;
        adaptive engines choose chain or tree per round by measured speed). `backend="transformers"` runs the
        target as transformers' `AutoModelForCausalLM` (any architecture it knows; fp32 by default) under the
        same engine, drafters and verifier, with n-gram, suffix and draft-model drafters."""
        if isinstance(model, dict) or isinstance(model, Path) or is_config_ref(str(model)):
            cfg = SpecConfig.load(model)
        else:
            cfg = SpecConfig(model=model, speculative_model=speculative_model,
                             num_speculative_tokens=num_speculative_tokens, tree=tree, dtype=dtype, device=device,
                             max_model_len=max_model_len, max_batch=max_batch, adaptive=adaptive,
                             min_acceptance=min_acceptance, drafter_options=dict(drafter_options or {}),
                             backend=backend)
        self.config = cfg
        if cfg.backend == TRANSFORMERS:
            self.target = load_hf_target(cfg.model, cfg.dtype, cfg.device, progress)
        else:
            self.target = load_model(cfg.model, dtype=target_dtype(cfg.dtype, cfg.speculative_model),
                                     device=cfg.device, progress=progress)
        self.tokenizer = load_tokenizer(cfg.model, progress=progress)
        self.engine: Engine = build_engine(
            self.target, self.tokenizer, cfg.speculative_model, cfg.num_speculative_tokens,
            AdaptiveConfig(enabled=cfg.adaptive, min_acceptance=cfg.min_acceptance), cfg.max_model_len,
            cfg.max_batch, cfg.drafter_options, cfg.tree)

    @property
    def drafter(self):
        return self.engine.drafter

    @property
    def metrics(self) -> SpecMetrics:
        """Cumulative metrics over every request served so far."""
        return self.engine.totals

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Strings or token-id lists; one `RequestOutput` per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise SpecdraftError("generate needs at least one prompt")
        encoded = [self.tokenizer.prompt_ids(p) for p in prompts]
        return self._run([p if isinstance(p, str) else None for p in prompts], encoded, sampling_params)

    def chat(self, messages: Messages | list[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or any(not c for c in conversations):
            raise SpecdraftError("chat needs at least one message")
        encoded = [self.tokenizer.prompt_ids(c) for c in conversations]
        return self._run([None] * len(encoded), encoded, sampling_params)

    def stream(self, prompt: Prompt | Messages, sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[StreamChunk]:
        """Text deltas as they are produced; the last chunk carries the full `GenerationResult`."""
        return self.engine.stream(self.tokenizer.prompt_ids(prompt, chat=chat), sampling_params or SamplingParams())

    def _run(self, prompts: list[str | None], encoded: list[list[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[RequestOutput]:
        params = self._params_list(sampling_params, len(encoded))
        results = self.engine.generate_many(encoded, params)
        return [RequestOutput(prompt, ids, [CompletionOutput(0, r.text, r.token_ids, r.finish_reason,
                                                             self._logprob_dicts(r.logprobs))], r.metrics, r,
                              self._logprob_dicts(r.prompt_logprobs))
                for prompt, ids, r in zip(prompts, encoded, results)]

    def _logprob_dicts(self, logprobs: Sequence[TokenLogprobs | None] | None) -> list[dict[int, Logprob] | None] | None:
        """vLLM's shape: per position {token id: Logprob}, the token itself first, then its most likely ones."""
        if logprobs is None:
            return None
        out: list[dict[int, Logprob] | None] = []
        for position in logprobs:
            if position is None:  # a prompt's first token
                out.append(None)
                continue
            out.append({token: Logprob(logprob, rank, self.tokenizer.token_piece(token))
                        for token, logprob, rank in position.ranked()})
        return out

    @staticmethod
    def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise SpecdraftError(f"{len(params)} sampling params for {n} prompts")
        return params
