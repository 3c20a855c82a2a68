"""The model gateway: one stable port on 127.0.0.1 in front of every endpoint's active version.

    python -m hybridflow.serving.router --state-root ROOT --port P [--max-body-mib MIB]
        [--request-timeout-s S] [--max-connections N]

``/v1/models/<endpoint>...`` is forwarded to the backend named by ``ROOT/<endpoint>/active.json``
(``{"version": ..., "url": "http://127.0.0.1:PORT"}``), re-read on every request, so a deployer
switches an endpoint's traffic by atomically replacing that file; the gateway holds no state. A
canary in that file (``"canary": {"version", "url", "percent"}``) takes that percent of the requests,
drawn at random per request; a ``"takeover"`` entry (``{"version", "url", ...}``, written while the
cluster serving stands for is declared down, :mod:`hybridflow.dr.failover.serving`) takes every
request, ahead of both. Every answer forwarded, or failed on the way, carries
``X-Model-Version`` of the backend it was sent to, so a client can attribute failures.
``GET /healthz`` answers for the gateway itself (``"router": true``, its state root, the endpoints
it knows with their active versions); an unknown endpoint gets 404 naming the known ones, an endpoint
without an active version 503.

It runs on uvicorn, one event loop, so an idle or slow client costs a connection, not a thread. Every
request is bounded as the model server bounds it: its request line and headers, and then its body, must
arrive within ``--request-timeout-s`` (else the connection is closed, or 408), a body over
``--max-body-mib`` gets 413 from its headers alone, and header blocks over h11's 16 KiB are refused.
At most ``--max-connections`` connections are open at once; one more is answered 503 and closed. A 5xx
names the endpoint and version but not the cause, which goes to the gateway's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hybridflow.serving.egress import FLUSH_S as EGRESS_FLUSH_S
from hybridflow.serving.egress import EgressCounter

HOST = "127.0.0.1"
ACTIVE_FILE = "active.json"
VERSIONS_DIR = "versions"
TAKEOVER = "takeover"  # the endpoint served on the disaster-recovery side while its cluster is down
MODELS_PREFIX = "/v1/models/"
FORWARD_TIMEOUT_S = 30.0  # a backend bounds its own answer (request_timeout_s); this outlasts it
# Bounds as the model server's defaults (serving.server: max_body_mib, request_timeout_s); a deploy
# passes the configured ones. A body the backends would refuse is not worth buffering here.
MAX_BODY_MIB = 8.0
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 4096  # open connections, idle ones included: far above what the load checks open
KEEPALIVE_S = 5.0  # an idle client connection is closed after this long
BACKEND_KEEPALIVE_S = 2.0  # an idle pooled connection to a backend is dropped before its 5 s idle close
# Endpoint names as the registry allows them; anything else can never name a folder under the root.
ENDPOINT_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class NoBackend(Exception):
    """Why a request has no backend: the exception's text for the log and callers, ``public`` for the
    client (no paths or addresses)."""

    def __init__(self, detail: str, public: str | None = None) -> None:
        super().__init__(detail)
        self.public = public or detail


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
        raise NoBackend(f"{where} names no http://127.0.0.1:PORT backend (url={url!r})",
                        f"the active version of {where.parent.name} names no backend the gateway may forward to; "
                        "deploy it again")
    return {"version": str(entry.get("version")), "host": parts.hostname, "port": port, "url": url}


def _read(state_dir: Path) -> Any:
    try:
        return json.loads((state_dir / ACTIVE_FILE).read_text())
    except FileNotFoundError as exc:
        raise NoBackend(f"no version of {state_dir.name} is active; deploy one") from exc
    except (OSError, ValueError) as exc:
        raise NoBackend(f"{state_dir / ACTIVE_FILE} is unreadable: {exc}",
                        f"the active version of {state_dir.name} cannot be read; deploy it again") from exc


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


def endpoint_of(path: str) -> str | None:
    """``/v1/models/<endpoint>[:verb|/...]`` -> endpoint; None for other paths."""
    if not path.startswith(MODELS_PREFIX):
        return None
    rest = path[len(MODELS_PREFIX):]
    return re.split(r"[:/]", rest, maxsplit=1)[0]




ROUTES = "GET /healthz, GET /v1/models, GET /v1/models/<endpoint>, POST /v1/models/<endpoint>:predict"
log = logging.getLogger("hybridflow.serving.router")


class Gateway:
    """The gateway's ASGI app: answers for itself and forwards model requests through ``client`` (an
    ``aiohttp.ClientSession``, set once the event loop runs). Run it inside
    :class:`~hybridflow.serving.bounds.Bounds`, which reads and bounds each request's body first."""

    def __init__(self, state_root: Path, client: Any = None) -> None:
        self.state_root = state_root
        self.client = client
        self.identity = {"router": True, "state_root": str(state_root), "pid": os.getpid()}
        self.egress = EgressCounter(state_root)  # bytes served out, per endpoint and version (quotas)

    def _endpoints(self) -> dict[str, str | None]:
        return {name: _active_version(self.state_root / name) for name in known_endpoints(self.state_root)}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # lifespan events: nothing to set up
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == "/healthz":
            await _send(send, 200, {**self.identity, "status": "ok", "endpoints": self._endpoints()})
            return
        if method == "GET" and path.rstrip("/") == "/v1/models":
            models = [{"name": n, "version": v} for n, v in self._endpoints().items()]
            await _send(send, 200, {"models": models})
            return
        target = path + (f"?{scope['query_string'].decode('latin-1')}" if scope["query_string"] else "")
        if method not in ("GET", "POST"):
            await _send(send, 405, {"error": f"no route {method} {target}; use {ROUTES}"},
                        headers=[(b"allow", b"GET, POST")])
            return
        endpoint = endpoint_of(path)
        if endpoint is None:
            await _send(send, 404, {"error": f"no route {method} {target}; use {ROUTES}"})
            return
        known = known_endpoints(self.state_root)
        if endpoint not in known:
            await _send(send, 404, {"error": f"no endpoint {endpoint!r} on this gateway; known endpoints: "
                                             f"{', '.join(known) or 'none (deploy a model first)'}"})
            return
        body = (await receive()).get("body", b"") if method == "POST" else None  # Bounds read it already
        await self._forward(send, method, endpoint, target, body, dict(scope["headers"]).get(b"content-type"))

    async def _forward(self, send: Callable, method: str, endpoint: str, target: str, body: bytes | None,
                       content_type: bytes | None) -> None:
        import aiohttp

        try:
            backend = pick_backend(self.state_root / endpoint)
        except NoBackend as exc:
            if exc.public != str(exc):
                log.warning("%s: %s", endpoint, exc)
            await _send(send, 503, {"error": exc.public})
            return
        version = backend["version"]
        headers = {"content-type": content_type.decode("latin-1")} if content_type else {}
        try:
            async with self.client.request(method, backend["url"] + target, data=body, headers=headers) as resp:
                status, data = resp.status, await resp.read()
                answered_by, answer_type = resp.headers.get("X-Model-Version"), resp.headers.get("Content-Type")
        except TimeoutError as exc:
            log.warning("%s version %s at %s did not answer within %g s: %r", endpoint, version, backend["url"],
                        FORWARD_TIMEOUT_S, exc)
            await _send(send, 504, {"error": f"{endpoint} version {version} did not answer within "
                                             f"{FORWARD_TIMEOUT_S:g} s"}, version)
            return
        except aiohttp.ClientError as exc:
            log.warning("%s version %s at %s failed: %r", endpoint, version, backend["url"], exc)
            await _send(send, 502, {"error": f"{endpoint} version {version} did not answer; the gateway's log "
                                             "has the cause"}, version)
            return
        await _send(send, status, data, answered_by or version, content_type=answer_type or "application/json")
        self.egress.add(endpoint, answered_by or version, len(data))


