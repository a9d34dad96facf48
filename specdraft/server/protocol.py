"""The OpenAI request schemas, their translation to `SamplingParams`, and errors in OpenAI's shape.

Schemas are strict (`"0.5"` is not a number, `true` is not an integer) and closed (an unknown field is an
error): a misspelt `max_token` that silently fell back to a default would be a worse bug than a 400. Fields
of OpenAI's API that this server cannot honour are accepted only at their neutral value (`n=1`, `best_of=1`,
no `suffix`, a `text` response format, no tools) and refused otherwise, with a message saying so.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdraft.errors import InvalidParameterError
from specdraft.runtime.tokenizer import check_text
from specdraft.verify.logprobs import MAX_LOGPROBS
from specdraft.verify.sampling import SamplingParams

MAX_BODY_BYTES = 8 * 1024 * 1024
# Prompts in one completions request (a batch, as lm-evaluation-harness sends with batch_size > 1): each is a
# request of its own to the engine, queued for a slot like any other; a longer list is refused.
MAX_BATCH_PROMPTS = 256
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]
    name: str | None = None

    def text(self) -> str:
        return joined(self.content)


def joined(content: str | list[TextPart]) -> str:
    """A message's (or a prediction's) content as one text: a string, or its parts' texts one after another."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class Prediction(Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (the `ngram` drafter drafts from it)."""

    type: Literal["content"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]

    def text(self) -> str:
        return joined(self.content)


class _Generation(Strict):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's top_k, min_p, repetition_penalty and ignore_eos)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=300)] | None = None  # OpenAI's limit: 300 tokens
    ignore_eos: bool = False
    prediction: Prediction | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, reason) for values this server cannot honour."""
        out = []
        if self.n != 1:
            out.append(("n", f"n={self.n} is not supported: this server returns one choice per request "
                             "(send several requests instead)"))
        if self.logit_bias and not all(key.isascii() and key.isdigit() for key in self.logit_bias):
            out.append(("logit_bias", "logit_bias keys must be token ids (strings of digits)"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed with stream=true"))
        return out


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Accepted at their neutral values only (clients that send their defaults explicitly): plain text, no tools.
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.response_format is not None and self.response_format.type != "text":
            out.append(("response_format", f"response_format {self.response_format.type!r} is not supported: "
                                           "this server generates plain text only"))
        if self.tools:
            out.append(("tools", "tools are not supported: this server does not call functions"))
        if self.tool_choice not in (None, "none", "auto"):
            out.append(("tool_choice", "tool_choice must be 'none' or 'auto' (no tools are supported)"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            out.append(("max_completion_tokens", "give max_tokens or max_completion_tokens, not both"))
        return out

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        """Alternatives to report per generated token (`SamplingParams.logprobs`; None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprob_count(self) -> int | None:
        """The same per prompt token (`SamplingParams.prompt_logprobs`): chat never reports them."""
        return None

    def prompt(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Generation):
    # A string, a list of token ids, or a batch of either (OpenAI's API): each of a batch's prompts gets a choice
    # of its own, `index` its place in the list.
    prompt: (str | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_BATCH_PROMPTS)])
    echo: bool = False  # the prompt's text before the completion's (and, with logprobs, its tokens' logprobs)
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None  # accepted at its neutral value, 1

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", f"best_of={self.best_of} is not supported: this server returns one choice per "
                                   "prompt"))
        return out

    def token_budget(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None  # echo with logprobs: the prompt's tokens get them too

    def prompt_inputs(self) -> list[str | list[int]]:
        """The request's prompts, one per choice."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]


class TokenizeRequest(Strict):
    """vLLM's `/tokenize`: a prompt's token ids, or chat messages' through the chat template (with the
    generation prompt, as a chat request reads them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True

    def unsupported(self) -> list[tuple[str, str]]:
        if (self.prompt is None) == (self.messages is None):
            return [("prompt", "give a prompt or messages, one of them")]
        return []

    def token_ids(self, tokenizer: Any) -> list[int]:
        if self.messages is not None:
            return tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in self.messages])
        check_text(self.prompt, "prompt", allow_blank=True)
        return tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens)


class DetokenizeRequest(Strict):
    """vLLM's `/detokenize`: the text of token ids, special tokens included."""

    model: str | None = None
    tokens: list[int]

    def unsupported(self) -> list[tuple[str, str]]:
        return []

    def text(self, tokenizer: Any) -> str:
        if any(not 0 <= t < tokenizer.vocab_size for t in self.tokens):
            raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
        return tokenizer.decode(self.tokens, skip_special_tokens=False)


def parse_body(raw: bytes, schema: type[Strict]) -> Any:
    """Bytes to a validated request, or a 400 that says what is wrong (never FastAPI's raw 422)."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
                          ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        # Python-mode validation of the parsed JSON (strict all the same): an escaped lone surrogate stays a
        # string here and is reported by the tokenizer's own text check, naming the character.
        request = schema.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    for param, reason in request.unsupported():
        raise bad_request(reason, param)
    return request


# Fields whose union types make pydantic's own messages (one per member tried) hard to read.
FIELD_HINTS = {
    "prompt": (f"must be a string, a non-empty list of token ids, or a list of 1 to {MAX_BATCH_PROMPTS} of "
               "either (all of one kind)"),
    "stop": "must be a string or a list of at most 16 strings",
}


def validation_error(exc: ValidationError) -> APIError:
    """The first few schema errors, each as `field.path: what is wrong`."""
    parts: list[str] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        top = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not accepted by this server)"
        elif top in FIELD_HINTS and err["type"] != "missing":
            loc, msg = top, FIELD_HINTS[top]
        else:
            msg = err["msg"]
        part = f"{loc}: {msg}" if loc else msg
        if part not in parts:
            parts.append(part)
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    param = str(first[0]) if first else None
    more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return bad_request("; ".join(parts[:3]) + more, param)


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member tried (`str`, `list[int]`) in the location: noise for a user."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or part.startswith(("list[", "function")))


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "logit_bias")


def sampling_field(message: str) -> str | None:
    """The request field an `InvalidParameterError`'s message is about (it starts with the field's name)."""
    return next((f for f in SAMPLING_FIELDS if message.startswith(f)), None)


def sampling_params(request: ChatCompletionRequest | CompletionRequest, default_max_tokens: int | None
                    ) -> SamplingParams:
    """The request's `SamplingParams` (OpenAI's defaults: temperature 1, top_p 1); `max_tokens` None is left
    to the caller, who knows the prompt's length (`default_max_tokens` stands in for it meanwhile)."""
    budget = request.token_budget()
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else request.top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            seed=request.seed, max_tokens=budget if budget is not None else (default_max_tokens or 1),
            stop=request.stop or (), ignore_eos=request.ignore_eos, logprobs=request.logprob_count(),
            prompt_logprobs=request.prompt_logprob_count(),
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            frequency_penalty=request.frequency_penalty or 0.0, presence_penalty=request.presence_penalty or 0.0,
            logit_bias={int(token): bias for token, bias in request.logit_bias.items()} if request.logit_bias else None,
            prediction=(request.prediction.text() or None) if request.prediction else None)
    except InvalidParameterError as exc:
        message = str(exc)
        param = sampling_field(message)
        if param == "max_tokens" and isinstance(request, ChatCompletionRequest) and request.max_completion_tokens:
            param, message = "max_completion_tokens", message.replace("max_tokens", "max_completion_tokens", 1)
        raise bad_request(message, param) from None
