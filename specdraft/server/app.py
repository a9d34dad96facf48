"""The FastAPI app: OpenAI's `/v1/models`, `/v1/completions` and `/v1/chat/completions`, plus `/health` and
`/metrics`.

`create_app(engine, tokenizer, model_name)` serves an engine that is already built (the tests, or
`LLM(...).engine`); `create_app_lazy(load, model_name)` starts answering at once and loads in the
background, with `/health` at 503 until the model is ready (what a load balancer or `docker` health check
wants). Either way one `EngineWorker` thread owns the engine; handlers only submit tickets and read events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdraft.engine.core import Engine, GenerationResult
from specdraft.engine.metrics import acceptance_rate, mean_accepted_length
from specdraft.errors import SpecdraftError
from specdraft.server.metrics import ServerMetrics
from specdraft.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    parse_body,
    sampling_params,
)
from specdraft.server.worker import EngineWorker, Event, Ticket
from specdraft.verify.logprobs import TokenLogprobs

log = logging.getLogger("specdraft.server")
T = TypeVar("T")
ENGINE_CALL_TIMEOUT_S = 60.0  # a round takes milliseconds; a stuck engine thread must not hang the request
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there


@dataclass
class ServedModel:
    engine: Engine
    tokenizer: Any
    name: str


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class ServerState:
    """What the handlers share: the worker once the model is loaded, the metrics, the key."""

    def __init__(self, model_name: str, api_key: str | None, stream_interval: int = 1) -> None:
        self.model_name = model_name
        self.api_key = api_key
        self.stream_interval = stream_interval
        self.metrics = ServerMetrics(model_name)
        self.worker: EngineWorker | None = None
        self.load_error: str | None = None
        self.on_load_error: Callable[[str], None] | None = None
        self.closing = False
        self.created = int(time.time())
        self._lock = threading.Lock()  # a background load finishing as shutdown begins must not start a worker

    def ready_worker(self) -> EngineWorker:
        if self.worker is None:
            detail = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, detail, "server_error", code="model_not_ready")
        return self.worker

    def start(self, model: ServedModel) -> None:
        with self._lock:
            if self.closing:
                return
            worker = EngineWorker(model.engine, model.tokenizer, self.metrics, self.stream_interval)
            worker.start()
            self.worker = worker

    def stop(self) -> None:
        """End every request in flight (each gets a 503 error, streams an error event) and the engine thread."""
        with self._lock:
            self.closing = True
            worker = self.worker
        if worker is not None:
            worker.stop()


def create_app(engine: Engine, tokenizer: Any, model_name: str, api_key: str | None = None,
               stream_interval: int = 1) -> FastAPI:
    """An app serving an engine that is already built (it must not be used elsewhere while served).
    `stream_interval`: streams hear of their tokens that many at a time (`EngineWorker`)."""
    return _build_app(ServerState(model_name, api_key, stream_interval),
                      lambda: ServedModel(engine, tokenizer, model_name), background=False)


def create_app_lazy(load: Callable[[], ServedModel], model_name: str, api_key: str | None = None,
                    stream_interval: int = 1) -> FastAPI:
    """An app that answers at once and loads the model in a background thread (`/health` 503 until then)."""
    return _build_app(ServerState(model_name, api_key, stream_interval), load, background=True)


def _build_app(state: ServerState, load: Callable[[], ServedModel], background: bool) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if background:
            threading.Thread(target=_load_in_background, args=(state, load), name="specdraft-load",
                             daemon=True).start()
        else:
            state.start(load())
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="specdraft", lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _load_in_background(state: ServerState, load: Callable[[], ServedModel]) -> None:
    try:
        state.start(load())
        log.info("model %s loaded", state.model_name)
    except Exception as exc:  # reported by /health and every request, instead of a dead thread
        if isinstance(exc, SpecdraftError):  # a user error (a bad path, say): its message says it all
            log.error("model load failed: %s", exc)
        else:
            log.exception("model load failed")
        state.load_error = str(exc) or type(exc).__name__
        if state.on_load_error is not None:
            state.on_load_error(state.load_error)


class Server(uvicorn.Server):
    """uvicorn's server, ending the requests in flight as soon as shutdown begins.

    uvicorn waits for open connections (up to `timeout_graceful_shutdown`) before the app's lifespan ends,
    so a stream of thousands of tokens would hold shutdown up and then be cut off mid-chunk. Stopping the
    engine thread first ends each one properly: an error event and `[DONE]`, or a 503."""

    def __init__(self, app: FastAPI, **config: Any) -> None:
        super().__init__(uvicorn.Config(app, **config))
        self.state: ServerState = app.state.server

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.stop()
        await super().shutdown(sockets)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                timeout_graceful_shutdown: int = 5, http: str = "auto", loop: str = "auto") -> Server:
    """The uvicorn server for `app` (bound to localhost unless told otherwise); `http` and `loop` are uvicorn's
    own choices."""
    return Server(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=timeout_graceful_shutdown,
                  http=http, loop=loop)


@contextmanager
def serve_in_thread(app: FastAPI, log_level: str = "warning", timeout_graceful_shutdown: int = 2, http: str = "auto",
                    loop: str = "auto") -> Iterator[str]:
    """`app` on a free loopback port in a background thread, lifespan included (tests, `bench-serve`);
    yields the base URL and shuts the server down on exit. `http`, `loop`: as `make_server`."""
    # proto=IPPROTO_TCP, as uvicorn's own binding has it: asyncio sets TCP_NODELAY on accepted connections only
    # then, and without it Nagle + delayed ACKs add 40 ms to every response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = Server(app, log_level=log_level, timeout_graceful_shutdown=timeout_graceful_shutdown, http=http,
                    loop=loop)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specdraft-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout_graceful_shutdown + 10)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the server did not stop")


# ------------------------------------------------------------------------------------------ errors


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in errors[:3])
        return _error_response(bad_request(detail or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}", "server_error"))


def _check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       "not_found_error", "model", "model_not_found")


# ------------------------------------------------------------------------------------------ routes


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.worker is None:
            return JSONResponse({"status": "loading" if state.load_error is None else "failed",
                                 "error": state.load_error}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        """vLLM's endpoint of this name: later prompts reuse no cache entries of earlier ones (benchmarks)."""
        _check_key(state, request)
        await _on_engine_thread(state, lambda worker: worker.engine.restore_prefixes({}), "the reset")
        return JSONResponse({"status": "ok"})

    # vLLM's tokenizer endpoints (lm-evaluation-harness finds and uses them instead of downloading the
    # tokenizer): the engine thread's tokenizer, used on that thread (see worker.py).
    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        _check_key(state, request)
        body = parse_body(await request.body(), TokenizeRequest)
        _check_model(state, body.model)
        ids = await _on_engine_thread(state, lambda worker: body.token_ids(worker.tokenizer), "the tokenizer",
                                      "prompt" if body.messages is None else "messages")
        return JSONResponse({"count": len(ids), "max_model_len": state.ready_worker().engine.max_model_len,
                             "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        _check_key(state, request)
        body = parse_body(await request.body(), DetokenizeRequest)
        _check_model(state, body.model)
        text = await _on_engine_thread(state, lambda worker: body.text(worker.tokenizer), "the tokenizer")
        return JSONResponse({"prompt": text})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> JSONResponse:
        _check_key(state, request)
        worker = state.ready_worker()
        return JSONResponse({**worker.tokenizer.info(), "model_max_length": worker.engine.max_model_len})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_key(state, request)
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specdraft"}
        if state.worker is not None:
            card["max_model_len"] = state.worker.engine.max_model_len  # set at build time, read-only since
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_key(state, request)
        body = parse_body(await request.body(), CompletionRequest)
        _check_model(state, body.model)
        return await _generate(state, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_key(state, request)
        body = parse_body(await request.body(), ChatCompletionRequest)
        _check_model(state, body.model)
        return await _generate(state, request, body, chat=True)


async def _on_engine_thread(state: ServerState, fn: Callable[[EngineWorker], T], what: str,
                            param: str | None = None) -> T:
    """`fn(worker)` on the engine thread, between two rounds (a round away at most); a `SpecdraftError` it
    raises is the request's 400 (about `param`)."""
    worker = state.ready_worker()
    try:
        return await asyncio.wait_for(worker.call(lambda: fn(worker), asyncio.get_running_loop()),
                                      ENGINE_CALL_TIMEOUT_S)
    except TimeoutError:
        raise APIError(503, f"the engine did not get to {what}", "server_error") from None
    except SpecdraftError as exc:
        raise bad_request(str(exc), param) from None


async def _generate(state: ServerState, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    chat: bool) -> Response:
    """A chat or completions request: a ticket per prompt (a completions batch has several; each its own
    request to the engine, batched with everyone else's), one response with a choice per prompt."""
    worker = state.ready_worker()
    params = sampling_params(body, default_max_tokens=None)
    prompts = [body.prompt()] if chat else body.prompt_inputs()
    loop = asyncio.get_running_loop()
    tickets = [Ticket(prompt=prompt, chat=chat, params=params, loop=loop,
                      max_tokens_default=body.token_budget() is None, stream=bool(body.stream)) for prompt in prompts]
    watch = DisconnectWatch(request)

    def cancel_all() -> None:
        for ticket in tickets:
            worker.cancel(ticket)

    try:
        for ticket in tickets:
            worker.submit(ticket)
        replies: list[Reply] = []
        for index, (ticket, prompt) in enumerate(zip(tickets, prompts)):
            first = await _next_event(ticket, watch)
            if first.kind == "error":
                raise _for_prompt(first.error, index, len(prompts))
            echo = None
            if not chat and body.echo:  # the prompt as given, or the text its token ids spell
                echo = prompt if isinstance(prompt, str) else worker.tokenizer.decode(first.token_ids)
            replies.append(Reply(state.model_name, chat, first.token_ids, worker.tokenizer.token_piece, echo,
                                 index=index, id=replies[0].id if replies else ""))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = ChoiceEvents(tickets)
            stream = _sse(events, replies, include_usage)

            def close() -> None:
                events.close()
                cancel_all()
            return CancellingStream(stream, on_close=close)
        results = [await _collect(ticket, watch) for ticket in tickets]
    except ClientGone:
        cancel_all()
        return Response(status_code=499)
    except BaseException:
        cancel_all()
        raise
    return JSONResponse(_response(replies, results))


def _for_prompt(error: APIError, index: int, prompts: int) -> APIError:
    """A batch's error says which of its prompts it is about."""
    if prompts == 1:
        return error
    return APIError(error.status, f"prompt {index}: {error.message}", error.type, error.param, error.code)


class ChoiceEvents:
    """The events of a request's tickets as (choice index, event), in the order they come. One ticket's are
    read straight from its queue (the one event per streamed token stays a single await); a batch's are
    forwarded into one queue by a task per ticket, which `close` cancels."""

    def __init__(self, tickets: list[Ticket]) -> None:
        self.count = len(tickets)
        self._single = tickets[0] if len(tickets) == 1 else None
        self._merged: asyncio.Queue[tuple[int, Event]] | None = None if self._single else asyncio.Queue()
        self._tasks = [] if self._single else [asyncio.create_task(self._forward(i, t)) for i, t in enumerate(tickets)]

    async def _forward(self, index: int, ticket: Ticket) -> None:
        while True:
            event = await ticket.events.get()
            self._merged.put_nowait((index, event))
            if event.final:
                return

    async def next(self) -> tuple[int, Event]:
        if self._single is not None:
            return 0, await self._single.events.get()
        return await self._merged.get()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


class DisconnectWatch:
    """Asks, at most every DISCONNECT_POLL_S, whether the client is still there: a non-streaming request has
    nothing to write until it is done, so this is how it notices a client that gave up."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.checked = time.monotonic()

    async def check(self) -> None:
        now = time.monotonic()
        if now - self.checked >= DISCONNECT_POLL_S:
            self.checked = now
            if await self.request.is_disconnected():
                raise ClientGone


async def _next_event(ticket: Ticket, watch: DisconnectWatch) -> Event:
    """The ticket's next event, checking now and then (also while events keep coming) that the client is
    still connected."""
    while True:
        try:
            event = await asyncio.wait_for(ticket.events.get(), timeout=DISCONNECT_POLL_S)
        except TimeoutError:
            await watch.check()
            continue
        if not event.final:
            await watch.check()
        return event


async def _collect(ticket: Ticket, watch: DisconnectWatch) -> GenerationResult:
    while True:
        event = await _next_event(ticket, watch)
        if event.kind == "error":
            raise event.error
        if event.result is not None:
            return event.result


class CancellingStream(StreamingResponse):
    """A streaming response that calls `on_close` however it ends: finished, failed, or cancelled because
    the client went away (Starlette cancels the body iterator on disconnect, which a generator's own
    `finally` would only see when it is garbage-collected)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ------------------------------------------------------------------------------------------ response bodies


@dataclass
class Reply:
    """Builds OpenAI's response objects for one request (chat or text completion); `piece` gives a token's
    text on its own (its logprobs' `token`); `echo`: the prompt's text, put before the completion's."""

    model: str
    chat: bool
    prompt_ids: list[int]
    piece: Callable[[int], str]
    echo: str | None = None
    index: int = 0  # the choice's place (a completions batch: its prompt's place in the list)
    id: str = ""  # the response's id, shared by its choices (new where empty)

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._text_events: dict[bool, tuple[str, str]] = {}
        self._text_offset = 0  # characters of completion text before the next token's (completions' logprobs)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def logprobs(self, logprobs: list[TokenLogprobs] | None,
                 prompt: list[TokenLogprobs | None] | None = None) -> dict[str, Any] | None:
        """A choice's `logprobs` for these tokens (the next ones of the request), after the `prompt`'s where
        given (an echo): chat's `content` list, or the completions API's parallel lists with each token's
        character offset in the text (a prompt's first token has no logprob: null, as OpenAI's). Called for
        a request's tokens in order (the offsets run on from one call to the next)."""
        if logprobs is None and prompt is None:
            return None
        if self.chat:
            return {"content": [{**self._token(p.token_id, p.logprob),
                                 "top_logprobs": [self._token(token, value) for token, value in p.top]}
                                for p in logprobs or ()], "refusal": None}
        pairs = [*zip(self.prompt_ids, prompt or (), strict=prompt is not None),
                 *((p.token_id, p) for p in logprobs or ())]
        tokens, values, tops, offsets = [], [], [], []
        for token_id, p in pairs:
            piece = self.piece(token_id)
            tokens.append(piece)
            offsets.append(self._text_offset)
            self._text_offset += len(piece)
            if p is None:  # a prompt's first token: nothing before it to predict it
                values.append(None)
                tops.append(None)
                continue
            top: dict[str, float] = {}  # by text: where two ids give one piece, the first listed stays
            for token, value, _ in p.ranked():
                top.setdefault(self.piece(token), _finite(value))
            values.append(_finite(p.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        piece = self.piece(token_id)
        return {"token": piece, "logprob": _finite(logprob), "bytes": list(piece.encode("utf-8"))}

    def choice(self, result: GenerationResult) -> dict[str, Any]:
        """The choice of a response that is not streamed."""
        echoed = self.echo is not None
        logprobs = self.logprobs(result.logprobs, result.prompt_logprobs if echoed else None)
        if self.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": result.text},
                    "logprobs": logprobs, "finish_reason": result.finish_reason}
        return {"index": self.index, "text": (self.echo or "") + result.text, "logprobs": logprobs,
                "finish_reason": result.finish_reason}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              usage: dict[str, Any] | None = None, with_usage: bool = False,
              logprobs: list[TokenLogprobs] | None = None,
              prompt_logprobs: list[TokenLogprobs | None] | None = None) -> dict[str, Any]:
        lp = self.logprobs(logprobs, prompt_logprobs)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choices = [{"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]
        else:
            choices = [{"index": self.index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}]
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [] if usage is not None else choices}
        if with_usage:
            out["usage"] = usage
        return out

    def text_event(self, text: str, with_usage: bool) -> str:
        """`_sse_line(self.chunk(text, with_usage=with_usage))` for a round's (non-empty) `text`, the same
        characters, from the event around a marker serialized once per stream: it is the one event sent per
        token, and its text the only part that changes (0.3 against 3.8 us of CPU, warm)."""
        if with_usage not in self._text_events:
            head, tail = _sse_line(self.chunk(_TEXT_MARKER, with_usage=with_usage)).split(json.dumps(_TEXT_MARKER))
            self._text_events[with_usage] = head, tail
        head, tail = self._text_events[with_usage]
        return head + json.dumps(text) + tail


def usage(replies: list[Reply], results: list[GenerationResult]) -> dict[str, Any]:
    """OpenAI's token counts over a response's choices (the prompts' cached tokens: those whose cache entries
    were copied from an earlier prompt; the prediction's draft tokens that verification accepted and rejected,
    which the target scored either way), plus their speculation: acceptance rate (null when nothing was
    drafted) and mean accepted length (tokens per target decode forward, bonus token included)."""
    prompt = sum(reply.prompt_tokens for reply in replies)
    completion = sum(len(result.token_ids) for result in results)
    metrics = [result.metrics for result in results]
    predicted = sum(m.prediction_drafted for m in metrics)
    accepted = sum(m.prediction_accepted for m in metrics)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m.prompt_tokens_cached for m in metrics)},
            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": predicted - accepted},
            "acceptance_rate": acceptance_rate(sum(m.accepted for m in metrics), sum(m.drafted for m in metrics)),
            "mean_accepted_length": mean_accepted_length(sum(m.produced_tokens for m in metrics),
                                                         sum(m.target_forwards for m in metrics))}