async def _send(send: Callable, status: int, body: dict[str, Any] | bytes, version: str | None = None, *,
                content_type: str = "application/json", headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [(b"content-type", content_type.encode("latin-1")), (b"content-length", str(len(data)).encode()),
            *headers]
    if version:
        head.append((b"x-model-version", version.encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


def build_server(state_root: Path, *, max_body_mib: float = MAX_BODY_MIB, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> tuple[Any, Gateway]:
    """(the uvicorn server of the gateway for ``state_root``, its app, whose client :func:`_serve` opens)."""
    import uvicorn

    from hybridflow.serving.bounds import Bounds
    from hybridflow.serving.listen import protocol

    gateway = Gateway(state_root)
    app = Bounds(gateway, version=None, max_body_bytes=int(max_body_mib * 2**20), timeout_s=request_timeout_s,
                 bound_answer=False)
    # h11 rather than httptools: it caps a request's header block (16 KiB), which llhttp does not.
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=3,
                            http=protocol(request_timeout_s, max_connections=max_connections, parser="h11"),
                            timeout_keep_alive=KEEPALIVE_S, backlog=min(max_connections, 4096))
    return uvicorn.Server(config), gateway


async def _serve(server: Any, gateway: Gateway, sock: socket.socket, on_ready: Callable[[], None]) -> None:
    import aiohttp

    # Pooled connections to the backends (aiohttp: a third of httpx's time per forwarded request here),
    # no proxies from the environment (backends are loopback only).
    # No pool limit of its own (0): requests in flight are already bounded by the gateway's connection cap.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=BACKEND_KEEPALIVE_S)
    async with aiohttp.ClientSession(connector=connector, trust_env=False,
                                     timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)) as gateway.client:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            on_ready()
        flusher = asyncio.create_task(_flush_egress(gateway.egress))
        try:
            await task
        finally:
            flusher.cancel()
            gateway.egress.flush()  # what the last second served is not lost when the gateway stops


async def _flush_egress(counter: EgressCounter) -> None:
    while True:
        await asyncio.sleep(EGRESS_FLUSH_S)
        try:
            counter.flush()
        except OSError as exc:  # a full disk must not stop the serving: the counts wait for the next flush
            log.warning("cannot write the egress counts under %s: %r", counter.state_root, exc)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.serving.router", description=__doc__.split("\n")[0])
    parser.add_argument("--state-root", type=Path, required=True, help="folder holding <endpoint>/active.json")
    parser.add_argument("--port", type=int, required=True, help="stable port on 127.0.0.1")
    parser.add_argument("--max-body-mib", type=float, default=MAX_BODY_MIB, help="request body size, at most")
    parser.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S,
                        help="the request line and headers, then the body, must arrive within this")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, help="open connections, at most")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag, value in (("--max-body-mib", args.max_body_mib), ("--request-timeout-s", args.request_timeout_s),
                        ("--max-connections", args.max_connections)):
        if not value > 0:
            print(f"{flag} {value} must be above 0", file=sys.stderr)
            return 2
    state_root = args.state_root.resolve()
    from hybridflow.serving.listen import fit_descriptors

    max_connections = fit_descriptors(args.max_connections)
    if max_connections < args.max_connections:
        print(f"the open-file limit allows {max_connections} connections, not {args.max_connections}; raise it "
              "(ulimit -Hn) for more", file=sys.stderr)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, args.port))
    except OSError as exc:
        sock.close()
        print(f"cannot listen on {HOST}:{args.port}: {exc}", file=sys.stderr)
        return 2

    def ready() -> None:
        print(f"gateway http://{HOST}:{args.port}{MODELS_PREFIX}<endpoint> -> {state_root}/<endpoint>/{ACTIVE_FILE}",
              file=sys.stderr, flush=True)

    from hybridflow.signals import stop_on_signals

    # uvicorn stops gracefully on SIGTERM/SIGINT, then hands the signal to the handler it found: this one
    # ends the process with status 0 (also when started with SIGINT ignored, from a background shell).
    stop_on_signals()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # its start-up lines say nothing the log needs
    server, gateway = build_server(state_root, max_body_mib=args.max_body_mib,
                                   request_timeout_s=args.request_timeout_s, max_connections=max_connections)
    try:
        # uvicorn's choice of event loop: uvloop where installed.
        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
            runner.run(_serve(server, gateway, sock, ready))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
