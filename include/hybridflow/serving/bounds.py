"""The model server's outer ASGI layer, around KServe's app: the body limit, the request timeout and
the ``X-Model-Version`` header on every answer, and the predict route answered directly (without the
framework's routing and middleware, a quarter of the event loop's time at 64 concurrent clients)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any


def _json(status: int, body: dict[str, Any], extra: Sequence[tuple[bytes, bytes]] = ()) -> tuple[dict, dict]:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *extra]
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": data})


class Bounds:
    """ASGI middleware around the whole app: the body limit, the request timeout and the version header.

    A POST's body is read here first (so its size and the time it takes are bounded before any route
    sees it) and handed on whole. ``direct`` maps a POST path to a handler ``(body, headers) ->
    (status, JSON body)`` answered here without the framework's routing and middleware: the predict
    route, where they took a tenth of the server's time at 64 concurrent clients."""

    def __init__(self, app: Any, *, version: str | None, max_body_bytes: int, timeout_s: float,
                 direct: dict[str, Callable[[bytes, dict], Any]] | None = None, bound_answer: bool = True) -> None:
        """``version``: the ``X-Model-Version`` of every answer (None: the app sets its own);
        ``bound_answer``: False bounds only the reading of the request by ``timeout_s``, for an app that
        bounds its answer itself (the gateway, waiting for a backend)."""
        self.app = app
        self.version = version.encode() if version is not None else None
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.direct = direct or {}
        self.bound_answer = bound_answer

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_versioned(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.version is not None:
                    message = {**message, "headers": [*message.get("headers", []), (b"x-model-version", self.version)]}
            await send(message)

        async def answer(status: int, error: str) -> None:
            if not started:  # else the client already has a status; the connection is closed instead
                for message in _json(status, {"error": error}, [(b"connection", b"close")]):
                    await send_versioned(message)

        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                if scope["method"] in ("POST", "PUT", "PATCH"):
                    body = await self._read_body(scope, receive, answer)
                    if body is None:
                        return
                    receive = _replay(body, receive)
                if not self.bound_answer:
                    deadline.reschedule(None)
                if scope["method"] == "POST":
                    handler = self.direct.get(scope["path"])
                    if handler is not None:
                        status, payload = await handler(body, scope["headers"])
                        for message in _json(status, payload):
                            await send_versioned(message)
                        return
                await self.app(scope, receive, send_versioned)
        except TimeoutError:
            await answer(408, f"the request took longer than {self.timeout_s:g} s (request_timeout_s); "
                              "send the whole body at once, or fewer instances")

    async def _read_body(self, scope: dict, receive: Callable, answer: Callable) -> bytes | None:
        """The whole body, or None after answering why it will not be read."""
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        limit = self.max_body_bytes
        too_big = f"at most {limit} bytes (max_body_mib) per request; split the batch"
        if length is None and b"chunked" not in headers.get(b"transfer-encoding", b""):
            await answer(411, "a valid Content-Length header is required")
            return None
        if length is not None:
            # Digits only, and few of them: int() of thousands of digits is refused (and slow).
            if not length.isdigit() or len(length) > 18:
                await answer(400, "Content-Length must be the body's size in bytes")
                return None
            if int(length) > limit:
                await answer(413, f"body is {int(length)} bytes; {too_big}")
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await answer(413, f"body is over {limit} bytes; {too_big}")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect

    return replay
