"""One model version from a model bundle, served by KServe's ModelServer (on 127.0.0.1 unless --host says
otherwise). It runs in the model server's own environment (``hybridflow.serving.runtime.serve_python()``):

    python -m hybridflow.serving.server --bundle DIR --endpoint NAME --version V --port P
        [--host H] [--ready-file F] [--max-batch-size N] [--max-batch-wait-ms MS] [--max-instances N]
        [--max-body-mib MIB] [--request-timeout-s S]

- ``GET /healthz`` -> ``{"status": "ok", "ready": true, "endpoint", "version", "variant", "model", "pid"}``;
  503 with ``"status": "not ready"`` while the model is not ready (KServe's ``Model.ready``)
- ``GET /v1/models/<endpoint>`` -> ``{"name", "ready", "version", "inputs": [names], "output": {...}}``
- ``POST /v1/models/<endpoint>:predict`` ``{"instances": [row, ...]}``, each row either a list of
  values in the signature's input order or an object ``{column: value}`` with exactly the input
  columns -> ``{"predictions": [...], "model": endpoint, "version": V}``. Every value is checked
  against the bundle's signature (:mod:`hybridflow.serving.schema`); a bad request gets 400 with
  ``{"error": ...}`` naming the instance, the column and the fix.
- KServe's own routes: ``GET /`` (liveness), ``GET /metrics`` (Prometheus, with the batch sizes),
  ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2/models/<endpoint>[/ready]`` and
  ``POST /v2/models/<endpoint>/infer`` (the open inference protocol; one FP32 input of ``[n, width]``).
  KServe's model repository extension (``/v2/repository/...``: load and unload, unauthenticated) is not
  served.

Every bad request gets a 4xx saying what to fix; a 500 says only that the server failed (its log has the
cause, the exception's text never goes to the client).

Every answer carries ``X-Model-Version``. Requests are bounded: a body over ``--max-body-mib`` gets 413
unread, more than ``--max-instances`` rows 400, and a request not done within ``--request-timeout-s``
(a client sending its body slowly included) 408; a connection that does not send its request line and
headers within that time is closed. Concurrent predictions are batched
(:mod:`hybridflow.serving.batching`) and run on one thread beside the event loop.

``--port 0`` binds a free port; with ``--ready-file`` the bound port and pid are written there
(atomically) once the model is loaded and the server accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.serving.bounds import Bounds
from hybridflow.serving.schema import MAX_INSTANCES, BadRequest, InputSchema

HOST = "127.0.0.1"
MODELS_PREFIX = "/v1/models/"
GRACE_S = 3  # how long a stopping server lets requests in flight finish
# What a client reads of an error on the server's side: the cause (an exception's text names internals)
# goes to the server's log.
INTERNAL_ERROR = "the model server failed to answer; its log has the cause"
# KServe's model repository extension (load and unload any model, unauthenticated) is not served.
REPOSITORY_PREFIX = "/v2/repository"

log = logging.getLogger("hybridflow.serving.server")


def routes(endpoint: str) -> str:
    return f"GET /healthz, GET {MODELS_PREFIX}{endpoint}, POST {MODELS_PREFIX}{endpoint}:predict"


def _model_class() -> type:
    """The kserve.Model subclass (defined here so this module imports without KServe)."""
    from kserve import InferOutput, InferRequest, InferResponse, Model

    class BundleModel(Model):
        """One bundle's predictor behind KServe's model interface; predictions go through the batcher."""

        def __init__(self, name: str, predictor: Any, version: str, batcher: Any, max_instances: int) -> None:
            super().__init__(name)
            from hybridflow import scoring

            self.predictor, self.version, self.batcher = predictor, version, batcher
            self.schema = InputSchema(predictor.card.signature)
            self.max_instances = max_instances
            self.to_json = scoring.to_json
            self.ready = True

        async def predict(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
            output = self.predictor.card.output
            if isinstance(payload, InferRequest):  # open inference protocol: one [n, width] tensor
                x = self.schema.parse({"instances": self._tensor_rows(payload)}, self.max_instances)
                y = np.asarray(self.to_json(await self.batcher.predict(x), output))
                out = InferOutput(name=output.get("name", "output"), shape=list(y.shape),
                                  datatype="INT64" if y.dtype.kind == "i" else "FP64", data=y.tolist())
                return InferResponse(response_id=payload.id or "", model_name=self.name, infer_outputs=[out],
                                     model_version=self.version)
            x = self.schema.parse(payload, self.max_instances)
            predictions = self.to_json(await self.batcher.predict(x), output)
            return {"predictions": predictions, "model": self.name, "version": self.version}

        def _tensor_rows(self, payload: Any) -> list:
            """The one input tensor's rows; BadRequest for any tensor that is not numbers of [n, width]."""
            width = self.schema.width
            wanted = f"send one input tensor of shape [n, {width}] holding n x {width} numbers"
            if len(payload.inputs) != 1:
                raise BadRequest(wanted)
            tensor = payload.inputs[0]
            try:
                values = tensor.as_numpy()
            except (ValueError, TypeError) as exc:  # data that does not fill its shape, or not of its datatype
                raise BadRequest(f"input {tensor.name!r} does not hold {tensor.shape} {tensor.datatype} values; "
                                 f"{wanted}") from exc
            if values.dtype.kind not in "biuf" or values.ndim != 2 or values.shape[1] != width:
                raise BadRequest(f"input {tensor.name!r} is {tensor.datatype} of shape {list(values.shape)}; {wanted}")
            return values.tolist()

    return BundleModel


