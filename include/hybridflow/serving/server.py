"""One model version behind a small HTTP API (on 127.0.0.1 unless --host says otherwise).

    python -m hybridflow.serving.server --model PATH --variant int8|fp16|fp32 --version V --port P

- ``GET /healthz`` -> ``{"status": "ok", "version": V, "variant": ...}``
- ``POST /predict`` ``{"instances": [[64 raw pixel values 0..16], ...]}`` ->
  ``{"predictions": [int, ...], "version": V}``; bad input gets 400 with ``{"error": ...}``.

``--port 0`` binds a free port; with ``--ready-file`` the bound port and pid are written there
(atomically) once the model is loaded and the socket listens, so a deployer never races for a port.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

HOST = "127.0.0.1"
N_PIXELS = 64
PIXEL_MAX = 16.0
MAX_INSTANCES = 1024
MAX_BODY_BYTES = 4 * 1024 * 1024  # ~1024 rows of 64 numbers with generous formatting


class BadRequest(ValueError):
    """Input the client must fix; the message is returned as the 400 body."""


def parse_instances(payload: Any) -> np.ndarray:
    """Validate a /predict body and return raw pixels as float32 [n, 64]."""
    if not isinstance(payload, dict) or "instances" not in payload:
        raise BadRequest('body must be a JSON object {"instances": [[64 pixel values 0..16], ...]}')
    rows = payload["instances"]
    if not isinstance(rows, list) or not rows:
        raise BadRequest('"instances" must be a non-empty list of rows')
    if len(rows) > MAX_INSTANCES:
        raise BadRequest(
            f'"instances" has {len(rows)} rows; at most {MAX_INSTANCES} per request, split the batch'
        )
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != N_PIXELS:
            got = f"{len(row)} values" if isinstance(row, list) else type(row).__name__
            raise BadRequest(f"instances[{i}] must be a list of {N_PIXELS} pixel values, got {got}")
        for j, value in enumerate(row):
            # bool is an int subclass; true/false are not pixel values.
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise BadRequest(f"instances[{i}][{j}] = {value!r} is not a number")
            if not 0 <= value <= PIXEL_MAX:
                raise BadRequest(f"instances[{i}][{j}] = {value!r} is outside the pixel range 0..16")
    return np.asarray(rows, dtype=np.float32)


def make_handler(predict, version: str, variant: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "hybridflow-model/1"
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Model-Version", version)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if self.path.split("?", 1)[0] == "/healthz":
                self._reply(200, {"status": "ok", "version": version, "variant": variant, "pid": os.getpid()})
            else:
                self._reply(404, {"error": f"no route GET {self.path}; use GET /healthz or POST /predict"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.split("?", 1)[0] != "/predict":
                self._reply(404, {"error": f"no route POST {self.path}; use POST /predict"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
                if length < 0:
                    raise ValueError(length)
            except ValueError:
                self.close_connection = (
                    True  # the body's extent is unknown, so the connection cannot be reused
                )
                self._reply(411, {"error": "a valid Content-Length header is required"})
                return
            if length > MAX_BODY_BYTES:
                self.close_connection = True  # the unread body would poison a kept-alive connection
                self._reply(413, {"error": f"body is {length} bytes; at most {MAX_BODY_BYTES}"})
                return
            raw = self.rfile.read(length)
            try:
                try:
                    payload = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise BadRequest(f"body is not valid JSON: {exc}") from exc
                pixels = parse_instances(payload)
            except BadRequest as exc:
                self._reply(400, {"error": str(exc), "version": version})
                return
            try:
                labels = predict(pixels / PIXEL_MAX)  # the model was trained on pixel/16
            except Exception as exc:  # keep serving; the client sees why
                self._reply(500, {"error": f"prediction failed: {exc}", "version": version})
                return
            self._reply(200, {"predictions": [int(v) for v in labels], "version": version})

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            # Successful requests are the load check's hundreds of lines; keep the log for problems.
            if isinstance(code, int) and code < 400:
                return
            super().log_request(code, size)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            # One line per request to the log file the deployer points stderr at.
            sys.stderr.write(f"{self.address_string()} {format % args}\n")

    return Handler


def build_server(model: Path, variant: str, version: str, port: int, host: str = HOST) -> ThreadingHTTPServer:
    from hybridflow.compression import load_compressed

    predict = load_compressed(model, variant)
    server = ThreadingHTTPServer((host, port), make_handler(predict, version, variant))
    server.daemon_threads = True
    return server


def _write_ready(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridflow.serving.server", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", type=Path, required=True, help="model artefact (state dict of the variant)"
    )
    parser.add_argument("--variant", choices=("int8", "fp16", "fp32"), required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--port", type=int, required=True, help="port to listen on; 0 picks a free one")
    # Loopback on this machine; a pod listens on all its interfaces so its Service can reach it.
    parser.add_argument("--host", default=HOST, help=f"address to bind (default {HOST}; 0.0.0.0 in a pod)")
    parser.add_argument("--ready-file", type=Path, help="write {pid, port, version} here once serving")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # many small requests on few cores: intra-op threads only add contention
    try:
        server = build_server(args.model, args.variant, args.version, args.port, args.host)
    except (OSError, ValueError) as exc:
        print(f"cannot serve {args.model} as {args.variant} version {args.version}: {exc}", file=sys.stderr)
        return 2
    port = server.server_address[1]
    if args.ready_file:
        _write_ready(args.ready_file, {"pid": os.getpid(), "port": port, "version": args.version})
    print(
        f"serving version {args.version} ({args.variant}) on http://{args.host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
