"""The cluster simulator (:mod:`tests.support.k8s_sim`) served over the Kubernetes REST API on loopback.

A :class:`SimApiServer` is a kmock HTTP server on ``127.0.0.1`` (a real port, in a thread of the
test process with its own event loop) whose one catch-all reaction reads each request as the
Kubernetes API does (kmock parses the path into group, version, plural, namespace, name and
subresource) and answers it from the simulator's fake client methods
(``FakeCoreV1Api.read_node``, ``FakeBatchV1Api.create_namespaced_job``,
``FakeCustomObjectsApi.get_namespaced_custom_object``, ...): query parameters become the method's
keyword arguments (``labelSelector`` -> ``label_selector``), the JSON body its ``body``, a PATCH's
Content-Type its ``_content_type``; the answer goes back as JSON through the kubernetes client's own
``sanitize_for_serialization``, and an ``ApiException`` as its HTTP status with a ``Status`` body. So
the real ``KubernetesHook``, holding a kubeconfig from a real Airflow Connection, builds the real
client, which serialises, sends, parses and raises as against a cluster; nothing is monkeypatched.

Served: core v1 (``/api/v1/...``: pods, secrets, services, nodes), batch/v1 Jobs and custom objects of
any other group (``batch.volcano.sh``, ``scheduling.volcano.sh``, ``kueue.x-k8s.io``, ...),
namespaced and cluster-scoped, with ``/status`` as a ``*_status`` method. A request the simulator has
no method for is answered 404 ("the server could not find the requested resource") and kept in
``unserved``; one the simulator failed on (a bug in the test or the simulator), 500, kept in
``errors``. Leaving :func:`serve` with either non-empty fails the test.

The simulator's faults, over the wire:

- ``sim.outage(seconds, status)``: that HTTP status (503, 429) for that long;
- ``sim.forbidden``: the API server's 403 Status, message and all;
- ``sim.api_delay_s``: every answer that late, so the client's ``_request_timeout`` really expires
  (urllib3's ``ReadTimeoutError``); the client's timeout itself is not sent to a server, so
  ``sim.requests`` records ``(method, None)`` here: assert bounds with ``api_delay_s`` instead;
- ``sim.unreachable`` (truthy): the port stops listening (connection refused) and open connections are
  dropped, until it is false again;
- a wrong or missing bearer token: 401, before anything else (the simulator never sees the call).

Use :func:`serve` (one cluster behind Connection ``conn_id``) or :func:`serve_clusters` (one server per
Connection, as :func:`tests.support.k8s_sim.install_clusters`), both context managers taking pytest's
``monkeypatch``: they set ``AIRFLOW_CONN_<CONN_ID>`` to a kubernetes Connection whose ``kube_config``
extra points at the server (:func:`tests.support.k8s_config.kubeconfig` with the server's token) and
give the kubernetes client's process-wide default configuration back afterwards.

From another process (a real triggerer, say): the server lives as long as the ``with`` block of the
test that started it and answers on ``server.url`` from any process on the machine. A child process
started inside the block inherits ``AIRFLOW_CONN_<CONN_ID>`` from the environment, so its
``KubernetesHook(conn_id=...)`` reaches the same simulator; :meth:`SimApiServer.write_kubeconfig`
writes the kubeconfig as a file too, for a Connection with ``kube_config_path`` or for ``kubectl
--kubeconfig``. The simulator's state stays in the test process, where the test asserts on it; the
server's thread changes it only under ``server.lock``, which a test takes while it changes the
simulator as requests may be arriving (``with server.lock: sim.run(3)``).
"""

from __future__ import annotations

import asyncio
import http
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp.web
import jsonschema
import kmock
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from tests.support import k8s_sim
from tests.support.k8s_config import kubeconfig, kubernetes_connection

TOKEN = "sim-api-token-5f2c81"  # the bearer token the server accepts unless told another
_VERBS = {"POST": "create", "PUT": "replace", "PATCH": "patch"}
_KINDS = {"configmaps": "config_map", "persistentvolumeclaims": "persistent_volume_claim"}
_CLUSTER_SCOPED = {"nodes", "namespaces", "persistentvolumes"}
_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
            409: "AlreadyExists", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable", 504: "Timeout"}
_SERIALIZER = ApiClient()


