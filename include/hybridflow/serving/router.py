"""The stable endpoint: forwards every request to the active model version.

    python -m hybridflow.serving.router --state-dir D --port P

``D/active.json`` (``{"version": ..., "url": "http://127.0.0.1:PORT"}``) is re-read on every request,
so a deployer switches traffic by atomically replacing that file; the router holds no state.
``GET /healthz`` answers for the router itself (``"router": true``, its state dir) and reports the
active version; 503 with a JSON error while there is no usable backend.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HOST = "127.0.0.1"
ACTIVE_FILE = "active.json"
FORWARD_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 3.0
MAX_BODY_BYTES = 8 * 1024 * 1024


class NoBackend(Exception):
    pass


def read_active(state_dir: Path) -> dict[str, Any]:
    """The active backend, or NoBackend saying why there is none."""
    try:
        active = json.loads((state_dir / ACTIVE_FILE).read_text())
    except FileNotFoundError as exc:
        raise NoBackend("no model version is active on this endpoint yet; deploy one") from exc
    except (OSError, ValueError) as exc:
        raise NoBackend(f"{state_dir / ACTIVE_FILE} is unreadable: {exc}") from exc
    url = active.get("url") if isinstance(active, dict) else None
    parts = urlsplit(url) if isinstance(url, str) else None
    # Only loopback backends: active.json must never turn the router into an open proxy.
    if not parts or parts.scheme != "http" or parts.hostname != HOST or not parts.port:
        raise NoBackend(f"{state_dir / ACTIVE_FILE} names no http://127.0.0.1:PORT backend (url={url!r})")
    return {"version": str(active.get("version")), "host": parts.hostname, "port": parts.port, "url": url}


def forward(
    backend: dict[str, Any],
    method: str,
    path: str,
    body: bytes | None,
    content_type: str | None,
    timeout: float = FORWARD_TIMEOUT_S,
) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection(backend["host"], backend["port"], timeout=timeout)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type", "application/json")
    finally:
        conn.close()


def make_handler(state_dir: Path) -> type[BaseHTTPRequestHandler]:
    identity = {"router": True, "state_dir": str(state_dir), "pid": os.getpid()}

    class Handler(BaseHTTPRequestHandler):
        server_version = "hybridflow-router/1"
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, data: bytes, content_type: str, version: str | None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if version:
                self.send_header("X-Model-Version", version)
            self.end_headers()
            self.wfile.write(data)

        def _json(self, status: int, body: dict[str, Any], version: str | None = None) -> None:
            self._send(status, json.dumps(body).encode(), "application/json", version)

        def _healthz(self) -> None:
            try:
                backend = read_active(state_dir)
            except NoBackend as exc:
                self._json(503, {**identity, "status": "no_backend", "error": str(exc)})
                return
            body = {**identity, "version": backend["version"], "backend": backend["url"]}
            try:
                status, data, _ = forward(backend, "GET", "/healthz", None, None, timeout=HEALTH_TIMEOUT_S)
                healthy = status == 200 and json.loads(data).get("version") == backend["version"]
            except (OSError, ValueError, http.client.HTTPException):
                healthy = False
            if healthy:
                self._json(200, {**body, "status": "ok"}, backend["version"])
            else:
                self._json(
                    503,
                    {
                        **body,
                        "status": "backend_unavailable",
                        "error": f"active version {backend['version']} at {backend['url']} is not healthy",
                    },
                )

        def _proxy(self, method: str) -> None:
            body = None
            if method == "POST":
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    if length < 0:
                        raise ValueError(length)
                except ValueError:
                    self.close_connection = (
                        True  # the body's extent is unknown, so the connection cannot be reused
                    )
                    self._json(411, {"error": "a valid Content-Length header is required"})
                    return
                if length > MAX_BODY_BYTES:
                    self.close_connection = True
                    self._json(413, {"error": f"body is {length} bytes; at most {MAX_BODY_BYTES}"})
                    return
                body = self.rfile.read(length)
            try:
                backend = read_active(state_dir)
            except NoBackend as exc:
                self._json(503, {"error": str(exc)})
                return
            try:
                status, data, ctype = forward(
                    backend, method, self.path, body, self.headers.get("Content-Type")
                )
            except (OSError, http.client.HTTPException) as exc:
                self._json(
                    502,
                    {
                        "error": f"active version {backend['version']} at {backend['url']} "
                        f"did not answer: {exc}"
                    },
                    backend["version"],
                )
                return
            self._send(status, data, ctype, backend["version"])

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if self.path.split("?", 1)[0] == "/healthz":
                self._healthz()
            else:
                self._proxy("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._proxy("POST")

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            # Successful requests are the load check's hundreds of lines; keep the log for problems.
            if isinstance(code, int) and code < 400:
                return
            super().log_request(code, size)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridflow.serving.router", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--state-dir", type=Path, required=True, help="endpoint folder holding active.json")
    parser.add_argument("--port", type=int, required=True, help="stable port on 127.0.0.1")
    args = parser.parse_args(argv)
    state_dir = args.state_dir.resolve()
    try:
        server = ThreadingHTTPServer((HOST, args.port), make_handler(state_dir))
    except OSError as exc:
        print(f"cannot listen on {HOST}:{args.port}: {exc}", file=sys.stderr)
        return 2
    server.daemon_threads = True
    print(f"routing http://{HOST}:{args.port} -> {state_dir / ACTIVE_FILE}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
