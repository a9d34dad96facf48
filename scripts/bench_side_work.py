"""Would the server's HTTP side cost less in a process of its own (vLLM's API-server / engine-core split)?

One request decodes `--tokens` tokens on the engine (greedy, one `Engine.step` per token), and after each step
hands a token to a consumer that spends `--work-us` microseconds of Python on it (serializing a streamed
chunk, as the server's event loop does): in a thread of the engine's process woken with
`call_soon_threadsafe` (how `specdraft serve` hands its chunks over), the same but only as the engine
thread enters its next forward, or in another process woken through a pipe; and with no consumer. Output
tok/s of each, alternated, medians of `--passes`.

    .venv/bin/python scripts/bench_side_work.py [--model smollm2-135m] [--dtype gguf] [--tokens 256]
        [--work-us 100,400] [--passes 5]

Stop 43 (AMD Zen 4, 2 cores): the consumer's time comes off the decode rate wherever and whenever it runs,
as the forward's two threads occupy both cores: a process of its own saves nothing here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

CHUNK = {"id": "chatcmpl-" + "0" * 32, "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}]}


def work(repeats: int) -> None:
    for _ in range(repeats):
        json.dumps(CHUNK)


def repeats_for(micros: float) -> int:
    """How many chunk serializations take `micros` microseconds here."""
    start = time.perf_counter()
    work(2000)
    return max(1, round(micros / ((time.perf_counter() - start) / 2000 * 1e6)))


def consumer_process(conn: Connection, repeats: int) -> None:
    """An event loop that does `repeats` serializations for every message on `conn`, until it closes."""

    async def serve() -> None:
        loop, closed = asyncio.get_running_loop(), asyncio.Event()

        def readable() -> None:
            try:
                while conn.poll(0):
                    conn.recv_bytes()
                    work(repeats)
            except EOFError:
                loop.remove_reader(conn.fileno())
                closed.set()

        loop.add_reader(conn.fileno(), readable)
        await closed.wait()

    asyncio.run(serve())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="gguf")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--work-us", default="100,400", help="comma-separated microseconds of work per token")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()

    from specdraft.engine.core import build_engine
    from specdraft.runtime.loader import load_model, load_tokenizer
    from specdraft.verify.sampling import SamplingParams

    tokenizer = load_tokenizer(args.model)
    engine = build_engine(load_model(args.model, dtype=args.dtype), tokenizer, None, max_batch=1)
    prompt = tokenizer.prompt_ids("Write a long story about a dragon.", chat=tokenizer.has_chat_template)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def decode(hand_over: Callable[[], None]) -> float:
        request = engine.add_request(prompt, params)
        start, tokens = time.perf_counter(), 0
        while not request.finished:
            for chunk in engine.step([request]):
                tokens += len(chunk.token_ids)
                hand_over()
        engine.release(request)
        engine.restore_prefixes({})
        return tokens / (time.perf_counter() - start)

    # "thread, at the next forward": the hand-over waits until the engine thread enters its next forward
    # (which holds no GIL), so the consumer's Python runs beside the forward instead of beside the engine
    # thread's own Python between forwards, which waits for the GIL meanwhile.
    pending: list[Callable[[], None]] = []
    forward = engine.target.forward

    def forward_after_hand_over(*args: Any, **kwargs: Any) -> Any:
        while pending:
            pending.pop()()
        return forward(*args, **kwargs)

    engine.target.forward = forward_after_hand_over
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    decode(lambda: None)  # warm-up
    for micros in (float(m) for m in args.work_us.split(",")):
        repeats = repeats_for(micros)
        receive, send = multiprocessing.Pipe(duplex=False)
        process = multiprocessing.get_context("spawn").Process(target=consumer_process, args=(receive, repeats),
                                                               daemon=True)
        process.start()
        time.sleep(1.0)  # the consumer's interpreter is up
        ways = {"no consumer": lambda: None,
                "thread": lambda n=repeats: loop.call_soon_threadsafe(work, n),
                "thread, at the next forward": lambda n=repeats: pending.append(
                    lambda: loop.call_soon_threadsafe(work, n)),
                "process": lambda pipe=send: pipe.send_bytes(b"t")}
        rates: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.passes):
            for way, hand_over in ways.items():
                rates[way].append(decode(hand_over))
        send.close()
        process.join(10)
        base = statistics.median(rates["no consumer"])
        print(f"{micros:.0f} us of work per token:")
        for way, runs in rates.items():
            median = statistics.median(runs)
            print(f"  {way:28} {median:6.1f} tok/s ({median / base:.3f} of no consumer)  "
                  f"runs {' '.join(f'{r:.0f}' for r in runs)}")


if __name__ == "__main__":
    main()
