"""The listening side of the model server and the gateway: uvicorn's HTTP/1.1 protocol with a deadline
for each request line and headers, and a cap on open connections.

uvicorn bounds neither: a client that trickles its headers holds its connection for as long as it
likes, and every connection is accepted. The body's own deadline and size limit are ASGI's business
(:class:`hybridflow.serving.bounds.Bounds`)."""

from __future__ import annotations

import json
import resource
from typing import Any

FD_HEADROOM = 64  # descriptors beyond the connections: the listening socket, logs, backend connections


def protocol(header_timeout_s: float, *, max_connections: int | None = None, parser: str = "httptools") -> type:
    """uvicorn's HTTP/1.1 protocol (``parser``: ``httptools``, the C parser, where installed, else
    ``h11``, which also caps the size of a request's headers) that closes a connection whose request
    line and headers are not complete within ``header_timeout_s`` of its start or of its last answer,
    and answers 503 to a connection beyond ``max_connections`` open ones, then closes it."""
    if parser == "httptools":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
        except ImportError:
            from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    full = _refusal(max_connections)

    class Protocol(Base):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                # Refused before reading anything: a flood of idle connections costs no more than this.
                transport.write(full)
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            # One deadline per connection: a timer left behind per answered request would pile up
            # (50k pending at 5,000 requests/s) and lengthen every garbage collection.
            previous = getattr(self, "_deadline", None)
            if previous is not None:
                previous.cancel()
            self._deadline = self.loop.call_later(header_timeout_s, self._expire, self.cycle)

        def _expire(self, armed_cycle: Any) -> None:
            # No request has started since the deadline was set: its headers are still not in.
            if self.cycle is armed_cycle and not self.transport.is_closing():
                self.transport.close()

    return Protocol


def _refusal(max_connections: int | None) -> bytes:
    body = json.dumps({"error": f"this server holds its maximum of {max_connections} connections; "
                                "retry shortly"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))


def fit_descriptors(max_connections: int) -> int:
    """Raise this process's open-file limit to hold ``max_connections`` (up to the hard limit); the number
    of connections the limit then allows (``max_connections`` unless the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_HEADROOM
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    return max(1, min(max_connections, soft - FD_HEADROOM))
