"""A lean HTTP/1.1 client for Server-Sent Events: POST JSON, read the answer one ``data:`` line at a time.

The load generator must cost far less per event than the server it measures, or its own
delays show up as the server's TPOT: 64 clients of a GPU engine read tens of thousands of
events a second. A general client (httpx) spends most of that in its layers; this one reads
chunked bodies straight from asyncio streams, keeps connections alive, and does nothing else.
Only ``http://`` URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from corelib.errors import ConfigError


class ResponseError(Exception):
    """The server broke the HTTP protocol, or the connection ended early."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reused: bool = False) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = reused
        self.expired = False  # cut at the deadline

    def close(self) -> None:
        self.writer.close()


class Response:
    """One answer: its status, then its body, all of it or as SSE data lines. Read it once."""

    def __init__(self, connection: _Connection, status: int, headers: dict[bytes, bytes], timeout_s: float) -> None:
        self.status = status
        self._connection = connection
        self._timeout_s = timeout_s
        self._chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        self._length = int(headers.get(b"content-length", b"0"))
        self.reusable = headers.get(b"connection", b"").lower() != b"close"
        self.complete = False

    async def read(self) -> bytes:
        """The whole body."""
        parts = [piece async for piece in self._pieces()]
        return b"".join(parts)

    async def events(self) -> AsyncIterator[bytes]:
        """The payload of every ``data:`` line, as it arrives."""
        pending = b""
        async for piece in self._pieces():
            lines = (pending + piece).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if line.startswith(b"data: "):
                    yield line[6:].rstrip(b"\r")
        if pending.startswith(b"data: "):
            yield pending[6:].rstrip(b"\r")

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        try:
            if not self._chunked:
                if self._length:
                    yield await reader.readexactly(self._length)
                self.complete = True
                return
            while True:
                size_line = await reader.readline()
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise self._broken(f"bad chunk size line {size_line[:40]!r}") from None
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    self.complete = True
                    return
                yield (await reader.readexactly(size + 2))[:-2]
        except (asyncio.IncompleteReadError, ConnectionError):
            raise self._broken("the connection closed in the middle of the answer") from None

    def _broken(self, what: str) -> ResponseError:
        return _broken(self._connection, self._timeout_s, what)


def _broken(connection: _Connection, timeout_s: float, what: str) -> ResponseError:
    return ResponseError(f"no complete answer within {timeout_s:g} s" if connection.expired else what)


class SseClient:
    """Keep-alive connections to one server; ``post`` sends a JSON body and gives the :class:`Response`."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float, connect_timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"server.bench.url={base_url}: the load generator speaks plain http:// only")
        self.host = parts.hostname
        self.port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._head = f"Host: {parts.netloc}\r\nContent-Type: application/json\r\n{extra}"
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []

    async def _connect(self, reuse: bool = True) -> _Connection:
        if reuse and self._idle:
            connection = self._idle.pop()
            connection.reused = True
            return connection
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port, limit=1 << 20),
                                                self._connect_timeout_s)
        return _Connection(reader, writer)

    @contextlib.asynccontextmanager
    async def post(self, path: str, payload: dict[str, object]) -> AsyncIterator[Response]:
        """Send ``payload`` and give the response once its head arrived.

        Leaving the block before the body was read (a client that hangs up) closes the
        connection; a body read to its end gives the connection back for the next request.
        The whole exchange is bounded by ``timeout_s``: past it the connection is cut.
        """
        body = json.dumps(payload).encode()
        request = (f"POST {self._prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n"
                   ).encode() + body
        connection = await self._connect()

        def expire() -> None:
            connection.expired = True
            connection.writer.transport.abort()

        deadline = asyncio.get_running_loop().call_later(self._timeout_s, expire)
        response: Response | None = None
        try:
            connection.writer.write(request)
            status_line = await connection.reader.readline()
            if not status_line and connection.reused:  # the server closed an idle connection: once more, anew
                connection.close()
                connection = await self._connect(reuse=False)
                connection.writer.write(request)
                status_line = await connection.reader.readline()
            parts = status_line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
                raise _broken(connection, self._timeout_s, f"not an HTTP answer: {status_line[:60]!r}")
            headers: dict[bytes, bytes] = {}
            while (line := await connection.reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            response = Response(connection, int(parts[1]), headers, self._timeout_s)
            yield response
        finally:
            deadline.cancel()
            if response is not None and response.complete and response.reusable and not connection.expired:
                self._idle.append(connection)
            else:
                connection.close()

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
