"""Connections the HTTP server will hold: a cap on how many, and a time limit on a request still being sent.

uvicorn bounds neither: a client that opens a socket and sends its headers a byte a minute
(slowloris) holds a connection, its buffers and a file descriptor for as long as it likes, and
enough of them exhaust the process. Here a connection beyond ``max_connections`` is closed
the moment it is made, and one whose request's headers, or any part of its body, take longer
than ``header_timeout_s`` to arrive is closed then. A request fully received is never timed:
its answer (a long stream) takes what it takes.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap and a deadline on each part of a request."""

    header_timeout_s = 10.0
    max_connections = 1024

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # no answer: a slow client would hold the slot just as long reading it
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the next request on a kept-alive connection has the same time for its headers

    def on_headers_complete(self) -> None:
        self._arm()  # each part of the body, in turn
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._arm()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's ``http=``, with these limits."""
    return type("GuardedHttpProtocol", (GuardedProtocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})
