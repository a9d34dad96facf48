"""The engine thread: the one owner of the `Engine`, batching every HTTP request into its rounds.

HTTP handlers run on the asyncio loop and never touch the engine. They `submit` a `Ticket` and read its
events from an asyncio queue; the engine thread tokenizes and validates it (so a bad prompt is answered
before any streaming starts), queues it until a KV-cache slot is free, then advances all running requests
together, one `Engine.step` (one batched target forward) per round, and hands each chunk back with
`loop.call_soon_threadsafe` (a stream with a `stream_interval` of N hears of its tokens N at a time). A
client that goes away is `cancel`led: the engine thread releases its slot before the next round, so the
slot serves the next waiting request at once.

Commands reach the thread through a `queue.Queue` and are applied between rounds only, so the engine is
never used from two threads and needs no lock. So is its tokenizer's encoding: a transformers fast tokenizer
may reconfigure its Rust tokenizer for an encode (truncation, padding), which fails with "Already borrowed"
while another thread encodes; the `/tokenize` endpoints `call` the engine thread for it (decoding only reads
the tokenizer, and handlers decode for themselves).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from specdraft.engine.core import Engine, GenerationResult, Request, StreamChunk
from specdraft.errors import ContextOverflowError, InvalidParameterError, SpecdraftError
from specdraft.server.metrics import ServerMetrics, SpecSnapshot
from specdraft.server.protocol import APIError, bad_request, sampling_field
from specdraft.verify.logprobs import TokenLogprobs
from specdraft.verify.sampling import SamplingParams

log = logging.getLogger("specdraft.server")
IDLE_POLL_S = 0.05  # how often an idle engine thread looks for the stop flag
T = TypeVar("T")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="shutting_down")


@dataclass
class Event:
    """One message from the engine thread to a handler: `accepted` (prompt tokenized and valid; its ids in
    `token_ids`), `chunk` (text and tokens of one round; `result` on the last) or `error` (`error` set; the
    ticket is over)."""

    kind: str
    prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    result: GenerationResult | None = None
    error: APIError | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, where the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first chunk, where asked for

    @property
    def final(self) -> bool:
        return self.kind == "error" or self.result is not None


@dataclass(eq=False)
class Ticket:
    """One HTTP request's generation. `prompt` is what the tokenizer takes (text, token ids or chat
    messages); `max_tokens_default` asks for the rest of the context as the budget (chat without max_tokens).
    A ticket that does not `stream` gets no event per round, only the last one: each event wakes the event
    loop, whose Python then holds the GIL the engine thread needs between its kernel calls.
    Fields below `events` belong to the engine thread."""

    prompt: Any
    chat: bool
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    max_tokens_default: bool = False
    stream: bool = True  # False: the handler wants only the result, not a chunk per round
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    prompt_ids: list[int] = field(default_factory=list)
    request: Request | None = None
    last_token_at: float | None = None
    spec_seen: SpecSnapshot = field(default_factory=SpecSnapshot)
    done: bool = False
    streamed: bool = False  # its first text went out (sent at once, whatever the stream interval)
    held_text: str = ""  # text, tokens and their logprobs held back until the stream interval's count is reached
    held_ids: list[int] = field(default_factory=list)
    held_logprobs: list[TokenLogprobs] = field(default_factory=list)


class EngineWorker:
    """`stream_interval`: a stream's handler hears of its tokens that many at a time (vLLM's
    `--stream-interval`), its first text at once and its last with the result. Each event costs the event
    loop, the loopback send and the client CPU that, on a small host, the forward shares (on 2 cores about
    0.2 ms a token: `scripts/serve_stream_ab.py`); 1, the default, sends every round's tokens."""

    def __init__(self, engine: Engine, tokenizer: Any, metrics: ServerMetrics, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.stream_interval = stream_interval
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()  # (what, its ticket or event)
        self._waiting: deque[Ticket] = deque()
        self._running: dict[int, Ticket] = {}  # engine request id -> ticket
        self._stopping = threading.Event()
        self._gate = threading.Lock()  # no submit slips in after stop(): every ticket gets an answer
        self._thread = threading.Thread(target=self._loop, name="specdraft-engine", daemon=True)

    # ------------------------------------------------------------------ called from the HTTP side

    def start(self) -> None:
        self._publish_state()
        self._thread.start()

    def submit(self, ticket: Ticket) -> None:
        with self._gate:
            if self._stopping.is_set():
                raise shutting_down()
            self._commands.put(("submit", ticket))

    def call(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop) -> asyncio.Future[T]:
        """`fn()` on the engine thread between two rounds (what uses the engine or its tokenizer); its result, or
        its exception, on a future of `loop` (a 503 if the server shuts down first)."""
        future = loop.create_future()
        with self._gate:
            if self._stopping.is_set():
                raise shutting_down()
            self._commands.put(("call", (fn, future)))
        return future

    def cancel(self, ticket: Ticket) -> None:
        """The client is gone (or the handler failed): free the ticket's slot; a no-op once it finished."""
        if not ticket.done:
            self._commands.put(("cancel", ticket))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything in flight (each handler gets a 503 event) and end the thread."""
        with self._gate:
            self._stopping.set()
            self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._apply_commands(block=not self._running and not self._waiting)
            if self._stopping.is_set():
                break
            self._admit()
            self._publish_state()  # before the round: a request is counted from the moment it is accepted
            if self._running:
                self._step()
                self._publish_state()
        self._shutdown()

    def _apply_commands(self, block: bool) -> None:
        try:
            command, item = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command == "submit":
                self._accept(item)
            elif command == "cancel":
                self._abort(item)
            elif command == "call":
                fn, future = item
                try:
                    _settle(future, fn(), None)
                except Exception as exc:  # the caller's to answer; the engine thread goes on
                    _settle(future, None, exc)
            try:
                command, item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _accept(self, ticket: Ticket) -> None:
        """Tokenize and validate now, so the handler can answer 400 before it starts a response."""
        if ticket.done:
            return
        try:
            ids = self.tokenizer.prompt_ids(ticket.prompt, chat=ticket.chat)
            params = ticket.params
            if ticket.max_tokens_default:
                params = replace(params, max_tokens=max(1, self.engine.max_model_len - len(ids)))
            self.engine.validate(ids, params)
        except ContextOverflowError as exc:
            prompt_field = "messages" if ticket.chat else "prompt"
            self._fail(ticket, bad_request(str(exc), prompt_field if ticket.max_tokens_default else "max_tokens",
                                           "context_length_exceeded"))
            return
        except InvalidParameterError as exc:  # one only the model can check (logit_bias's token ids)
            param = sampling_field(str(exc)) or ("messages" if ticket.chat else "prompt")
            self._fail(ticket, bad_request(str(exc), param))
            return
        except SpecdraftError as exc:
            self._fail(ticket, bad_request(str(exc), "messages" if ticket.chat else "prompt"))
            return
        except Exception as exc:  # a tokenizer or template bug must not take the engine thread down
            log.exception("could not prepare a request")
            self._fail(ticket, APIError(500, f"could not prepare the prompt: {exc}", "server_error"))
            return
        ticket.prompt_ids, ticket.params = ids, params
        self._waiting.append(ticket)
        self._send(ticket, Event("accepted", prompt_tokens=len(ids), token_ids=ids))

    def _admit(self) -> None:
        while self._waiting and self.engine.free_slots > 0:
            ticket = self._waiting.popleft()
            try:
                ticket.request = self.engine.add_request(ticket.prompt_ids, ticket.params)
            except SpecdraftError as exc:
                self._fail(ticket, bad_request(str(exc)))
                continue
            self._running[ticket.request.id] = ticket
            self.metrics.prompt_tokens.inc(len(ticket.prompt_ids))

    def _step(self) -> None:
        tickets = list(self._running.values())
        try:
            chunks = self.engine.step([t.request for t in tickets])
        except Exception as exc:  # a bug in a round: fail its requests, keep serving the others to come
            log.exception("engine step failed")
            for ticket in tickets:
                self._release(ticket)
                self._fail(ticket, APIError(500, f"generation failed: {exc}", "server_error"))
            return
        now = time.perf_counter()
        sends: list[tuple[Ticket, Event]] = []
        for chunk in chunks:
            ticket = self._running[chunk.request_id]
            self.metrics.observe_tokens(len(chunk.token_ids), now, ticket.arrived, ticket.last_token_at)
            if chunk.token_ids:
                ticket.last_token_at = now
            self.metrics.observe_spec(ticket.spec_seen, ticket.request.metrics)
            if chunk.result is not None:
                del self._running[chunk.request_id]
                ticket.done = True
                self.metrics.finished(chunk.result.finish_reason)
                self.metrics.prompt_cache(chunk.result.metrics)
                self.metrics.e2e.observe(now - ticket.arrived)
            event = self._chunk_event(ticket, chunk)
            if event is not None:
                sends.append((ticket, event))
        self._send_all(sends)

    def _chunk_event(self, ticket: Ticket, chunk: StreamChunk) -> Event | None:
        """A round's event for the ticket's handler, or None: a ticket that does not stream hears only of its
        result, a stream of every `stream_interval` tokens (its first text at once, the rest with the result;
        the prompt's chunk, which carries any prompt logprobs, is a first text and never held back)."""
        text, token_ids, result, logprobs = chunk.text, chunk.token_ids, chunk.result, chunk.logprobs
        if result is None and not ticket.stream:
            return None
        held = bool(ticket.held_ids or ticket.held_text)  # never with an interval of 1
        if held:
            text, token_ids = ticket.held_text + text, ticket.held_ids + token_ids
            if logprobs is not None or ticket.held_logprobs:
                logprobs = ticket.held_logprobs + (logprobs or [])
        if result is None:
            if not (text or token_ids):
                return None
            if ticket.streamed and len(token_ids) < self.stream_interval:
                ticket.held_text, ticket.held_ids, ticket.held_logprobs = text, token_ids, logprobs or []
                return None
            ticket.streamed = ticket.streamed or bool(text)
        if held:
            ticket.held_text, ticket.held_ids, ticket.held_logprobs = "", [], []
        return Event("chunk", text=text, token_ids=token_ids, result=result, logprobs=logprobs,
                     prompt_logprobs=chunk.prompt_logprobs)

    def _abort(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        if ticket in self._waiting:
            self._waiting.remove(ticket)
        self._release(ticket)
        ticket.done = True
        self.metrics.aborted.inc()

    def _release(self, ticket: Ticket) -> None:
        if ticket.request is not None:
            self._running.pop(ticket.request.id, None)
            self.engine.release(ticket.request)

    def _shutdown(self) -> None:
        pending = []
        while not self._commands.empty():
            command, item = self._commands.get_nowait()
            if command == "submit":
                pending.append(item)
            elif command == "call":
                _settle(item[1], None, shutting_down())
        for ticket in [*self._running.values(), *self._waiting, *pending]:
            if not ticket.done:
                self._abort(ticket)
                self._send(ticket, Event("error", error=shutting_down()))
        self._waiting.clear()
        self._publish_state()

    def _fail(self, ticket: Ticket, error: APIError) -> None:
        ticket.done = True
        self._send(ticket, Event("error", error=error))

    def _send(self, ticket: Ticket, event: Event) -> None:
        self._send_all([(ticket, event)])

    @staticmethod
    def _send_all(sends: list[tuple[Ticket, Event]]) -> None:
        """Hand a round's events to their handlers with one wake-up of each event loop, not one per request:
        every wake-up runs the loop's Python, which then holds the GIL the engine thread needs between its
        kernel calls (8 streams, stop 29: 410-425 output tok/s with a wake-up per request, 439-468 with one)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for ticket, event in sends:
            by_loop.setdefault(ticket.loop, []).append((ticket.events, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _publish_state(self) -> None:
        engine = self.engine
        self.metrics.set_state(len(self._running), len(self._waiting), engine.max_batch - engine.free_slots,
                               engine.max_batch)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Hand a `call`'s outcome to its future, on the future's own event loop."""
    def settle() -> None:
        if future.done():  # the caller gave up waiting
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop is closed: nobody is waiting any more
        pass


def _deliver(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for events, event in items:
        events.put_nowait(event)