def status_body(code: int, message: str, reason: str | None = None) -> dict:
    """A ``Status`` object as the API server sends with a failed request."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason or _REASONS.get(code, ""), "code": code}


def route(method: str, resource: tuple[str, str, str], namespace: str | None, name: str | None,
          subresource: str | None, query: dict, body, content_type: str | None) -> tuple[str, str, dict]:
    """(which fake: core, batch or custom; its method; the method's keyword arguments) for a REST call
    to ``resource`` (group, version, plural)."""
    group, version, plural = resource
    verb = _VERBS.get(method) or ({"GET": "read", "DELETE": "delete"}[method] if name else
                                  {"GET": "list", "DELETE": "deletecollection"}[method])
    kwargs = {_snake(k): v for k, v in query.items()}
    if namespace is not None:
        kwargs["namespace"] = namespace
    if name is not None:
        kwargs["name"] = name
    if method in _VERBS:
        kwargs["body"] = body
    if method == "PATCH":
        kwargs["_content_type"] = content_type
    if group in ("", "batch") and version == "v1":
        kind = _KINDS.get(plural, plural[:-1])
        scope = "namespaced_" if namespace is not None else ""
        if namespace is None and verb == "list" and plural not in _CLUSTER_SCOPED:
            call = f"list_{kind}_for_all_namespaces"
        else:
            call = f"{verb}_{scope}{kind}"
        api = "core" if group == "" else "batch"
    else:
        verb = {"read": "get"}.get(verb, verb)
        call = f"{verb}_{'namespaced' if namespace is not None else 'cluster'}_custom_object"
        kwargs.update(group=group, version=version, plural=plural)
        api = "custom"
    return api, call + (f"_{subresource}" if subresource else ""), kwargs


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class SimApiServer:
    """A :class:`~tests.support.k8s_sim.SimCluster` behind the Kubernetes REST API on 127.0.0.1."""

    def __init__(self, sim: k8s_sim.SimCluster, *, token: str = TOKEN) -> None:
        self.sim = sim
        self.token = token
        self.lock = threading.RLock()  # held while a request reads or changes the simulator
        self.unserved: list[str] = []  # requests the simulator has no method for
        self.errors: list[str] = []  # requests the simulator failed on
        self.handler: kmock.RawHandler | None = None  # kmock's record of every request (filters, len, ...)
        self.host, self.port = "127.0.0.1", 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._listening = True
        self._listen_lock: asyncio.Lock | None = None
        self._web = None  # aiohttp's test server under kmock's: its runner holds the listening site
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- what a client is given ---------------------------------------------------------------------

    def kubeconfig(self, token: str | None = None, *, context: str = "dc2") -> dict:
        return kubeconfig(self.url, self.token if token is None else token, context=context)

    def connection(self, token: str | None = None) -> str:
        """The value of ``AIRFLOW_CONN_<ID>`` for a kubernetes Connection to this server."""
        return kubernetes_connection(self.kubeconfig(token))

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        path.write_text(json.dumps(self.kubeconfig(token)))  # JSON is YAML: the loader reads it as is
        return path

    # --- starting and stopping ----------------------------------------------------------------------

    def start(self) -> SimApiServer:
        self._thread = threading.Thread(target=self._run, name=f"sim-api-{id(self):x}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=30) or self._failure is not None:
            raise RuntimeError(f"the simulator's API server did not start: {self._failure!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=30)
            assert not self._thread.is_alive(), "the simulator's API server did not stop within 30 s"

    def __enter__(self) -> SimApiServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by start() or seen in errors
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._stopping, self._listen_lock = asyncio.get_running_loop(), asyncio.Event(), asyncio.Lock()
        async with kmock.RawHandler() as handler, kmock.Server(handler, host=self.host) as server:
            handler.fallback << self._answer  # one catch-all reaction: the simulator answers everything
            self.handler, self.port = handler, server.port
            self._web = server.server
            self._ready.set()
            while not self._stopping.is_set():
                await self._follow_reachability()
                try:
                    await asyncio.wait_for(self._stopping.wait(), timeout=0.02)
                except TimeoutError:
                    pass

    # --- unreachable: the port refuses connections ---------------------------------------------------

    async def _follow_reachability(self) -> None:
        want = not self.sim.unreachable
        if want != self._listening:
            await self._listen(want)

    async def _listen(self, on: bool) -> None:
        async with self._listen_lock:
            if on == self._listening:
                return
            runner = self._web.runner
            if on:
                site = aiohttp.web.TCPSite(runner, self.host, self.port, reuse_address=True)
                await site.start()
            else:
                for site in list(runner.sites):
                    await site.stop()
                for conn in runner.server.connections:  # idle keep-alive connections go too
                    conn.force_close()
            self._listening = on

    # --- one request --------------------------------------------------------------------------------

    async def _answer(self, request: kmock.Request) -> kmock.Response:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _json(401, status_body(401, "Unauthorized"))
        if self.sim.unreachable:  # arrived on a connection opened before: drop it, stop listening
            await self._listen(False)
            return _json(503, status_body(503, "unreachable"))  # never read: the connection is gone
        resource, namespace, name = request.resource, request.namespace, request.name
        if resource is None or resource.version is None:
            return self._unserved(request, f"{request.method.value} {request.url.path}")
        plural = resource.plural
        if plural is None and namespace is not None:  # kmock reads /api/v1/namespaces/NAME as a namespace
            plural, namespace, name = "namespaces", None, namespace
        if plural is None:  # discovery (/api/v1, /apis/GROUP/VERSION) is not simulated
            return self._unserved(request, f"{request.method.value} {request.url.path}")
        method = request.method.value
        api, call, kwargs = route(method, (resource.group, resource.version, plural), namespace, name,
                                  request.subresource, dict(request.params), _body(request),
                                  request.headers.get("Content-Type"))
        fake = getattr(self.sim, api)
        try:
            object.__getattribute__(fake, call)
        except AttributeError:
            return self._unserved(request, f"{type(fake).__name__}.{call}")
        with self.lock:
            refusal = self._gate(call, kwargs)
        if refusal is not None:
            return _failure(refusal)
        if self.sim.api_delay_s:
            try:  # a slow answer, cut short (503) only when the server stops
                await asyncio.wait_for(self._stopping.wait(), timeout=self.sim.api_delay_s)
                return _json(503, status_body(503, "the API server is shutting down"))
            except TimeoutError:
                pass
        return self._call(fake, call, kwargs)

    def _gate(self, call: str, kwargs: dict) -> BaseException | None:
        """What :meth:`SimCluster.answer` does before a call, minus the wait (asynchronous here) and
        the unreachable cluster (a closed port here): record it, then the outage or the 403."""
        sim = self.sim
        sim.requests.append((call, None))  # the client's _request_timeout never reaches a server
        if sim._outage is not None and time.monotonic() < sim._outage[0]:
            return sim._outage[1]
        rbac = k8s_sim._rbac(call, kwargs)
        if rbac in sim.forbidden:
            return k8s_sim._forbidden(sim.user, rbac, kwargs)
        return None

    def _call(self, fake, call: str, kwargs: dict) -> kmock.Response:
        with self.lock:
            self.sim._serving = True  # past the gate: calls one fake makes to another are not requests
            try:
                result = object.__getattribute__(fake, call)(**kwargs)
            except ApiException as exc:
                return _failure(exc)
            except jsonschema.ValidationError as exc:  # the API server's schema check of a custom object
                return _json(422, status_body(422, f"{kwargs.get('plural')} is invalid: {exc.message}"))
            except Exception as exc:  # noqa: BLE001 - the test sees it through errors
                self.errors.append(f"{type(fake).__name__}.{call}: {type(exc).__name__}: {exc}")
                return _json(500, status_body(500, f"{type(exc).__name__}: {exc}"))
            finally:
                self.sim._serving = False
        if result is None:
            result = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        return _json(200, _SERIALIZER.sanitize_for_serialization(result))

    def _unserved(self, request: kmock.Request, what: str) -> kmock.Response:
        self.unserved.append(f"{request.method.value} {request.url.path_qs} ({what})")
        return _json(404, status_body(404, f"the server could not find the requested resource ({what} is not "
                                           "simulated)"))


def _body(request: kmock.Request):
    return json.loads(request.body) if request.body else None


def _json(code: int, body) -> kmock.Response:
    return kmock.Response(status=code, reason=http.HTTPStatus(code).phrase, headers={"Content-Type": "application/json"},
                          payload=json.dumps(body, default=str).encode())


def _failure(exc: BaseException) -> kmock.Response:
    """An ``ApiException`` of the simulator as the API server's answer: its status, its Status body."""
    code = getattr(exc, "status", None) or 500
    body = getattr(exc, "body", None)
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None
    reason = str(getattr(exc, "reason", "") or "")
    return _json(code, parsed if isinstance(parsed, dict) else status_body(code, reason or str(exc)))


@contextmanager
def serve(monkeypatch, sim: k8s_sim.SimCluster, conn_id: str = "k8s_dc2", *, token: str = TOKEN,
          strict: bool = True) -> Iterator[SimApiServer]:
    """Serve ``sim`` and point Airflow Connection ``conn_id`` at it (``AIRFLOW_CONN_<CONN_ID>``); with
    ``strict``, leaving the block fails if a request went unserved or the simulator failed on one."""
    with serve_clusters(monkeypatch, {conn_id: sim}, token=token, strict=strict) as servers:
        yield servers[conn_id]


@contextmanager
def serve_clusters(monkeypatch, sims: dict[str, k8s_sim.SimCluster], *, token: str = TOKEN,
                   strict: bool = True) -> Iterator[dict[str, SimApiServer]]:
    """One server per Connection, as :func:`tests.support.k8s_sim.install_clusters` hands out one
    simulator per ``conn_id``."""
    from kubernetes.client import Configuration

    # The kubeconfig loader sets the client's process-wide default configuration: keep it to this block.
    monkeypatch.setattr(Configuration, "_default", None)
    with ExitStack() as stack:
        servers = {conn_id: stack.enter_context(SimApiServer(sim, token=token)) for conn_id, sim in sims.items()}
        for conn_id, server in servers.items():
            monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", server.connection())
        yield servers
    if strict:
        problems = [f"{c}: {p}" for c, s in servers.items() for p in s.unserved + s.errors]
        assert not problems, f"requests the simulator did not serve: {problems}"
