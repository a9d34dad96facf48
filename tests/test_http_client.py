"""`bench-serve`'s lean HTTP/1.1 client (`specdraft.bench.http_client`) against scripted servers on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from specdraft.bench.http_client import ChunkedDecoder, Connection, ProtocolError
from specdraft.bench.serve_bench import _run_level

CHUNKED = (b"5;ext=1\r\nhello\r\n"
           b"1a\r\n data: {\"x\": \"\\r\\n0\\r\\n\"}\n\r\n"
           b"0\r\nTrailer-Field: yes\r\n\r\n")
PAYLOAD = b"hello data: {\"x\": \"\\r\\n0\\r\\n\"}\n"


def test_chunked_decoder_gives_the_payload_however_the_bytes_arrive():
    whole = ChunkedDecoder()
    assert whole.feed(CHUNKED) == PAYLOAD and whole.done
    for cut in range(1, len(CHUNKED)):  # every split into two reads
        decoder = ChunkedDecoder()
        first = decoder.feed(CHUNKED[:cut])
        assert not decoder.done
        assert first + decoder.feed(CHUNKED[cut:]) == PAYLOAD and decoder.done
    decoder, out = ChunkedDecoder(), b""
    for i in range(len(CHUNKED)):  # a byte at a time: done only with the last one
        assert not decoder.done
        out += decoder.feed(CHUNKED[i:i + 1])
    assert out == PAYLOAD and decoder.done


@pytest.mark.parametrize("body", [b"zz\r\nhello\r\n", b"-5\r\nhello\r\n", b"\r\n", b"0x5\r\nhello\r\n",
                                  b"1_0\r\nhello\r\n", b"3\r\nhello\r\n"])
def test_chunked_decoder_refuses_a_malformed_body(body):
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(body)


@contextmanager
def scripted_server(handle: Callable[[socket.socket, int], None]) -> Iterator[int]:
    """A loopback server calling handle(connection, index) for each connection it accepts; yields its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve() -> None:
        index = 0
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                handle(conn, index)
            index += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def read_request(conn: socket.socket) -> bytes:
    """One request's head and its Content-Length body (the client always sends one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                 .split(b":")[1])
    while len(body) < length:
        body += conn.recv(4096)
    return head + b"\r\n\r\n" + body


def test_connection_reads_each_framing_on_one_kept_connection():
    seen: list[bytes] = []
    connections: list[int] = []

    def handle(conn: socket.socket, index: int) -> None:
        connections.append(index)
        seen.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nno")
        time.sleep(0.2)  # long enough that the two parts arrive in two reads, even on a busy machine
        conn.sendall(b"ne!")
        seen.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED[:20])
        time.sleep(0.2)
        conn.sendall(CHUNKED[20:])
        seen.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        seen.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 204 No Content\r\n\r\n")  # no body, no length, connection kept
        seen.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with scripted_server(handle) as port:
        client = Connection("127.0.0.1", port, timeout=5)
        status, pieces = client.request("POST", "/v1/x", b'{"a": 1}', {"Authorization": "Bearer k"})
        assert status == 404 and b"".join(p for _, p in pieces) == b"none!" and len(pieces) == 2
        status, pieces = client.request("GET", "/stream")
        assert status == 200 and b"".join(p for _, p in pieces) == PAYLOAD
        assert len(pieces) == 2 and pieces[1][0] - pieces[0][0] >= 0.15  # each piece timed when it arrived
        assert client.request("GET", "/empty") == (200, [])
        assert client.request("DELETE", "/thing") == (204, [])
        assert [p for _, p in client.request("GET", "/after")[1]] == [b"ok"]
        client.close()
    assert connections == [0]  # every request on the one kept connection
    assert seen[0].startswith(b"POST /v1/x HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in seen[0]
    assert seen[0].endswith(b'\r\n\r\n{"a": 1}') and seen[1].startswith(b"GET /stream HTTP/1.1\r\n")


def test_connection_framed_by_close_and_a_response_cut_short():
    def handle(conn: socket.socket, index: int) -> None:
        read_request(conn)
        if index == 0:
            conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        elif index == 1:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        elif index == 2:
            conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    with scripted_server(handle) as port:
        client = Connection("127.0.0.1", port, timeout=5)
        status, pieces = client.request("GET", "/")
        assert status == 200 and b"".join(p for _, p in pieces) == b"until the end" and client.sock is None
        with pytest.raises(ConnectionError):  # a new connection cut short is not sent again
            client.request("GET", "/")
        assert client.sock is None
        with pytest.raises(ProtocolError):
            client.request("GET", "/")
        assert client.sock is None  # closed: the next request starts afresh and is answered
        status, pieces = client.request("GET", "/")
        assert status == 200 and [p for _, p in pieces] == [b"ok"]


def test_connection_sends_again_once_when_a_kept_connection_was_closed_while_idle():
    answered: list[int] = []

    def handle(conn: socket.socket, index: int) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n" + str(index).encode())
        answered.append(index)  # then closes, as uvicorn does with an idle kept connection

    with scripted_server(handle) as port:
        client = Connection("127.0.0.1", port, timeout=5)
        assert [p for _, p in client.request("GET", "/")[1]] == [b"0"]
        time.sleep(0.05)
        assert [p for _, p in client.request("GET", "/")[1]] == [b"1"]
    assert answered == [0, 1]
    with socket.socket() as probe:  # nothing listens: refused, not retried forever
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        Connection("127.0.0.1", port, timeout=5).request("GET", "/")


def test_connection_gives_up_on_a_server_that_does_not_answer():
    def handle(conn: socket.socket, index: int) -> None:
        read_request(conn)
        time.sleep(1.0)

    with scripted_server(handle) as port:
        client = Connection("127.0.0.1", port, timeout=0.3)
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            client.request("GET", "/")
        assert time.perf_counter() - start < 0.9 and client.sock is None


def test_connection_does_not_send_again_once_an_answer_began():
    connections: list[int] = []

    def handle(conn: socket.socket, index: int) -> None:
        connections.append(index)
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\npart")  # then the server goes away

    with scripted_server(handle) as port:
        client = Connection("127.0.0.1", port, timeout=5)
        assert client.request("POST", "/")[0] == 200
        with pytest.raises(ConnectionError):  # the kept connection had begun answering: the server's failure
            client.request("POST", "/")
        time.sleep(0.2)
    assert connections == [0]


def sse(*events: bytes) -> bytes:
    """A 200 chunked SSE answer whose one chunk carries `events`."""
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


GOOD_SSE = sse(b'{"choices": [{"delta": {"content": "hi"}}]}',
               b'{"choices": [], "usage": {"completion_tokens": 1}}', b"[DONE]")
MALFORMED_SSE = [
    sse(b'{"choices": [{"delta": {"content": "hi"}}'),  # JSON cut short
    sse(b'{"choices": [{"delta": {"content": "\xff"}}]}'),  # not UTF-8
    sse(b'["a list, not an event"]'),
    sse(b'{"choices": [{"delta": "not an object"}]}'),
    sse(b'{"choices": [{"delta": {"content": "hi"}}]}', b'{"usage": {"tokens": 1}}'),  # no completion_tokens
    sse(b'{"choices": [{"delta": {"content": "hi"}}]}', b'{"usage": ["not an object"]}'),
    sse(b'{"choices": [{"delta": {"content": "hi"}}]}'),  # no usage at all
    sse(b'{"error": {"message": "the engine failed"}}'),
]


def test_bench_serve_counts_a_malformed_answer_as_that_requests_error():
    """A 200 stream with a malformed event is one request's error row; the level goes on to the next."""
    answers = [GOOD_SSE, *MALFORMED_SSE, GOOD_SSE]

    def handle(conn: socket.socket, index: int) -> None:
        read_request(conn)  # the level's /reset_prefix_cache
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        for answer in answers:
            read_request(conn)
            conn.sendall(answer)

    with scripted_server(handle) as port:
        results, _ = _run_level(f"http://127.0.0.1:{port}", "m", ["p"] * len(answers), 1, 4, None)
    assert [r.get("tokens") for r in (results[0], results[-1])] == [1, 1]
    errors = [r.get("error", "") for r in results[1:-1]]
    assert all(e.startswith("malformed response: ") for e in errors[:-1]), errors
    assert errors[-1] == "the engine failed"
