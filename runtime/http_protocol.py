"""strata-server's HTTP/1.1 connection: uvicorn's h11 protocol with a deadline on a request's head.

uvicorn starts no timer while a request's line and headers arrive (its keep-alive timer stops at
the first byte), so a client sending one header byte every few seconds, or connecting and sending
nothing, holds a connection and its file descriptor for ever (slowloris). Here each request's head
must be whole within HEAD_S of the connection's start or of the previous response's end; else the
connection is closed. The body has its own idle limit (server.BODY_IDLE_S, a 408).
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_S = 30.0


class HeadDeadlineProtocol(H11Protocol):
    _head = None            # the pending close, while a request's head is awaited
    _seen = None            # the cycle (request) whose head last arrived

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()         # between requests: the bytes start the next head
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._seen:
            self._seen = self.cycle     # a request's head is whole: its body and answer are not timed here
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head is None:
            self._head = self.loop.call_later(HEAD_S, self._late)

    def _disarm(self) -> None:
        if self._head is not None:
            self._head.cancel()
            self._head = None

    def _late(self) -> None:
        self._head = None
        if self.cycle is not None and not self.cycle.response_complete and self.cycle is self._seen:
            return              # a request in progress (its head arrived as the timer fired)
        if not self.transport.is_closing():
            self.transport.close()
