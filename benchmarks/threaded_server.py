"""The model server as it was before the KServe one: ``http.server.ThreadingHTTPServer``, a thread per
connection, one forward pass per request, Nagle left on. Kept only as the reference
``benchmarks/serving.py`` measures the KServe server against, in the same run; it checks requests
with the model server's own input schema.

    python benchmarks/threaded_server.py --bundle DIR --endpoint NAME --version V --port P [--ready-file F]

- ``GET /healthz`` -> ``{"status": "ok", "endpoint", "version", "variant", "model", "pid"}``
- ``GET /v1/models/<endpoint>`` -> ``{"name", "ready": true, "version", "inputs": [names], "output": {...}}``
- ``POST /v1/models/<endpoint>:predict`` ``{"instances": [row, ...]}``, each row either a list of
  values in the signature's input order or an object ``{column: value}`` with exactly the input
  columns -> ``{"predictions": [...], "model": endpoint, "version": V}``. Every value is checked
  against the bundle's signature (type, finite, whole for int inputs, min/max); a bad request gets
  400 with ``{"error": ...}`` naming the instance, the column and the fix.

``--port 0`` binds a free port; with ``--ready-file`` the bound port and pid are written there
(atomically) once the model is loaded and the socket listens, so a deployer never races for a port.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

from hybridflow.serving.schema import MAX_INSTANCES, BadRequest
from hybridflow.serving.schema import InputSchema as _Schema

HOST = "127.0.0.1"
MIN_BODY_BYTES = 4 * 1024 * 1024
BODY_BYTES_PER_VALUE = 64  # a value, its JSON punctuation and (object form) its column name
MODELS_PREFIX = "/v1/models/"


class InputSchema(_Schema):
    """The signature's input columns (the model server's own check), with the old server's body limit."""

    @property
    def max_body_bytes(self) -> int:
        return max(MIN_BODY_BYTES, MAX_INSTANCES * self.width * BODY_BYTES_PER_VALUE)


def routes(endpoint: str) -> str:
    return f"GET /healthz, GET {MODELS_PREFIX}{endpoint}, POST {MODELS_PREFIX}{endpoint}:predict"


