"""`specdraft bench-serve`: the OpenAI server under load, with speculation off and on.

For each concurrency level (default 1, 2, 4, 8, 16) a pool of that many streaming chat clients works through
the same requests (first turns spread over the suite's categories in turn, `--prompts spread`, or its first
ones, `--prompts first`; 2 x the highest level by default; greedy, `ignore_eos` so every
answer is `--max-tokens` long), against the same model served twice: plain decoding and the drafter. Each of
`--repeats` passes runs every level, plain and speculative (which one first alternates), so machine noise hits
levels and modes alike; each row is the run of median throughput; each level's scaling over concurrency 1, and
the drafter's throughput over plain decoding's, are the medians of the passes' own ratios (`scaling`,
`speculative_over_plain`: pairs that ran side by side, so the VM's drift between passes cancels). At
concurrency 1 the same requests also run on an engine called directly (`direct`, what `LLM.generate` does) and
through the plain server, streamed and not, one request at a time in turn, so the server's own cost is
measured in the same run, request by request.
Every run starts with no prompt cached (`POST /reset_prefix_cache`; the direct engine's `restore_prefixes`):
repeats send the same prompts, and the servers' slots would otherwise hand them their earlier entries.
Reported per level and mode, as vLLM's `benchmark_serving` does:

- throughput: output tokens / wall time of the level, and requests / s;
- TTFT: request sent -> first content event; TPOT: (last - first event) / (output tokens - 1);
- ITL: the gaps between content events (a speculative round sends its accepted tokens as one event, so
  ITL is per event and TPOT per token);
- p50 and p99 of each, the mean acceptance rate and mean accepted length from each response's `usage`.

Writes `serve.json` and `serve.png` to `--out`. `--url` measures a server that is already running instead
(one mode, labelled `external`). The clients run in a worker process (sharing the cores, not the GIL).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specdraft.bench.http_client import Connection, Pieces, ProtocolError
from specdraft.bench.suite import first_turns, load_suite
from specdraft.config import DTYPE_HELP, arg_draft_length, arg_int_in, target_dtype
from specdraft.errors import SpecdraftError

# Passes over the requests for the server's cost at concurrency 1, each request asked of the engine alone and of
# the plain server (streamed and not) in turn: with whole runs alternated instead, 3 runs moved the median from
# -5% to +22% on a busy VM (stop 34) and 7 from +7.5% to +15.7% (stop 46).
OVERHEAD_REPEATS = 4


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be integers >= 1, got {text!r}")
    return levels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--speculative-model", "--draft", dest="speculative_model", default="ngram")
    parser.add_argument("--num-speculative-tokens", "-k", dest="num_speculative_tokens", type=arg_draft_length,
                        default=5)
    parser.add_argument("--suite", default=None, help="Spec-Bench style JSONL (default: the bundled mini suite)")
    parser.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=arg_int_in(1), default=None,
                        help="requests per level, the same prompts at every level (default: 2 x the highest "
                             "concurrency, at least 8)")
    parser.add_argument("--prompts", choices=["spread", "first"], default="spread",
                        help="which of the suite's prompts: spread over its categories in turn (default), or its "
                             "first ones in file order (bench-serve's choice up to stop 55: on the dev suite, "
                             "32 requests were MT-bench and translation only)")
    parser.add_argument("--max-tokens", type=arg_int_in(1), default=64)
    parser.add_argument("--repeats", type=arg_int_in(1), default=1,
                        help="runs of each level and mode, alternated; the row is the run of median throughput")
    parser.add_argument("--url", default=None, help="benchmark this running server instead (e.g. "
                                                    "http://127.0.0.1:8000)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "gguf", "fp32", "fp16"], help=DTYPE_HELP)
    parser.add_argument("--stream-interval", type=arg_int_in(1), default=1,
                        help="the servers' --stream-interval: streams get their tokens this many at a time")
    parser.add_argument("--out", default="bench-out/serve")


# ------------------------------------------------------------------------------------------ the client


def _one_request(conn: Connection, model: str, prompt: str, max_tokens: int, stream: bool = True,
                 headers: dict[str, str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    sent, cpu = time.perf_counter(), time.thread_time()
    # Every piece is only timed as it arrives (the client shares the server's cores); parsed once it is over.
    status, pieces = conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                  {"Content-Type": "application/json", **(headers or {})})
    done = time.perf_counter()
    if status != 200:
        return {"error": f"HTTP {status}: {b''.join(piece for _, piece in pieces)[:200]!r}"}
    try:
        row = _answer_row(pieces, stream, sent, done)
    except ErrorEvent as exc:
        return {"error": str(exc)}
    except (ValueError, TypeError, AttributeError, KeyError) as exc:  # not JSON or UTF-8, or not OpenAI's shapes
        return {"error": f"malformed response: {type(exc).__name__}: {exc}"[:300]}
    row["client_cpu_s"] = time.thread_time() - cpu  # this request's reads and parsing, on the server's cores
    return row


class ErrorEvent(Exception):
    """A stream that began with 200 and then carried an error event (its message)."""


def _answer_row(pieces: Pieces, stream: bool, sent: float, done: float) -> dict[str, Any]:
    """A 200 answer's row from its body pieces (each with its arrival time): latencies, tokens, acceptance.
    Raises ErrorEvent for an error event in the stream, ValueError (bad JSON or UTF-8, no content or usage),
    KeyError, TypeError or AttributeError (JSON of other shapes than OpenAI's) for a malformed answer."""
    events: list[float] = []  # when each event with content arrived
    usage: dict[str, Any] | None = None
    if stream:
        lines: list[tuple[float, bytes]] = []  # each with the time its last piece arrived
        pending = b""
        for arrived, piece in pieces:
            *complete, pending = (pending + piece).split(b"\n")
            lines.extend((arrived, line) for line in complete)
        for arrived, raw in lines:
            line = raw.decode().rstrip("\r")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise ErrorEvent(event["error"].get("message", "error event"))
            usage = event.get("usage") or usage
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                events.append(arrived)
    else:
        usage = json.loads(b"".join(piece for _, piece in pieces)).get("usage")
        events.append(done)
    if not events or usage is None:
        raise ValueError("no content or no usage in the response")
    tokens = usage["completion_tokens"]
    row = {"e2e_s": done - sent, "tokens": tokens,
           "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
           "acceptance_rate": usage.get("acceptance_rate"), "mean_accepted_length": usage.get("mean_accepted_length")}
    if not stream:  # one answer at the end: no first token or gaps to time
        return {"ttft_s": None, "tpot_s": None, "itl_s": [], **row}
    return {"ttft_s": events[0] - sent, "tpot_s": (events[-1] - events[0]) / (tokens - 1) if tokens > 1 else None,
            "itl_s": [b - a for a, b in zip(events, events[1:])], **row}


def _run_level(url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int,
               api_key: str | None, stream: bool = True) -> tuple[list[dict[str, Any]], float]:
    """Every prompt through a pool of `concurrency` clients; (one result per prompt, wall seconds).

    The clients share the machine's cores with the server, so they spend as little CPU as they can while it
    works: one blocking keep-alive `http_client.Connection` per client thread, reading whatever has arrived,
    each piece only timed on arrival, its JSON parsed after the stream ends (65-69 us of CPU per streamed token
    at one client, against 105 with `http.client`, 240 with aiohttp and 390 with httpx: stops 31, 42, 50)."""
    parts = urlsplit(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()
    conns = [Connection(parts.hostname, parts.port) for _ in range(concurrency)]
    for conn in conns:
        idle.put(conn)

    def run(prompt: str) -> dict[str, Any]:
        conn = idle.get()
        try:
            return _one_request(conn, model, prompt, max_tokens, stream, headers)
        except (OSError, ProtocolError) as exc:  # the connection is closed, reopened by the next request
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            idle.put(conn)

    try:
        # Each run starts from no cached prompts, as the direct reference does: repeats of a prompt would
        # otherwise time the prompt cache, not the prefill (a server without the endpoint just answers 404).
        conns[0].request("POST", "/reset_prefix_cache", headers=headers)
        with ThreadPoolExecutor(concurrency) as pool:
            start = time.perf_counter()
            results = list(pool.map(run, prompts))
            return results, time.perf_counter() - start
    finally:
        for conn in conns:
            conn.close()


_CONNECTIONS: dict[str, Connection] = {}  # the client process's keep-alive connection per URL


def _timed_request(url: str, model: str, prompt: str, max_tokens: int, api_key: str | None,
                   stream: bool) -> tuple[float, int]:
    """One request on this process's keep-alive connection to `url` after an untimed `/reset_prefix_cache`
    (as `_direct_request` starts from no cached prompt): (wall seconds, output tokens). Raises on an error."""
    conn = _CONNECTIONS.get(url)
    if conn is None:
        parts = urlsplit(url)
        conn = _CONNECTIONS[url] = Connection(parts.hostname, parts.port)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conn.request("POST", "/reset_prefix_cache", headers=headers)  # a failure closes it; the next reopens it
    start = time.perf_counter()
    result = _one_request(conn, model, prompt, max_tokens, stream, headers)
    wall = time.perf_counter() - start
    if "error" in result:
        raise SpecdraftError(f"a request to {url} failed: {result['error']}")
    return wall, result["tokens"]


# ------------------------------------------------------------------------------------------ statistics


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no data."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = (len(values) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def summarize(mode: str, concurrency: int, results: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    row: dict[str, Any] = {
        "mode": mode, "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "error_examples": [r["error"] for r in results if "error" in r][:3], "output_tokens": tokens,
        "duration_s": wall_s, "throughput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "prompt_tokens_cached": sum(r.get("cached_tokens", 0) for r in ok),
        # The load generator's own CPU (its threads' time in the requests) per output token: the server's
        # cores pay for it too, so a figure to read beside the server's.
        "client_cpu_us_per_token": 1e6 * sum(r["client_cpu_s"] for r in ok) / tokens if tokens else None,
    }
    series = {"ttft": [r["ttft_s"] for r in ok], "tpot": [r["tpot_s"] for r in ok],
              "itl": [g for r in ok for g in r["itl_s"]], "e2e": [r["e2e_s"] for r in ok]}
    for name, values in series.items():
        for q in (50, 99):
            p = _percentile(values, q)
            row[f"{name}_ms_p{q}"] = p * 1000 if p is not None else None
    for name in ("acceptance_rate", "mean_accepted_length"):
        values = [r[name] for r in ok if r.get(name) is not None]
        row[name] = sum(values) / len(values) if values else None
    return row


def pass_order(modes: Sequence[Any], repeat: int) -> list[Any]:
    """The order in which pass `repeat` runs the modes at a level: reversed every other pass, so neither mode
    always runs second, after the other has had the cores (at stop 49 two passes of five ran ngram 0.80-0.82x
    plain at 8 clients, the other three 0.95-0.97x, with plain always first)."""
    return list(modes) if repeat % 2 == 0 else list(reversed(modes))


def _median_ratio(tops: Sequence[float | None], bottoms: Sequence[float | None]) -> float | None:
    """The median of tops[i] / bottoms[i]: pairs measured side by side (one pass, one alternation), so the
    VM's drift between pairs cancels; the ratio of the two medians would not cancel it (on a VM whose speed
    moves 10% from minute to minute, 8 passes at 8 clients: ngram over plain 0.91 from the medians, 0.99 as
    the median of the passes' ratios, stop 43). None without a pair of positive values."""
    ratios = [t / b for t, b in zip(tops, bottoms, strict=True) if t and b]
    return statistics.median(ratios) if ratios else None


def _throughputs(runs: Sequence[dict[str, Any]]) -> list[float | None]:
    return [r["throughput_tok_s"] for r in runs]


def _scaling(runs: dict[tuple[int, str], list[dict[str, Any]]], levels: Sequence[int],
             modes: Sequence[str]) -> dict[str, dict[int, float | None]]:
    """Per mode, each level's output tok/s over concurrency 1's, the median of the passes' ratios."""
    if 1 not in levels:
        return {}
    return {mode: {c: _median_ratio(_throughputs(runs[c, mode]), _throughputs(runs[1, mode]))
                   for c in levels if c != 1}
            for mode in modes}


def _speculative_over_plain(runs: dict[tuple[int, str], list[dict[str, Any]]], levels: Sequence[int],
                            modes: Sequence[str]) -> dict[str, dict[int, float | None]]:
    """Per drafter, each level's output tok/s over the plain server's in the same pass, the median of the
    passes' ratios (each pass runs a level plain, then speculative, back to back)."""
    if "plain" not in modes:
        return {}
    return {mode: {c: _median_ratio(_throughputs(runs[c, mode]), _throughputs(runs[c, "plain"])) for c in levels}
            for mode in modes if mode != "plain"}


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A level's repeats as one row: the run of median throughput (an odd count; the slower middle one for
    an even count), with every run's throughput beside it."""
    ranked = sorted(runs, key=lambda r: r["throughput_tok_s"] or 0.0)
    row = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        row["throughput_runs"] = [r["throughput_tok_s"] for r in runs]
    return row


