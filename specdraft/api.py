"""The Python API, shaped like vLLM's:

    from specdraft import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", speculative_model="quant:int8", num_speculative_tokens=5)
    out = llm.generate(["Tell me a story"], SamplingParams(temperature=0.7, max_tokens=200))
    print(out[0].outputs[0].text, out[0].metrics.acceptance_rate)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.config import SpecConfig, is_config_ref
from specdraft.drafters import make_drafter
from specdraft.engine.adaptive import AdaptiveConfig
from specdraft.engine.generate import GenerationResult, SpeculativeEngine, StreamChunk
from specdraft.engine.metrics import SpecMetrics
from specdraft.runtime.errors import SpecdraftError
from specdraft.runtime.loader import load_model, load_tokenizer
from specdraft.verify.sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: SpecMetrics
    result: GenerationResult

    @property
    def text(self) -> str:
        return self.outputs[0].text


Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | dict[str, Any] | Path,
        speculative_model: str | None = None,
        num_speculative_tokens: int = 5,
        dtype: str = "bf16",
        device: str | None = None,
        max_model_len: int = 4096,
        adaptive: bool = True,
        min_acceptance: float = 0.4,
        drafter_options: dict[str, Any] | None = None,
        progress: bool = True,
    ) -> None:
        """`model` is a model reference (catalog name, HF directory, .gguf file) or a JSON config (path or
        dict, see `SpecConfig`); explicit arguments are used when no config is given."""
        if isinstance(model, dict) or isinstance(model, Path) or is_config_ref(str(model)):
            cfg = SpecConfig.load(model)
        else:
            cfg = SpecConfig(model=model, draft_model=speculative_model, speculation_length=num_speculative_tokens,
                             dtype=dtype, device=device, max_model_len=max_model_len, adaptive=adaptive,
                             min_acceptance=min_acceptance, drafter_options=dict(drafter_options or {}))
        self.config = cfg
        self.target = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, progress=progress)
        self.tokenizer = load_tokenizer(cfg.model, progress=progress)
        max_len = min(cfg.max_model_len, self.target.config.max_position_embeddings)
        self.drafter = None
        if cfg.draft_model and cfg.speculation_length > 0:
            self.drafter = make_drafter(cfg.draft_model, self.target, self.tokenizer, max_len=max_len,
                                        options=cfg.drafter_options, dtype=cfg.dtype)
        adaptive_cfg = AdaptiveConfig(enabled=cfg.adaptive, min_acceptance=cfg.min_acceptance)
        self.engine = SpeculativeEngine(self.target, self.tokenizer, self.drafter, cfg.speculation_length,
                                        adaptive_cfg, max_model_len=max_len)

    @property
    def metrics(self) -> SpecMetrics:
        """Cumulative metrics over every request served so far."""
        return self.engine.totals

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise SpecdraftError("empty prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise SpecdraftError("a prompt is a string or a list of token ids")

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        # Validate every request before running any, so a bad one cannot leave half a batch done.
        encoded = [self._prompt_ids(p) for p in prompts]
        for ids, params in zip(encoded, params_list):
            self.engine.validate(ids, params)
        return [self._run(p if isinstance(p, str) else None, ids, params)
                for p, ids, params in zip(prompts, encoded, params_list)]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or any(not c for c in conversations):
            raise SpecdraftError("chat needs at least one message")
        encoded = [self.tokenizer.apply_chat_template(c) for c in conversations]
        params_list = self._params_list(sampling_params, len(encoded))
        for ids, params in zip(encoded, params_list):
            self.engine.validate(ids, params)
        return [self._run(None, ids, params) for ids, params in zip(encoded, params_list)]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[StreamChunk]:
        """Text deltas as they are produced; the last chunk carries the full `GenerationResult`."""
        if chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            ids = self._prompt_ids(prompt)
        return self.engine.stream(ids, sampling_params or SamplingParams())

    def _run(self, prompt: str | None, ids: list[int], params: SamplingParams) -> RequestOutput:
        result = self.engine.generate(ids, params)
        completion = CompletionOutput(0, result.text, result.token_ids, result.finish_reason)
        return RequestOutput(prompt, ids, [completion], result.metrics, result)

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
