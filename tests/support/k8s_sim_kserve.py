"""KServe for the cluster simulator: InferenceServices with revisions, readiness and a traffic split.

:func:`attach` gives a :class:`~tests.support.k8s_sim.SimCluster` a :class:`KServeController`; the
simulator's custom objects API then serves ``serving.kserve.io/v1beta1`` ``inferenceservices``
(create, get, list, merge patch, delete), every object checked against the KServe v0.20.0 CRD as the
API server would, and every answer valid against it too.

What KServe (Serverless mode, over Knative) does, as far as a deploy sees it:

- each new predictor spec (``canaryTrafficPercent`` aside) is a new revision
  ``<name>-predictor-NNNNN``; a change of ``canaryTrafficPercent`` alone makes none;
- a revision's predictor container runs as a local process (the container command with ``python``
  this machine's model-server interpreter, the models volume's mount the local models folder, a free
  loopback port, a ready file) and is Ready once its server listens and ``ready_delay_s`` has passed;
  a process that exits before is a failed revision (condition ``RevisionFailed``). With
  ``processes=False`` an in-process stand-in answers for the container instead (the model server's
  HTTP API over the same bundle, through :class:`hybridflow.bundle.Predictor`), ready at once: for
  tests that cannot wait seconds for each model server to start;
- traffic: without ``canaryTrafficPercent`` the latest revision takes everything once ready and becomes
  the rolled-out one; with it, the latest ready revision takes that share and the rolled-out revision
  the rest (0: the rolled-out revision everything); a revision that is not ready takes none;
- ``status.url`` is a loopback splitter that sends each request to a revision by those shares
  (deterministically: of every 100 requests, exactly ``percent`` go to a revision), and each traffic
  entry has its revision's own URL (tag routing: ``latest``, ``prev``);
- revisions without traffic that are not the latest are scaled to zero (their processes stopped).

Faults: ``faults[version] = percent`` makes the splitter answer 500 (with ``X-Model-Version``) for the
requests it routes to that version while the version takes at least ``percent`` % of the traffic, as
a canary that breaks under its share of the load.

The controller reconciles on every read of an InferenceService; :meth:`KServeController.close` stops
every process and the splitters.
"""

from __future__ import annotations

import copy
import http.client
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kubernetes.client.exceptions import ApiException
from tests.support.k8s_sim_api import _label_match, _merge_patch, _not_found, crd_validator

from hybridflow.serving.k8s_manifests import MODELS_MOUNT
from hybridflow.serving.processes import child_env

GROUP, VERSION, PLURAL = "serving.kserve.io", "v1beta1", "inferenceservices"
CRD = ("kserve/serving.kserve.io_inferenceservices.yaml", "v1beta1")
VERSION_LABEL = "hybridflow.io/version"


def attach(sim, models_dir: Path, log_dir: Path, *, ready_delay_s: float = 0.0,
           processes: bool = True, knative: bool = True) -> KServeController:
    """The simulator ``sim`` gets KServe: its custom objects API serves InferenceServices. ``processes``:
    each revision's container command runs as a model-server process; False: an in-process stand-in
    answers for it (the same HTTP API over the same bundle, without the model server's start-up).
    ``knative``: whether the cluster serves Knative Serving's API (False: KServe installed for
    Standard mode only, where a Serverless InferenceService never gets a revision)."""
    sim.kserve = KServeController(models_dir, log_dir, ready_delay_s=ready_delay_s, processes=processes)
    sim.kserve.knative = knative
    return sim.kserve


def _python() -> str:
    try:
        from hybridflow.serving.runtime import serve_python

        return str(serve_python())
    except Exception:  # noqa: BLE001 - no model-server environment of its own: this interpreter
        return sys.executable