# ------------------------------------------------------------------------------------------ the servers


def _health_status(url: str) -> int | None:
    """The status of `GET /health` (None while nothing answers), with the clients' HTTP library."""
    parts = urlsplit(url)
    conn = Connection(parts.hostname, parts.port, timeout=2)
    try:
        return conn.request("GET", "/health")[0]
    except (OSError, ProtocolError):
        return None
    finally:
        conn.close()


@contextmanager
def _serve_process(args: argparse.Namespace, max_batch: int, drafter: str | None) -> Iterator[str]:
    """`specdraft serve` in a process of its own, as deployed; yields its base URL once /health answers.

    Not a thread of this process: torch's wheel brings its own libgomp, which the kernels share, and once two
    threads of a process have run OpenMP regions libgomp manages more threads than 2 cores and throttles its
    spin-waits, so every barrier of a forward sleeps (measured: 23-25 ms per token against 14 with two servers
    hosted as threads here, or with any idle thread that had decoded before)."""
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "specdraft.cli", "serve", "--model", args.model, "--dtype", args.dtype,
               "--max-batch", str(max_batch), "--port", str(port), "--log-level", "warning"]
    if drafter:
        command += ["--speculative-model", drafter, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.api_key:
        command += ["--api-key", args.api_key]
    if getattr(args, "stream_interval", 1) != 1:
        command += ["--stream-interval", str(args.stream_interval)]
    command += list(getattr(args, "server_flags", ()))
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None:
                raise SpecdraftError(f"`{' '.join(command)}` exited with status {process.returncode} (its error "
                                     "is printed above)")
            if _health_status(url) == 200:
                break
            if time.monotonic() > deadline:
                raise SpecdraftError(f"`{' '.join(command)}` did not become healthy in 15 minutes")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _servers(args: argparse.Namespace, max_batch: int):
    """(mode -> base URL) context: plain and speculative servers, each `specdraft serve` in its own process,
    and the direct reference: the plain engine called in this process."""
    from contextlib import ExitStack

    from specdraft.engine.core import build_engine
    from specdraft.runtime.loader import load_model, load_tokenizer

    stack = ExitStack()
    try:  # a server that fails to start, or a model that fails to load, must not leave the others running
        urls = {"plain": stack.enter_context(_serve_process(args, max_batch, None)),
                args.speculative_model: stack.enter_context(_serve_process(args, max_batch,
                                                                           args.speculative_model))}
        target = load_model(args.model, dtype=target_dtype(args.dtype, args.speculative_model))
        tokenizer = load_tokenizer(args.model)
    except BaseException:
        stack.close()
        raise
    direct = build_engine(target, tokenizer, None, 0)
    return stack, urls, lambda prompt, max_tokens: _direct_request(direct, tokenizer, prompt, max_tokens)


def _direct_request(engine: Any, tokenizer: Any, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One request on an engine called in this process (what `LLM.generate` runs), with no server in between,
    from no cached prompt (as the servers' requests, after `/reset_prefix_cache`): (wall seconds, output tokens),
    the reference for the server's cost at concurrency 1. The prompt is tokenized before the clock starts (the
    server's tokenizing is part of its cost)."""
    from specdraft.verify.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = tokenizer.prompt_ids(prompt, chat=tokenizer.has_chat_template)
    engine.restore_prefixes({})
    start = time.perf_counter()
    tokens = len(engine.generate(ids, params).token_ids)
    return time.perf_counter() - start, tokens


# ------------------------------------------------------------------------------------------ the command


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    from specdraft.bench.machine import header, header_lines

    prompts_all = first_turns(load_suite(args.suite), args.prompts)
    levels = args.concurrency
    direct = None
    if args.url:
        from contextlib import ExitStack

        stack, urls = ExitStack(), {"external": args.url.rstrip("/")}
    else:
        stack, urls, direct = _servers(args, max(levels))
    rows: list[dict[str, Any]] = []
    scaling: dict[str, dict[int, float | None]] = {}
    speculative: dict[str, dict[int, float | None]] = {}
    overhead: dict[str, float | None] = {"stream": None, "non_streaming": None}
    # The clients run in a worker process, as real clients do: in this one their SSE parsing would share the
    # GIL with the direct reference's engine.
    clients = stack.enter_context(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
    with stack:
        for url in urls.values():  # warm-up: kernels, caches, the first prefill, the client process
            clients.submit(_run_level, url, args.model, prompts_all[:1], 1, 4, args.api_key).result()
        # The same requests at every level, so that a level's throughput against another's compares the same
        # work (with 2 x its own concurrency, one client read 8 short prompts and 8 clients 16 with longer ones).
        count = args.requests or max(8, 2 * max(levels))
        prompts = [prompts_all[i % len(prompts_all)] for i in range(count)]  # more than the suite: again
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {(c, mode): [] for c in levels for mode in urls}
        for repeat in range(args.repeats):  # levels and modes alternated, so machine noise hits each alike
            for concurrency in levels:
                for mode, url in pass_order(list(urls.items()), repeat):
                    results, wall = clients.submit(_run_level, url, args.model, prompts, concurrency,
                                                   args.max_tokens, args.api_key).result()
                    runs[concurrency, mode].append(summarize(mode, concurrency, results, wall))
                    print(f"run {repeat + 1}/{args.repeats}: {mode} c={concurrency} "
                          f"{_fmt(runs[concurrency, mode][-1]['throughput_tok_s'])} tok/s", flush=True)
        for concurrency in levels:
            for mode in urls:
                rows.append(median_run(runs[concurrency, mode]))
                _print_row(rows[-1])
        scaling = _scaling(runs, levels, list(urls))
        for mode, ratios in scaling.items():
            if ratios:
                print(f"{mode}: output tok/s against c=1, medians of each pass's ratio: "
                      + ", ".join(f"c={c} {_fmt(ratio, '.2f')}x" for c, ratio in ratios.items()), flush=True)
        speculative = _speculative_over_plain(runs, levels, list(urls))
        for mode, ratios in speculative.items():
            print(f"{mode} over plain, medians of each pass's ratio: "
                  + ", ".join(f"c={c} {_fmt(ratio, '.3f')}x" for c, ratio in ratios.items()), flush=True)
        if 1 in levels and direct is not None:
            overhead = _server_overhead(clients, urls["plain"], direct, prompts, args, rows)
    out = {"header": {**header(), "model": args.model},
           "config": {"concurrency": levels, "max_tokens": args.max_tokens, "requests": count,
                      "repeats": args.repeats,
                      "speculative_model": args.speculative_model, "k": args.num_speculative_tokens,
                      "suite": args.suite or "bundled mini suite", "prompts": args.prompts, "url": args.url,
                      "stream_interval": args.stream_interval},
           "results": rows, "scaling": scaling, "speculative_over_plain": speculative,
           "server_overhead_c1": overhead["stream"], "server_overhead_c1_non_streaming": overhead["non_streaming"]}
    print("\n".join(header_lines(out["header"])))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve.json").write_text(json.dumps(out, indent=2))
    _plot(rows, speculative, out_dir / "serve.png")
    print(f"wrote {out_dir / 'serve.json'} and {out_dir / 'serve.png'}")
    return out


def _server_overhead(clients: ProcessPoolExecutor, url: str, direct: Any, prompts: Sequence[str],
                     args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The server's cost at concurrency 1: each request on the engine directly and through the plain server,
    streamed and not, one after another (the three in turn, the order rotating), OVERHEAD_REPEATS passes;
    per way of asking, the median over requests of served / direct time, minus one. Pairs a second apart
    cancel the VM's drift, which moves its speed 10% from minute to minute (whole runs alternated read +7.5%
    to +15.7% at stop 46). Streaming pays for an event per token: the server's event loop and the client's
    reads share the cores with the forwards. A non-streaming request is what `LLM.generate` returns: one
    answer at the end."""
    ways: dict[str, Any] = {
        "direct": lambda prompt: direct(prompt, args.max_tokens),
        "stream": lambda prompt: clients.submit(_timed_request, url, args.model, prompt, args.max_tokens,
                                                args.api_key, True).result(),
        "non_streaming": lambda prompt: clients.submit(_timed_request, url, args.model, prompt, args.max_tokens,
                                                       args.api_key, False).result(),
    }
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    direct_passes: list[float] = []
    tokens = 0
    for repeat in range(OVERHEAD_REPEATS):
        for i, prompt in enumerate(prompts):
            shift = (repeat * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                seconds, count = ways[name](prompt)
                times[name].append(seconds)
                if name == "direct" and repeat == 0:
                    tokens += count
        direct_passes.append(sum(times["direct"][-len(prompts):]))
    median_direct = statistics.median(direct_passes)
    rows.append({"mode": "direct", "concurrency": 1, "requests": len(prompts), "errors": 0, "output_tokens": tokens,
                 "duration_s": median_direct, "throughput_tok_s": tokens / median_direct,
                 "request_s": dict(times)})
    overhead = {way: _median_ratio(times[way], times["direct"]) for way in ("stream", "non_streaming")}
    overhead = {way: None if ratio is None else ratio - 1 for way, ratio in overhead.items()}
    print(f"direct     c=1   {_fmt(rows[-1]['throughput_tok_s'])} tok/s  (the engine without the server; each "
          f"request also through the server, {OVERHEAD_REPEATS} x {len(prompts)} pairs, medians of their ratios: "
          f"the server costs {_fmt(overhead['stream'], '+.1%')} streamed, "
          f"{_fmt(overhead['non_streaming'], '+.1%')} not streamed, at concurrency 1)", flush=True)
    return overhead


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _print_row(r: dict[str, Any]) -> None:
    print(f"{r['mode']:<10} c={r['concurrency']:<3} {_fmt(r['throughput_tok_s'])} tok/s  "
          f"TTFT p50/p99 {_fmt(r['ttft_ms_p50'], '.0f')}/{_fmt(r['ttft_ms_p99'], '.0f')} ms  "
          f"TPOT {_fmt(r['tpot_ms_p50'])}/{_fmt(r['tpot_ms_p99'])} ms  "
          f"ITL {_fmt(r['itl_ms_p50'])}/{_fmt(r['itl_ms_p99'])} ms  "
          f"acc {_fmt(r['acceptance_rate'], '.2f')}  client CPU {_fmt(r.get('client_cpu_us_per_token'), '.0f')} "
          f"us/token  errors {r['errors']}", flush=True)


def _plot(rows: Sequence[dict[str, Any]], speculative: dict[str, dict[int, float | None]], path: Path) -> None:
    """Throughput, TTFT and TPOT per level (each level's median run), and the drafter over plain decoding
    (the median of the passes' paired ratios, the figure to read: medians of runs carry the VM's drift)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = [("throughput_tok_s", "output tok/s"), ("ttft_ms_p50", "TTFT p50 (ms)"), ("tpot_ms_p50", "TPOT p50 (ms)")]
    for ax, (key, label) in zip(axes, panels):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            points = [(r["concurrency"], r[key]) for r in rows if r["mode"] == mode and r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=mode)
        ax.set_ylabel(label)
    for mode, ratios in speculative.items():
        points = [(c, ratio) for c, ratio in ratios.items() if ratio is not None]
        if points:
            axes[3].plot(*zip(*points), marker="o", label=mode, color="C1")
    axes[3].axhline(1.0, color="grey", lw=1)
    axes[3].axhline(0.95, color="grey", lw=1, ls="--")
    axes[3].set_ylabel("drafter / plain, median of passes")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