def _response(replies: list[Reply], results: list[GenerationResult]) -> dict[str, Any]:
    """The whole response of a request that is not streamed: a choice per prompt, in their order."""
    first = replies[0]
    return {"id": first.id, "object": "chat.completion" if first.chat else "text_completion",
            "created": first.created, "model": first.model,
            "choices": [reply.choice(result) for reply, result in zip(replies, results, strict=True)],
            "usage": usage(replies, results)}


_TEXT_MARKER = "\0specdraft-text\0"  # stands for a chunk's text in `Reply.text_event` (escaped as \u0000 in JSON)
LOWEST_LOGPROB = -9999.0  # what a log-probability of -inf is reported as (JSON has no infinity; vLLM's value)


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def _sse_line(data: dict[str, Any] | str) -> str:
    """One SSE event. JSON with ASCII escapes: raw U+0085 or U+2028 in the text would be a line break to
    some clients' line splitters (httpx's among them), cutting the event in two."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _sse(events: ChoiceEvents, replies: list[Reply], include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: the role (chat), each round's text, each choice's finish reason, the usage when
    asked (once every choice is done), then `[DONE]`. An error after the stream started arrives as an `error`
    event (the status is already sent) and ends the stream."""
    if replies[0].chat:
        yield _sse_line(replies[0].chunk(None, role=True, with_usage=include_usage))
    echoes = [reply.echo for reply in replies]
    results: dict[int, GenerationResult] = {}
    while len(results) < events.count:
        index, event = await events.next()
        if event.kind == "error":
            yield _sse_line(_for_prompt(event.error, index, events.count).body())
            break
        reply = replies[index]
        if echoes[index] is not None:  # the prompt first, with its logprobs (they come with the first token's round)
            yield _sse_line(reply.chunk(echoes[index], prompt_logprobs=event.prompt_logprobs,
                                        with_usage=include_usage))
            echoes[index] = None
        if event.logprobs:  # a round's tokens with their logprobs (its text may lag behind, for stop strings)
            yield _sse_line(reply.chunk(event.text, logprobs=event.logprobs, with_usage=include_usage))
        elif event.text:
            yield reply.text_event(event.text, include_usage)
        if event.result is not None:
            yield _sse_line(reply.chunk(None, event.result.finish_reason, with_usage=include_usage))
            results[index] = event.result
    if include_usage and len(results) == events.count:
        done = [results[i] for i in range(events.count)]
        yield _sse_line(replies[0].chunk(None, usage=usage(replies, done), with_usage=True))
    yield _sse_line("[DONE]")