class _Process:
    """A revision's container: its command run as a local process, ready once its ready file names it."""

    def __init__(self, command: list[str], models_dir: Path, ready: Path, log: Path) -> None:
        args = list(command[3:])
        for flag, value in (("--port", "0"), ("--host", "127.0.0.1")):
            args[args.index(flag) + 1] = value
        at = args.index("--bundle") + 1
        args[at] = str(models_dir) + args[at].removeprefix(MODELS_MOUNT)
        self.ready_file, self.port = ready, None
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen([_python(), *command[1:3], *args, "--ready-file", str(ready)],
                                         stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=child_env())

    def poll(self) -> str | None:
        """None while starting or listening; why it failed once the process exited before listening."""
        if self.port is None:
            code = self.proc.poll()
            if code is not None:
                return f"the container exited with code {code}"
            try:
                info = json.loads(self.ready_file.read_text())
            except (OSError, ValueError):
                return None
            if info.get("pid") == self.proc.pid:
                self.port = int(info["port"])
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class _InProcess:
    """A stand-in for a revision's container, in a thread of the test process: the model server's HTTP
    API (``/healthz``, ``/v1/models/<endpoint>[:predict]``, ``X-Model-Version`` on every answer) over the
    bundle the container command names, for tests that cannot wait for a model server to start."""

    def __init__(self, command: list[str], models_dir: Path) -> None:
        from hybridflow.bundle import Predictor
        from hybridflow.scoring import to_json
        from hybridflow.serving.schema import BadRequest, InputSchema

        args = command[3:]
        value = dict(zip(args[::2], args[1::2], strict=False))
        endpoint, version = value["--endpoint"], value["--version"]
        predictor = Predictor.load(models_dir / value["--bundle"].removeprefix(MODELS_MOUNT + "/"))
        schema, lock = InputSchema(predictor.card.signature), threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    return _answer(self, 200, {"status": "ok", "endpoint": endpoint, "version": version,
                                               "variant": predictor.card.variant, "model": predictor.card.model,
                                               "pid": os.getpid()}, version)
                _answer(self, 404, {"error": f"no route {self.path}"}, version)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != f"/v1/models/{endpoint}:predict":
                    return _answer(self, 404, {"error": f"no route {self.path}"}, version)
                try:
                    x = schema.parse(json.loads(body))
                except (BadRequest, ValueError) as exc:
                    return _answer(self, 400, {"error": str(exc)}, version)
                with lock:
                    predictions = to_json(predictor.predict(x), predictor.output)
                _answer(self, 200, {"predictions": predictions, "model": endpoint, "version": version}, version)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def poll(self) -> str | None:
        return None

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=10)


class _Revision:
    def __init__(self, name: str, spec: dict, container: _Process | _InProcess) -> None:
        self.name, self.spec, self.container = name, spec, container
        self.version = (spec.get("labels") or {}).get(VERSION_LABEL)
        self.started = time.monotonic()
        self.failed: str | None = None

    @property
    def url(self) -> str | None:
        return f"http://127.0.0.1:{self.container.port}" if self.container.port else None

    def poll(self, ready_delay_s: float) -> bool:
        """Ready (listening, and the delay passed); a container that exited is a failed revision."""
        if self.failed is None:
            self.failed = self.container.poll()
        if self.failed or self.container.port is None:
            return False
        return time.monotonic() - self.started >= ready_delay_s

    def stop(self) -> None:
        self.container.stop()


