"""The model gateway: one stable port on 127.0.0.1 in front of every endpoint's active version.

    python -m hybridflow.serving.router --state-root ROOT --port P

``/v1/models/<endpoint>...`` is forwarded to the backend named by ``ROOT/<endpoint>/active.json``
(``{"version": ..., "url": "http://127.0.0.1:PORT"}``), re-read on every request, so a deployer
switches an endpoint's traffic by atomically replacing that file; the gateway holds no state. A
canary in that file (``"canary": {"version", "url", "percent"}``) takes that percent of the requests,
drawn at random per request; a ``"takeover"`` entry (``{"version", "url", ...}``, written while the
cluster serving stands for is declared down, :mod:`hybridflow.dr.serving_failover`) takes every
request, ahead of both. Every answer forwarded, or failed on the way, carries
``X-Model-Version`` of the backend it was sent to, so a client can attribute failures.
``GET /healthz`` answers for the gateway itself (``"router": true``, its state root, the endpoints
it knows with their active versions); an unknown endpoint gets 404 naming the known ones, an endpoint
without an active version 503.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import sys
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

HOST = "127.0.0.1"
ACTIVE_FILE = "active.json"
VERSIONS_DIR = "versions"
TAKEOVER = "takeover"  # the endpoint served on the disaster-recovery side while its cluster is down
MODELS_PREFIX = "/v1/models/"
FORWARD_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 64 * 1024 * 1024  # the backend applies its own, signature-sized limit
# Endpoint names as the registry allows them; anything else can never name a folder under the root.
ENDPOINT_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class NoBackend(Exception):
    pass


def known_endpoints(state_root: Path) -> list[str]:
    """Endpoints something was ever deployed to under ``state_root``."""
    try:
        entries = list(state_root.iterdir())
    except OSError:
        return []
    return sorted(p.name for p in entries
                  if ENDPOINT_RE.match(p.name) and ((p / VERSIONS_DIR).is_dir() or (p / ACTIVE_FILE).is_file()))


def _backend(entry: Any, where: Path) -> dict[str, Any]:
    """A loopback backend named in ``where`` (``{"version", "url"}``), or NoBackend saying why not."""
    url = entry.get("url") if isinstance(entry, dict) else None
    parts = urlsplit(url) if isinstance(url, str) else None
    # Only loopback backends: active.json must never turn the gateway into an open proxy.
    try:
        port = parts.port if parts else None
    except ValueError:
        port = None
    if not parts or parts.scheme != "http" or parts.hostname != HOST or not port:
        raise NoBackend(f"{where} names no http://127.0.0.1:PORT backend (url={url!r})")
    return {"version": str(entry.get("version")), "host": parts.hostname, "port": port, "url": url}


def _read(state_dir: Path) -> Any:
    try:
        return json.loads((state_dir / ACTIVE_FILE).read_text())
    except FileNotFoundError as exc:
        raise NoBackend(f"no version of {state_dir.name} is active; deploy one") from exc
    except (OSError, ValueError) as exc:
        raise NoBackend(f"{state_dir / ACTIVE_FILE} is unreadable: {exc}") from exc


def canary_share(active: Any) -> float:
    """The canary's percent of the requests in an active.json body (0 without a canary)."""
    canary = active.get("canary") if isinstance(active, dict) else None
    percent = canary.get("percent") if isinstance(canary, dict) else None
    if isinstance(percent, bool) or not isinstance(percent, int | float):
        return 0.0
    return min(max(float(percent), 0.0), 100.0)


def read_active(state_dir: Path) -> dict[str, Any]:
    """The endpoint's stable backend, or NoBackend saying why there is none."""
    return _backend(_read(state_dir), state_dir / ACTIVE_FILE)


def pick_backend(state_dir: Path, draw: float | None = None) -> dict[str, Any]:
    """The backend for one request: the takeover backend when there is one (every request), else the
    canary with its percent's chance, else the stable one. ``draw`` in [0, 100) replaces the random draw."""
    active = _read(state_dir)
    takeover = active.get(TAKEOVER) if isinstance(active, dict) else None
    if isinstance(takeover, dict):
        return _backend(takeover, state_dir / ACTIVE_FILE)
    share = canary_share(active)
    draw = random.uniform(0.0, 100.0) if draw is None else draw
    if share > 0 and draw < share:
        return _backend(active["canary"], state_dir / ACTIVE_FILE)
    return _backend(active, state_dir / ACTIVE_FILE)


def _active_version(state_dir: Path) -> str | None:
    try:
        return read_active(state_dir)["version"]
    except NoBackend:
        return None