def _metrics() -> Callable[[int, int], None]:
    from prometheus_client import Counter, Histogram

    rows = Histogram("hybridflow_batch_rows", "instances per forward pass of the model",
                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
    calls = Counter("hybridflow_batched_requests", "requests answered by a batched forward pass")

    def on_batch(n_rows: int, n_calls: int) -> None:
        rows.observe(n_rows)
        calls.inc(n_calls)

    return on_batch


async def predictions(model: Any, body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> tuple[int, dict]:
    """(status, JSON body) for a predict request to ``model`` (KServe's ``Model.__call__``: its
    pre- and post-processing and latency histograms); never raises."""
    tag = {"model": model.name, "version": model.version}
    try:
        answer, _ = await model(_json_body(body), {k.decode("latin-1"): v.decode("latin-1") for k, v in headers})
    except BadRequest as exc:
        return 400, {"error": str(exc), **tag}
    except Exception:  # keep serving; the cause goes to the server's log, not to the client
        log.exception("prediction failed for %s version %s", model.name, model.version)
        return 500, {"error": INTERNAL_ERROR, **tag}
    return 200, answer


def _json_body(body: bytes) -> Any:
    """The request body as JSON; BadRequest saying what to fix for anything else."""
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body is not UTF-8 text (byte {exc.start}); send JSON") from exc
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # Python's cap on digits in an int (sys.get_int_max_str_digits())
        raise BadRequest(f"body holds an integer of over {sys.get_int_max_str_digits()} digits; "
                         "send each value as an ordinary JSON number") from exc


def _add_routes(app: Any, model: Any, endpoint: str, version: str) -> None:
    """Contract routes, registered before KServe's so that they answer for this endpoint."""
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    card = model.predictor.card
    health = {"endpoint": endpoint, "version": version, "variant": card.variant, "model": card.model,
              "pid": os.getpid()}
    metadata = {"name": endpoint, "version": version, "inputs": model.schema.names, "output": card.output}

    def no_route(request: Request) -> JSONResponse:
        return JSONResponse({"error": f"no route {request.method} {request.url.path}; use {routes(endpoint)}"}, 404)

    async def healthz(_request: Request) -> JSONResponse:
        # Read per request: a model that stops being ready (KServe's Model.ready) takes the version out of
        # rotation wherever health is checked.
        if model.ready:
            return JSONResponse({"status": "ok", "ready": True, **health})
        return JSONResponse({"status": "not ready", "ready": False, **health}, 503)

    async def model_info(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        if name == f"{endpoint}:predict":
            return JSONResponse({"error": f"use POST {MODELS_PREFIX}{endpoint}:predict"}, 405, {"Allow": "POST"})
        return JSONResponse({**metadata, "ready": model.ready}) if name == endpoint else no_route(request)

    async def predict(request: Request) -> JSONResponse:
        if request.path_params["name"] != endpoint:
            return no_route(request)
        status, answer = await predictions(model, await request.body(), request.headers.raw)
        return JSONResponse(answer, status)

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return no_route(request)
        return JSONResponse({"error": f"{exc.detail}; use {routes(endpoint)}"}, exc.status_code, exc.headers)

    # Plain Starlette routes (the request as it came, no FastAPI parameter binding).
    app.add_route("/healthz", healthz, methods=["GET"])
    app.add_route(MODELS_PREFIX + "{name}", model_info, methods=["GET"])
    app.add_route(MODELS_PREFIX + "{name}:predict", predict, methods=["POST"])
    app.add_exception_handler(HTTPException, http_error)


def _errors(app: Any) -> None:
    """BadRequest on KServe's own routes (v2 infer) is a 400 like KServe's InvalidInput; any other error
    is a 500 whose body names no internals (KServe's own handlers answer with the exception's text)."""
    from kserve.errors import InferenceError
    from starlette.responses import JSONResponse

    async def bad_request(_request: Any, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, 400)

    async def internal(request: Any, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse({"error": INTERNAL_ERROR}, 500)

    app.add_exception_handler(BadRequest, bad_request)
    app.add_exception_handler(InferenceError, internal)
    app.add_exception_handler(Exception, internal)


def _without_repository(app: Any, endpoint: str) -> Callable:
    """``app`` with KServe's model repository extension (POST /v2/repository/models/<m>/load and /unload)
    answered 404: KServe registers it unconditionally and without authentication, so anyone who
    reaches the port could unload the model. Nothing here uses it."""
    from starlette.responses import JSONResponse

    refused = JSONResponse({"error": f"the model repository extension is not served; use {routes(endpoint)}"}, 404)

    async def asgi(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith(REPOSITORY_PREFIX):
            await refused(scope, receive, send)
            return
        await app(scope, receive, send)

    return asgi


def build_app(predictor: Any, endpoint: str, version: str, *, max_batch_size: int = 32,
              max_batch_wait_ms: float = 5, max_instances: int = MAX_INSTANCES, max_body_mib: float = 8,
              request_timeout_s: float = 10) -> tuple[Any, Any]:
    """(the ASGI app, the batcher) serving ``predictor`` (``card``, ``predict``) with KServe's ModelServer:
    its model repository, data plane, routes, middlewares and exception handlers."""
    sys.argv = sys.argv[:1]  # kserve.model_server reads its own flags from the command line on import
    import kserve.model_server as kserve_server
    from kserve.protocol.rest.server import RESTServer

    from hybridflow.serving.batching import Batcher

    batcher = Batcher(predictor.predict, max_batch_size=max_batch_size, max_wait_s=max_batch_wait_ms / 1000,
                      on_batch=_metrics())
    model = _model_class()(endpoint, predictor, version, batcher, max_instances)
    model_server = kserve_server.ModelServer(enable_grpc=False, enable_latency_logging=False)
    model_server.register_model(model)
    app = kserve_server.app
    _add_routes(app, model, endpoint, version)
    rest = RESTServer("kserve.model_server:app", model_server.dataplane, None, 0)  # no repository extension
    rest.create_application()
    # KServe's TimingMiddleware reads the process's CPU time twice per request to log it at INFO on
    # kserve.trace: 7 % of the event loop at 64 concurrent clients, for lines nobody keeps. Latency is
    # in KServe's own histograms on /metrics.
    from timing_asgi import TimingMiddleware

    app.user_middleware = [m for m in app.user_middleware if m.cls is not TimingMiddleware]
    _errors(app)
    bounded = Bounds(_without_repository(app, endpoint), version=version, max_body_bytes=int(max_body_mib * 2**20),
                     timeout_s=request_timeout_s,
                     direct={f"{MODELS_PREFIX}{endpoint}:predict": lambda body, headers: predictions(model, body, headers)})
    return bounded, batcher


def _write_ready(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


async def _serve(app: Any, sock: socket.socket, timeout_s: float, on_ready: Callable[[], None]) -> None:
    import uvicorn

    from hybridflow.serving.listen import protocol

    config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=GRACE_S,
                            http=protocol(timeout_s), lifespan="off", timeout_keep_alive=5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        on_ready()
    await task


def run_server(predictor: Any, endpoint: str, version: str, *, port: int, host: str = HOST,
               ready_file: Path | None = None, **settings: Any) -> None:
    """Serve until SIGTERM/SIGINT; ``settings``: :func:`build_app`'s bounds and batching."""
    app, _batcher = build_app(predictor, endpoint, version, **settings)
    # What loading made (torch, KServe, pandas) lives as long as the process: kept out of the collector's
    # sight, and the young generation collected after 20k allocations rather than 700. Under 64 concurrent
    # clients the defaults stalled every request in flight for 200-300 ms a few times a second (p99
    # 290 ms against 33 ms); cyclic garbage is still collected.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 50)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]

    def ready() -> None:
        if ready_file:
            _write_ready(ready_file, {"pid": os.getpid(), "port": bound, "endpoint": endpoint, "version": version})
        print(f"serving {endpoint} version {version} on http://{host}:{bound}{MODELS_PREFIX}{endpoint}",
              file=sys.stderr, flush=True)

    from hybridflow.signals import stop_on_signals

    # uvicorn stops gracefully on SIGTERM/SIGINT, then hands the signal to the handler it found: this
    # one ends the process with status 0 (also when started with SIGINT ignored, from a background shell).
    stop_on_signals()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_serve(app, sock, settings.get("request_timeout_s", 10), ready))
    finally:
        sock.close()


class ServerProcess:
    """The model server started in its own environment (``serve_python()``) on ``port`` (0: a free one),
    held as an ``http.server`` server is: ``server_address``, ``serve_forever`` (wait for it to stop),
    ``shutdown`` and ``server_close``. For callers in Airflow's environment, which has no KServe."""

    def __init__(self, bundle_dir: Path, endpoint: str, version: str, port: int, host: str = HOST,
                 extra_args: Sequence[str] = (), start_timeout_s: float = 120) -> None:
        import subprocess
        import tempfile

        from hybridflow.serving.processes import child_env
        from hybridflow.serving.runtime import serve_python

        self._folder = tempfile.TemporaryDirectory(prefix="model-server-")
        ready, log = Path(self._folder.name) / "ready.json", Path(self._folder.name) / "server.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [serve_python(), "-m", "hybridflow.serving.server",
                 "--bundle", str(bundle_dir), "--endpoint", endpoint, "--version", version, "--port", str(port),
                 "--host", host, "--ready-file", str(ready), *extra_args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=child_env())
        deadline = time.monotonic() + start_timeout_s
        while not ready.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.shutdown()
                raise OSError(f"the model server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        self.server_address = (host, json.loads(ready.read_text())["port"])

    def serve_forever(self) -> None:
        self.proc.wait()

    def shutdown(self, timeout_s: float = 10) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)

    def server_close(self) -> None:
        self.shutdown()
        self._folder.cleanup()


def build_server(bundle_dir: Path, endpoint: str, version: str, port: int, host: str = HOST) -> ServerProcess:
    """The model server of ``bundle_dir`` in its own process, started and listening."""
    return ServerProcess(bundle_dir, endpoint, version, port, host)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.serving.server", description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", type=Path, required=True, help="model bundle folder (model.json + weights.pt)")
    parser.add_argument("--endpoint", required=True, help="served at /v1/models/<endpoint>")
    parser.add_argument("--version", required=True)
    parser.add_argument("--port", type=int, required=True, help="port to listen on; 0 picks a free one")
    # Loopback on this machine; a pod listens on all its interfaces so its Service can reach it.
    parser.add_argument("--host", default=HOST, help=f"address to bind (default {HOST}; 0.0.0.0 in a pod)")
    parser.add_argument("--ready-file", type=Path, help="write {pid, port, endpoint, version} here once serving")
    parser.add_argument("--max-batch-size", type=int, default=32, help="instances per forward pass, at most")
    parser.add_argument("--max-batch-wait-ms", type=float, default=5, help="how long a batch waits for more")
    parser.add_argument("--max-instances", type=int, default=MAX_INSTANCES, help="instances per request, at most")
    parser.add_argument("--max-body-mib", type=float, default=8, help="request body size, at most")
    parser.add_argument("--request-timeout-s", type=float, default=10, help="a slower request is cut off")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from hybridflow.bundle import Predictor
    from hybridflow.config.registry import EntrypointError

    torch.set_num_threads(1)  # many small requests on few cores: intra-op threads only add contention
    try:
        predictor = Predictor.load(args.bundle)
    except (OSError, ValueError, TypeError, EntrypointError) as exc:
        print(f"cannot serve {args.bundle} as {args.endpoint} version {args.version}: {exc}", file=sys.stderr)
        return 2
    settings = {"max_batch_size": args.max_batch_size, "max_batch_wait_ms": args.max_batch_wait_ms,
                "max_instances": args.max_instances, "max_body_mib": args.max_body_mib,
                "request_timeout_s": args.request_timeout_s}
    try:
        run_server(predictor, args.endpoint, args.version, port=args.port, host=args.host,
                   ready_file=args.ready_file, **settings)
    except OSError as exc:
        print(f"cannot serve {args.endpoint} on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