class _Splitter:
    """The InferenceService's URL on loopback: each request forwarded to a revision by its share."""

    def __init__(self, faults: dict[str, int]) -> None:
        self.routes: list[tuple[str, int, str | None]] = []  # (backend url, percent, version)
        self.faults = faults
        self.counter = itertools.count()
        self.lock = threading.Lock()
        self.served: dict[str | None, int] = {}
        splitter = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                splitter.forward(self)

            def do_POST(self) -> None:
                splitter.forward(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _pick(self) -> tuple[str, int, str | None] | None:
        with self.lock:
            routes, slot = list(self.routes), next(self.counter) % 100
        for route in routes:
            if slot < route[1]:
                return route
            slot -= route[1]
        return None

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        route = self._pick()
        if route is None:
            return _answer(handler, 503, {"error": "no revision of the InferenceService is ready"})
        url, percent, version = route
        with self.lock:
            self.served[version] = self.served.get(version, 0) + 1
        if version in self.faults and percent >= self.faults[version]:
            return _answer(handler, 500, {"error": f"revision of {version} failed under load"}, version)
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(handler.command, handler.path, body=body or None,
                         headers={"Content-Type": handler.headers.get("Content-Type") or "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            handler.send_response(resp.status)
            for key, value in resp.getheaders():
                if key.lower() not in ("content-length", "connection", "transfer-encoding", "date", "server"):
                    handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError as exc:
            _answer(handler, 502, {"error": f"revision unreachable: {exc}"})
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def _answer(handler: BaseHTTPRequestHandler, status: int, body: dict, version: str | None = None) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    if version:
        handler.send_header("X-Model-Version", version)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class KServeController:
    """InferenceServices, their revisions (local processes) and the splitter at each one's URL."""

    def __init__(self, models_dir: Path, log_dir: Path, *, ready_delay_s: float = 0.0, processes: bool = True) -> None:
        self.models_dir, self.log_dir, self.ready_delay_s = Path(models_dir), Path(log_dir), ready_delay_s
        self.processes, self.knative = processes, True
        self.objects: dict[tuple[str, str], dict] = {}
        self.revisions: dict[tuple[str, str], list[_Revision]] = {}
        self.rolled_out: dict[tuple[str, str], list[str]] = {}  # every rolled-out revision, in order
        self.splitters: dict[tuple[str, str], _Splitter] = {}
        self.faults: dict[str, int] = {}
        self.history: list[tuple[str, list[tuple[str | None, int]]]] = []  # (event, [(version, percent)])
        self._serial = itertools.count(1)

    # --- the API ------------------------------------------------------------------------------------

    def create(self, namespace: str, body: dict) -> dict:
        crd_validator(*CRD).validate(body)
        key = (namespace, body["metadata"]["name"])
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(body)
        stored["metadata"].update(namespace=namespace, generation=1, uid=f"isvc-{next(self._serial)}")
        stored["status"] = {"observedGeneration": 0}
        self.objects[key] = stored
        self.splitters[key] = _Splitter(self.faults)
        return self.get(namespace, key[1])

    def get(self, namespace: str, name: str) -> dict:
        if (namespace, name) not in self.objects:
            raise _not_found(name)
        self.reconcile((namespace, name))
        return self._out(self.objects[(namespace, name)])

    def list(self, namespace: str, label_selector: str | None = None) -> dict:
        items = []
        for key in sorted(k for k in self.objects if k[0] == namespace):
            self.reconcile(key)
            if _label_match(self.objects[key]["metadata"].get("labels") or {}, label_selector):
                items.append(self._out(self.objects[key]))
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceServiceList", "metadata": {}, "items": items}

    def patch(self, namespace: str, name: str, body: dict) -> dict:
        if (namespace, name) not in self.objects:
            raise _not_found(name)
        obj = self.objects[(namespace, name)]
        patched = _merge_patch(copy.deepcopy(obj), body)
        crd_validator(*CRD).validate({k: v for k, v in patched.items() if k != "status"})
        if patched["spec"] != obj["spec"]:
            patched["metadata"]["generation"] = obj["metadata"]["generation"] + 1
        self.objects[(namespace, name)] = patched
        return self.get(namespace, name)

    def delete(self, namespace: str, name: str) -> dict:
        key = (namespace, name)
        if self.objects.pop(key, None) is None:
            raise _not_found(name)
        for rev in self.revisions.pop(key, []):
            rev.stop()
        splitter = self.splitters.pop(key, None)
        if splitter is not None:
            splitter.close()
        return {"kind": "Status", "apiVersion": "v1", "status": "Success"}

    def _out(self, obj: dict) -> dict:
        out = copy.deepcopy(obj)
        crd_validator(*CRD).validate(out)  # what the controller wrote must be what the CRD allows
        return out

    # --- the controller -------------------------------------------------------------------------------

    def _start(self, key: tuple[str, str], spec: dict) -> _Revision:
        name = f"{key[1]}-predictor-{len(self.revisions.get(key, [])) + 1:05d}"
        command = list(spec["containers"][0]["command"])
        if not self.processes:
            return _Revision(name, spec, _InProcess(command, self.models_dir))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ready, log = self.log_dir / f"{name}.ready.json", self.log_dir / f"{name}.log"
        return _Revision(name, spec, _Process(command, self.models_dir, ready, log))

    def reconcile(self, key: tuple[str, str]) -> None:
        obj = self.objects[key]
        if not self.knative:  # KServe v0.20 logs a terminal error and leaves the status Unknown
            return
        predictor = obj["spec"]["predictor"]
        spec = {k: v for k, v in predictor.items() if k != "canaryTrafficPercent"}
        revisions = self.revisions.setdefault(key, [])
        if not revisions or revisions[-1].spec != spec:
            revisions.append(self._start(key, copy.deepcopy(spec)))
        ready = {rev.name for rev in revisions if rev.poll(self.ready_delay_s)}
        latest, rolled = revisions[-1], self.rolled_out.setdefault(key, [])
        percent = predictor.get("canaryTrafficPercent")
        stable = rolled[-1] if rolled else None
        if latest.name in ready and (percent is None or stable is None) and stable != latest.name:
            rolled.append(latest.name)  # the latest revision takes everything: it is rolled out
            stable = latest.name
        traffic: list[tuple[_Revision, int, str]] = []
        by_name = {rev.name: rev for rev in revisions}
        if latest.name in ready and latest.name != stable:
            share = percent if percent is not None else 100
            traffic.append((latest, share, "latest"))
            if stable is not None:
                traffic.append((by_name[stable], 100 - share, "prev"))
        elif stable is not None:
            traffic.append((by_name[stable], 100, "latest" if stable == latest.name else "prev"))
        self._route(key, traffic)
        for rev in revisions:  # scaled to zero: neither the latest nor in the traffic table
            if rev is not latest and all(rev is not t[0] for t in traffic):
                rev.stop()
        self._status(obj, key, revisions, ready, traffic)

    def _route(self, key: tuple[str, str], traffic: list) -> None:
        splitter = self.splitters[key]
        routes = [(rev.url, share, rev.version) for rev, share, _ in traffic if share > 0]
        if routes != splitter.routes:
            with splitter.lock:
                splitter.routes = routes
            self.history.append(("traffic", [(rev.version, share) for rev, share, _ in traffic]))

    def _status(self, obj: dict, key: tuple[str, str], revisions: list[_Revision], ready: set[str],
                traffic: list) -> None:
        latest, rolled = revisions[-1], self.rolled_out.get(key, [])
        ready_names = [rev.name for rev in revisions if rev.name in ready]
        predictor = {
            "latestCreatedRevision": latest.name,
            "traffic": [{"revisionName": rev.name, "percent": share, "latestRevision": rev is latest, "tag": tag,
                         "url": rev.url} for rev, share, tag in traffic],
            "url": self.splitters[key].url,
        }
        if ready_names:
            predictor["latestReadyRevision"] = ready_names[-1]
        if rolled:
            predictor["latestRolledoutRevision"] = rolled[-1]
        if len(rolled) > 1:
            predictor["previousRolledoutRevision"] = rolled[-2]
        serving = any(share for _, share, _ in traffic)
        latest_state = {"type": "LatestDeploymentReady", "status": "True" if latest.name in ready else "False"}
        if latest.failed:
            latest_state.update(reason="RevisionFailed", message=f"revision {latest.name}: {latest.failed}")
        obj["status"] = {
            "observedGeneration": obj["metadata"]["generation"],
            "url": self.splitters[key].url,
            "address": {"url": f"http://{key[1]}.{key[0]}.svc.cluster.local"},
            "deploymentMode": "Serverless",
            "components": {"predictor": predictor},
            "conditions": [{"type": "Ready", "status": "True" if serving else "False"},
                           {"type": "PredictorReady", "status": "True" if serving else "False"}, latest_state],
        }

    def close(self) -> None:
        for revisions in self.revisions.values():
            for rev in revisions:
                rev.stop()
        for splitter in self.splitters.values():
            splitter.close()
        self.revisions.clear()
        self.splitters.clear()
