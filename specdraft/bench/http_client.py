"""A lean HTTP/1.1 client for `bench-serve`: one keep-alive connection, one request at a time, each piece of
the response body timed as it arrives.

The clients share the machine's cores with the server they measure, so whatever CPU they spend per streamed
token is counted as the server's cost. `http.client` (a buffered reader under a chunk decoder) spent 105 us of
CPU per streamed token at one client, this client 65-69 us (stop 50, `docs/bench/amd-zen4/stop50/`). It
speaks only what a benchmark of a local OpenAI server needs: responses framed by Content-Length, chunked, or
by the server closing the connection; no TLS, proxies, redirects or 100-continue.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

READ_SIZE = 1 << 16  # bytes taken from the socket at a time
MAX_HEAD = 1 << 16  # a response head longer than this is not an HTTP server's answer
HEX_DIGITS = b"0123456789abcdefABCDEF"

Pieces = list[tuple[float, bytes]]  # (time.perf_counter() when it arrived, body bytes)


class ProtocolError(Exception):
    """The server's answer is not well-formed HTTP/1.1."""


class ChunkedDecoder:
    """Decodes a chunked body (RFC 9112, 7.1) as it arrives: `feed` returns the payload that the bytes given so
    far complete; `done` once the last chunk and its trailer section have been read. Chunk extensions and
    trailer fields are read and dropped."""

    def __init__(self) -> None:
        self._pending = b""  # bytes of a size line, CRLF or trailer line not complete yet
        self._left = 0  # payload bytes of the current chunk still to come
        self._state = "size"  # size -> data -> crlf -> size ... -> trailer
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf, pos, out = self._pending + data, 0, []
        while not self.done:
            if self._state == "data":
                payload = buf[pos:pos + self._left]
                out.append(payload)
                pos += len(payload)
                self._left -= len(payload)
                if self._left:
                    break
                self._state = "crlf"
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                if len(buf) - pos > MAX_HEAD:
                    raise ProtocolError("a chunk's size line or trailer does not end")
                break
            line, pos = buf[pos:line_end], line_end + 2
            if self._state == "crlf":
                if line:
                    raise ProtocolError("a chunk's data is longer than its size says")
                self._state = "size"
            elif self._state == "size":
                digits = line.split(b";", 1)[0].strip()  # a chunk extension after ";" is dropped
                if not digits or digits.strip(HEX_DIGITS):
                    raise ProtocolError(f"bad chunk size line {line[:40]!r}")
                size = int(digits, 16)
                self._left, self._state = size, ("data" if size else "trailer")
            elif not line:  # the empty line that ends the trailer section
                self.done = True
        self._pending = buf[pos:]
        return b"".join(out)


class Connection:
    """A keep-alive connection to `host:port`, opened on the first request and again after the server closed
    it. A request that fails (OSError, ProtocolError) closes it, so the next one starts afresh."""

    def __init__(self, host: str, port: int, timeout: float = 3600.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self._answered = False  # some of the current request's response has arrived

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def request(self, method: str, path: str, body: bytes = b"",
                headers: dict[str, str] | None = None) -> tuple[int, Pieces]:
        """Send one request and read its whole response: (status, the body's pieces, each with the
        `time.perf_counter()` of the read that brought it)."""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        message = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        reused = self.sock is not None
        try:
            return self._exchange(message)
        except ConnectionError:
            # A kept connection the server closed while idle (uvicorn does after 5 s) fails before any answer:
            # the request goes again, once, on a new connection. A new connection's failure is the server's.
            if not reused or self._answered:
                raise
        return self._exchange(message)

    def _exchange(self, message: bytes) -> tuple[int, Pieces]:
        self._answered = False
        try:
            if self.sock is None:
                self.sock = _connect(self.host, self.port, self.timeout)
            self.sock.sendall(message)
            return self._response()
        except BaseException:
            self.close()
            raise

    def _recv(self, end_ok: bool = False) -> bytes:
        """The next bytes from the server (b"" at the connection's end only where `end_ok`)."""
        try:
            data = self.sock.recv(READ_SIZE)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError(f"no answer from {self.host}:{self.port} within {self.timeout} s") from None
        if not data and not end_ok:
            raise ConnectionError("the server closed the connection before its response ended")
        self._answered = True
        return data

    def _response(self) -> tuple[int, Pieces]:
        buf = b""
        while (head_end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise ProtocolError("the response head does not end")
            buf += self._recv()
        arrived = time.perf_counter()
        status_line, *field_lines = buf[:head_end].decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        fields = {}
        for line in field_lines:
            name, colon, value = line.partition(":")
            if not colon:
                raise ProtocolError(f"bad header line {line[:80]!r}")
            fields[name.strip().lower()] = value.strip()
        body, status = buf[head_end + 4:], int(rest[:3])
        if status < 200 or status in (204, 304):  # answers that have no body, whatever their head says
            pieces = []
        elif "chunked" in fields.get("transfer-encoding", "").lower():
            pieces = self._chunked(body, arrived)
        elif "content-length" in fields:
            try:
                length = int(fields["content-length"])
            except ValueError:
                raise ProtocolError(f"bad Content-Length {fields['content-length']!r}") from None
            pieces = self._sized(body, arrived, length)
        else:  # framed by the end of the connection
            pieces = self._until_closed(body, arrived)
        if fields.get("connection", "").lower() == "close":
            self.close()
        return status, pieces

    def _chunked(self, data: bytes, arrived: float) -> Pieces:
        decoder, pieces = ChunkedDecoder(), []
        while True:
            if payload := decoder.feed(data):
                pieces.append((arrived, payload))
            if decoder.done:
                return pieces
            data = self._recv()
            arrived = time.perf_counter()

    def _sized(self, data: bytes, arrived: float, length: int) -> Pieces:
        pieces, got = [], 0
        while True:
            if data:
                pieces.append((arrived, data[:length - got]))
                got += len(pieces[-1][1])
            if got >= length:
                return pieces
            data = self._recv()
            arrived = time.perf_counter()

    def _until_closed(self, data: bytes, arrived: float) -> Pieces:
        pieces = [(arrived, data)] if data else []
        while data := self._recv(end_ok=True):
            pieces.append((time.perf_counter(), data))
        self.close()
        return pieces


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """A blocking socket whose reads give up after `timeout` seconds. Not Python's socket timeout where the
    system can time reads itself: under it every read is a non-blocking try, a poll and a second try, three
    system calls for each streamed event instead of one."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sys.platform.startswith(("linux", "darwin")):
        seconds = int(timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", seconds, int((timeout - seconds) * 1e6)))
        sock.settimeout(None)
    return sock