def forward(backend: dict[str, Any], method: str, path: str, body: bytes | None, content_type: str | None,
            timeout: float = FORWARD_TIMEOUT_S) -> tuple[int, bytes, str, str | None]:
    conn = http.client.HTTPConnection(backend["host"], backend["port"], timeout=timeout)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return (resp.status, resp.read(), resp.getheader("Content-Type", "application/json"),
                resp.getheader("X-Model-Version"))
    finally:
        conn.close()


def endpoint_of(path: str) -> str | None:
    """``/v1/models/<endpoint>[:verb|/...]`` -> endpoint; None for other paths."""
    if not path.startswith(MODELS_PREFIX):
        return None
    rest = path[len(MODELS_PREFIX):]
    return re.split(r"[:/]", rest, maxsplit=1)[0]


ROUTES = "GET /healthz, GET /v1/models, GET /v1/models/<endpoint>, POST /v1/models/<endpoint>:predict"


class GatewayHandler(BaseHTTPRequestHandler):
    """Answers for the gateway and forwards model requests; :func:`make_handler` binds its state root."""

    server_version = "hybridflow-gateway/1"
    protocol_version = "HTTP/1.1"
    # Keep-alive answers go out whole: with Nagle on, a body written after its headers waits for the
    # client's delayed ACK (about 40 ms a request).
    disable_nagle_algorithm = True
    state_root: ClassVar[Path]
    identity: ClassVar[dict[str, Any]]

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

    def _endpoints(self) -> dict[str, str | None]:
        return {name: _active_version(self.state_root / name) for name in known_endpoints(self.state_root)}

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering why it cannot be read."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.close_connection = True  # the body's extent is unknown, so the connection cannot be reused
            self._json(411, {"error": "a valid Content-Length header is required"})
            return None
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._json(413, {"error": f"body is {length} bytes; at most {MAX_BODY_BYTES}"})
            return None
        return self.rfile.read(length)

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        if method == "GET" and path == "/healthz":
            self._json(200, {**self.identity, "status": "ok", "endpoints": self._endpoints()})
            return
        if method == "GET" and path.rstrip("/") == "/v1/models":
            self._json(200, {"models": [{"name": n, "version": v} for n, v in self._endpoints().items()]})
            return
        endpoint = endpoint_of(path)
        body = self._read_body() if method == "POST" else None
        if method == "POST" and body is None:
            return
        if endpoint is None:
            self._json(404, {"error": f"no route {method} {self.path}; use {ROUTES}"})
            return
        known = known_endpoints(self.state_root)
        if endpoint not in known:
            self._json(404, {"error": f"no endpoint {endpoint!r} on this gateway; known endpoints: "
                                      f"{', '.join(known) or 'none (deploy a model first)'}"})
            return
        self._forward(method, endpoint, body)

    def _forward(self, method: str, endpoint: str, body: bytes | None) -> None:
        try:
            backend = pick_backend(self.state_root / endpoint)
        except NoBackend as exc:
            self._json(503, {"error": str(exc)})
            return
        try:
            status, data, ctype, version = forward(backend, method, self.path, body,
                                                   self.headers.get("Content-Type"))
        except (OSError, http.client.HTTPException) as exc:
            self._json(502, {"error": f"{endpoint} version {backend['version']} at {backend['url']} "
                                      f"did not answer: {exc}"}, backend["version"])
            return
        self._send(status, data, ctype, version or backend["version"])

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        # Successful requests are the load check's hundreds of lines; keep the log for problems.
        if isinstance(code, int) and code < 400:
            return
        super().log_request(code, size)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def make_handler(state_root: Path) -> type[BaseHTTPRequestHandler]:
    identity = {"router": True, "state_root": str(state_root), "pid": os.getpid()}
    return type("Handler", (GatewayHandler,), {"state_root": state_root, "identity": identity})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.serving.router", description=__doc__.split("\n")[0])
    parser.add_argument("--state-root", type=Path, required=True, help="folder holding <endpoint>/active.json")
    parser.add_argument("--port", type=int, required=True, help="stable port on 127.0.0.1")
    args = parser.parse_args(argv)
    state_root = args.state_root.resolve()
    try:
        server = ThreadingHTTPServer((HOST, args.port), make_handler(state_root))
    except OSError as exc:
        print(f"cannot listen on {HOST}:{args.port}: {exc}", file=sys.stderr)
        return 2
    server.daemon_threads = True
    print(f"gateway http://{HOST}:{args.port}{MODELS_PREFIX}<endpoint> -> {state_root}/<endpoint>/{ACTIVE_FILE}",
          file=sys.stderr, flush=True)
    from hybridflow.signals import stop_on_signals

    stop_on_signals()  # also when started with SIGINT ignored (a background shell)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