class ModelHandler(BaseHTTPRequestHandler):
    """Health, metadata and predictions of one model version; :func:`make_handler` binds the model."""

    server_version = "hybridflow-model/1"
    protocol_version = "HTTP/1.1"
    predictor: ClassVar[Any]
    schema: ClassVar[InputSchema]
    endpoint: ClassVar[str]
    version: ClassVar[str]
    health: ClassVar[dict[str, Any]]
    metadata: ClassVar[dict[str, Any]]
    to_json: ClassVar[Callable[[Any, Any], list[Any]]]

    @property
    def model_path(self) -> str:
        return f"{MODELS_PREFIX}{self.endpoint}"

    @property
    def predict_path(self) -> str:
        return f"{self.model_path}:predict"

    def _reply(self, status: int, body: dict[str, Any], allow: str | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Model-Version", self.version)
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        self.wfile.write(data)

    def _no_route(self) -> None:
        if self.command == "POST":
            self.close_connection = True  # its body is left unread
        self._reply(404, {"error": f"no route {self.command} {self.path}; use {routes(self.endpoint)}"})

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._reply(200, self.health)
        elif path == self.model_path:
            self._reply(200, self.metadata)
        elif path == self.predict_path:
            self._reply(405, {"error": f"use POST {self.predict_path}"}, allow="POST")
        else:
            self._no_route()

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering why it cannot be read."""
        try:
            length = int(self.headers.get("Content-Length", ""))
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.close_connection = True  # the body's extent is unknown, so the connection cannot be reused
            self._reply(411, {"error": "a valid Content-Length header is required"})
            return None
        if length > self.schema.max_body_bytes:
            self.close_connection = True  # the unread body would poison a kept-alive connection
            self._reply(413, {"error": f"body is {length} bytes; at most {self.schema.max_body_bytes}, "
                                       "split the batch"})
            return None
        return self.rfile.read(length)

    def do_POST(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] != self.predict_path:
            self._no_route()
            return
        raw = self._read_body()
        if raw is None:
            return
        endpoint, version, card = self.endpoint, self.version, self.predictor.card
        try:
            try:
                payload = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise BadRequest(f"body is not valid JSON: {exc}") from exc
            x = self.schema.parse(payload)
        except BadRequest as exc:
            self._reply(400, {"error": str(exc), "model": endpoint, "version": version})
            return
        try:
            predictions = self.to_json(self.predictor.predict(x), card.output)
        except Exception as exc:  # keep serving; the client sees why
            self.log_error("prediction failed: %r", exc)
            self._reply(500, {"error": f"prediction failed: {exc}", "model": endpoint, "version": version})
            return
        self._reply(200, {"predictions": predictions, "model": endpoint, "version": version})

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        # Successful requests are the load check's hundreds of lines; keep the log for problems.
        if isinstance(code, int) and code < 400:
            return
        super().log_request(code, size)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        # One line per request to the log file the deployer points stderr at.
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def make_handler(predictor: Any, endpoint: str, version: str) -> type[BaseHTTPRequestHandler]:
    """``predictor``: a :class:`hybridflow.bundle.Predictor` (``card``, ``predict``)."""
    from hybridflow import scoring

    card = predictor.card
    schema = InputSchema(card.signature)
    health = {"status": "ok", "endpoint": endpoint, "version": version, "variant": card.variant,
              "model": card.model, "pid": os.getpid()}
    metadata = {"name": endpoint, "ready": True, "version": version, "inputs": schema.names,
                "output": card.output}
    return type("Handler", (ModelHandler,), {
        "predictor": predictor, "schema": schema, "endpoint": endpoint, "version": version, "health": health,
        "metadata": metadata, "to_json": staticmethod(scoring.to_json),
    })


def build_server(bundle_dir: Path, endpoint: str, version: str, port: int, host: str = HOST) -> ThreadingHTTPServer:
    from hybridflow.bundle import Predictor

    predictor = Predictor.load(bundle_dir)
    server = ThreadingHTTPServer((host, port), make_handler(predictor, endpoint, version))
    server.daemon_threads = True
    return server


def _write_ready(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/threaded_server.py", description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="model bundle folder (model.json + weights.pt)")
    parser.add_argument("--endpoint", required=True, help="served at /v1/models/<endpoint>")
    parser.add_argument("--version", required=True)
    parser.add_argument("--port", type=int, required=True, help="port to listen on; 0 picks a free one")
    # Loopback on this machine; a pod listens on all its interfaces so its Service can reach it.
    parser.add_argument("--host", default=HOST, help=f"address to bind (default {HOST}; 0.0.0.0 in a pod)")
    parser.add_argument("--ready-file", type=Path, help="write {pid, port, endpoint, version} here once serving")
    args = parser.parse_args(argv)

    import torch

    from hybridflow.config.registry import EntrypointError

    torch.set_num_threads(1)  # many small requests on few cores: intra-op threads only add contention
    try:
        server = build_server(args.bundle, args.endpoint, args.version, args.port, args.host)
    except (OSError, ValueError, TypeError, EntrypointError) as exc:
        print(f"cannot serve {args.bundle} as {args.endpoint} version {args.version}: {exc}", file=sys.stderr)
        return 2
    port = server.server_address[1]
    if args.ready_file:
        _write_ready(args.ready_file, {"pid": os.getpid(), "port": port, "endpoint": args.endpoint,
                                       "version": args.version})
    print(f"serving {args.endpoint} version {args.version} on http://{args.host}:{port}{MODELS_PREFIX}"
          f"{args.endpoint}", file=sys.stderr, flush=True)
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
