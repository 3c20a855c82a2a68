"""The local deploy target: blue/green of model bundles behind one model gateway on 127.0.0.1.

Layout under ``state_root``:

- ``router.json`` / ``router.log`` / ``.gateway.lock``: the gateway (:mod:`hybridflow.serving.gateway`).
- ``<endpoint>/active.json``: the version the gateway forwards ``/v1/models/<endpoint>`` to
  (``version``, ``url``, ``pid``, deploy ``result``); replaced atomically, which is the whole switch.
- ``<endpoint>/.lock``: one deployer per endpoint at a time.
- ``<endpoint>/versions/<version>.json`` / ``.log`` / ``.ready``: each version's server process, its
  log, and the file the server writes its bound port into once it is serving.

Processes are started detached and stopped only by recorded pid after checking it is still the
process we started (:mod:`hybridflow.serving.processes`).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.errors import DeploymentError
from hybridflow.serving.base import DeployRequest, DeployTarget, Serving, Staged, roll
from hybridflow.serving.checks import (
    LOAD_REQUESTS,
    DeployPlan,
    StepFailed,
    backend_healthy,
    check_endpoint,
    http_json,
    load_check,
    model_url,
    predict,
    url_of,
    wait_healthy,
    wait_ready,
)
from hybridflow.serving.gateway import (
    GATEWAY_FILE,
    ROUTER_MODULE,
    ensure_gateway,
    gateway_status,
    verify_gateway,
)
from hybridflow.serving.processes import (
    Log,
    alive,
    endpoint_lock,
    gateway_lock,
    is_ours,
    log_size,
    now,
    read_json,
    say,
    spawn,
    stop_child,
    terminate,
    write_json,
)
from hybridflow.serving.router import ACTIVE_FILE, known_endpoints

if TYPE_CHECKING:
    from hybridflow.config import Estate

SERVER_MODULE = "hybridflow.serving.server"
START_TIMEOUT_S = 120.0  # importing torch on a busy machine takes a while
DRAIN_S = 1.0  # let requests already forwarded to the old version finish before it is stopped


def _root(state_root: Path) -> Path:
    return Path(state_root).resolve()


def endpoint_dir(state_root: Path, endpoint: str) -> Path:
    check_endpoint(endpoint)
    return _root(state_root) / endpoint


def _ready_file(edir: Path, version: str) -> Path:
    return edir / "versions" / f"{version}.ready"


@dataclass(kw_only=True)
class _Started(Staged):
    """A new version's server process and its record (``versions/<version>.json``)."""

    plan: DeployPlan = field(repr=False)
    proc: subprocess.Popen
    record: dict[str, Any]
    record_path: Path
    log_path: Path
    ready: Path
    log_since: int
    step: str = "gateway"  # the step under way, named in the error if it fails
    switched: bool = False  # active.json names it
    outcome: dict[str, Any] = field(default_factory=dict)


class LocalTarget(DeployTarget[_Started]):
    """Each version is its own server process on a free loopback port; the gateway on ``port``
    forwards the endpoint to whichever one ``active.json`` names."""

    name = "local"

    def __init__(self, state_root: Path, endpoint: str, port: int, log: Log = None) -> None:
        self.state_root, self.endpoint, self.port, self.log = state_root, endpoint, port, log

    @classmethod
    def from_estate(cls, estate: Estate, endpoint: str, *, state_dir: Path, log: Any = None) -> LocalTarget:
        return cls(Path(state_dir) / "serving", endpoint, estate.pipeline.serving.port, log)

    @property
    def _endpoint_url(self) -> str:
        return model_url(url_of(self.port), self.endpoint)

    def prepare(self, request: DeployRequest) -> DeployPlan:
        if request.smoke is None:
            raise ValueError("smoke: the local target smoke-tests every version through its server; pass the "
                             "held-out (inputs, targets)")
        return DeployPlan(request.bundle_dir, request.version, self.endpoint, self.port, request.smoke(),
                          request.metric)

    @property
    def root(self) -> Path:
        return _root(self.state_root)

    @property
    def edir(self) -> Path:
        return endpoint_dir(self.state_root, self.endpoint)

    @property
    def vdir(self) -> Path:
        return self.edir / "versions"

    def exclusive(self) -> Any:
        self.vdir.mkdir(parents=True, exist_ok=True)
        return endpoint_lock(self.edir)

    def current(self) -> Serving | None:
        active = read_json(self.edir / ACTIVE_FILE)
        return Serving(active.get("version"), active) if active else None

    def keep(self, current: Serving, plan: DeployPlan) -> dict[str, Any] | None:
        active = dict(current.detail)
        if not isinstance(active.get("result"), dict) or not backend_healthy(active, self.endpoint):
            return None
        try:
            ensure_gateway(self.root, self.port, self.log)
        except StepFailed as exc:
            raise DeploymentError(f"{self.endpoint} version {current.version} is active but the gateway cannot "
                                  f"start: {exc}") from exc
        say(self.log, f"{self.endpoint} version {current.version} is already active and healthy on "
                      f"{self._endpoint_url}; nothing to do")
        return active["result"]

    def stage(self, plan: DeployPlan, current: Serving | None) -> _Started:
        version, card = plan.version, plan.card
        record_path, log_path = self.vdir / f"{version}.json", self.vdir / f"{version}.log"
        ready = _ready_file(self.edir, version)
        leftover = read_json(record_path) or {}
        if leftover.get("pid") and leftover.get("pid") != (current.detail if current else {}).get("pid"):
            # An inactive process of this version (e.g. a crashed deployer's) would be orphaned otherwise.
            terminate(leftover["pid"], SERVER_MODULE, str(ready))
        ready.unlink(missing_ok=True)

        log_since = log_size(log_path)
        proc = spawn([SERVER_MODULE, "--bundle", str(plan.bundle_dir), "--endpoint", self.endpoint,
                      "--version", version, "--port", "0", "--ready-file", str(ready)], log_path, self.edir)
        record: dict[str, Any] = {
            "endpoint": self.endpoint, "version": version, "model": card.model, "variant": card.variant,
            "bundle": str(plan.bundle_dir), "pid": proc.pid, "port": None, "url": None, "log": str(log_path),
            "status": "starting", "started_at": now(),
        }
        write_json(record_path, record)
        say(self.log, f"started {self.endpoint} version {version} ({card.model}, {card.variant}) as pid "
                      f"{proc.pid}; log {log_path}")
        return _Started(version, current, plan=plan, proc=proc, record=record, record_path=record_path,
                        log_path=log_path, ready=ready, log_since=log_since)

    def check(self, staged: _Started) -> None:
        """Gateway up, server ready and healthy, smoke metric within the gate, load check without errors."""
        plan, proc, version, endpoint = staged.plan, staged.proc, staged.version, self.endpoint
        # While the new server loads its model: a gateway that cannot run fails the deploy early.
        staged.step = "gateway"
        ensure_gateway(self.root, self.port, self.log)
        staged.step = "start"
        backend_port = wait_ready(proc, staged.ready, staged.log_path, staged.log_since, START_TIMEOUT_S)
        url = url_of(backend_port)
        staged.record.update(port=backend_port, url=url)
        write_json(staged.record_path, staged.record)
        wait_healthy(url, endpoint, version, proc.pid)
        staged.step = "smoke test"
        rows = plan.rows
        value = plan.score(predict(url, endpoint, rows, version))
        gate = plan.metric.gate
        say(self.log, f"{endpoint} version {version} smoke {plan.metric.name} {value:.4f} on {len(rows)} known "
                      f"inputs (gate {gate:g}, {plan.metric.better} is better)")
        if not plan.metric.passes(value):
            side = "below" if plan.metric.better == "higher" else "above"
            raise StepFailed(f"smoke {plan.metric.name} {value:.4f} on {len(rows)} known inputs is {side} "
                             f"the gate {gate:g}")
        staged.step = "load check"
        p50, p95 = load_check(url, endpoint, rows, version)
        say(self.log, f"{endpoint} version {version} load check: {LOAD_REQUESTS} requests, "
                      f"p50 {p50} ms, p95 {p95} ms")
        previous = staged.previous
        staged.outcome = {
            "endpoint": endpoint,
            "endpoint_url": self._endpoint_url,
            "version": version,
            "previous_version": previous.version if previous else None,
            "model": plan.card.model,
            "variant": plan.card.variant,
            "smoke_metric": {"name": plan.metric.name, "value": value, "gate": gate},
            "smoke_rows": len(rows),
            "p50_ms": p50,
            "p95_ms": p95,
            "backend_url": url,
            "pid": proc.pid,
        }

    def shift(self, staged: _Started, percent: int) -> None:
        """The switch, all traffic at once (``percent`` is 100): ``active.json`` names the new version,
        then the gateway must serve it."""
        staged.step = "verify after switch"
        plan, proc = staged.plan, staged.proc
        staged.switched = True
        write_json(self.edir / ACTIVE_FILE, {
            "version": staged.version, "url": staged.outcome["backend_url"], "pid": proc.pid,
            "model": plan.card.model, "variant": plan.card.variant, "bundle": str(plan.bundle_dir),
            "activated_at": now(), "result": staged.outcome,
        })
        say(self.log, f"switched {self._endpoint_url} to version {staged.version}")
        verify_gateway(self.port, self.endpoint, staged.version, plan.rows)
        staged.record.update(status="active", activated_at=now())
        write_json(staged.record_path, staged.record)

    def rollback(self, staged: _Started, error: BaseException) -> Exception | None:
        if staged.switched:
            # The old version goes back in front before the new one stops: the endpoint never points nowhere.
            previous = staged.previous
            if previous is not None:
                write_json(self.edir / ACTIVE_FILE, dict(previous.detail))
            else:
                (self.edir / ACTIVE_FILE).unlink(missing_ok=True)
        stop_child(staged.proc)
        staged.record.update(status="failed", error=f"{staged.step}: {error}", stopped_at=now())
        write_json(staged.record_path, staged.record)
        if not isinstance(error, StepFailed | OSError | DeploymentError):
            return None  # interrupted (e.g. the task was killed): no orphan left behind, the error stands
        was = staged.previous.version if staged.previous else None
        keeps = f"version {was} keeps serving" if was else "no version was serving"
        return DeploymentError(f"{self.endpoint} version {staged.version} was not deployed ({staged.step}): "
                               f"{error}. {keeps} on {self._endpoint_url}; server log: {staged.log_path}")

    def retire(self, staged: _Started) -> None:
        active = dict(staged.previous.detail) if staged.previous else {}
        pid = active.get("pid")
        if not pid or pid == staged.proc.pid:
            return
        time.sleep(DRAIN_S)
        previous = staged.previous.version if staged.previous else None
        stopped = terminate(pid, SERVER_MODULE, str(_ready_file(self.edir, str(previous))))
        old_path = self.vdir / f"{previous}.json"
        old = read_json(old_path)
        if old and old.get("pid") == pid:
            old.update(status="stopped", stopped_at=now())
            write_json(old_path, old)
        say(self.log, f"previous version {previous} (pid {pid}) {'stopped' if stopped else 'was not running'}")

    def result(self, staged: _Started) -> dict[str, Any]:
        return staged.outcome


def deploy(
    bundle_dir: Path,
    version: str,
    *,
    state_root: Path,
    endpoint: str,
    port: int,
    smoke: tuple[np.ndarray, np.ndarray],
    metric: Mapping[str, Any],
    log: Log = None,
) -> dict[str, Any]:
    """Serve the model bundle ``bundle_dir`` as ``endpoint`` version ``version`` behind the gateway on
    ``http://127.0.0.1:{port}/v1/models/{endpoint}``, blue/green.

    ``smoke`` is (inputs ``[n, d]`` in the signature's order, raw as a client sends them; targets
    ``[n]``); ``metric`` the model's metric spec (name, gate, ...). The new version is started next to
    the old one, smoke-tested (its metric on what the server answers must pass the gate) and
    load-tested directly, and only then does ``active.json`` switch. Any failure before (or while
    verifying) the switch stops the new process, leaves the old version serving and raises
    :class:`DeploymentError`; bad arguments raise ValueError before anything starts. Deploying the
    version that is already active and healthy returns its original result without touching anything.
    """
    request = DeployRequest(version, bundle_dir, metric=metric, smoke=lambda: smoke)
    return roll(LocalTarget(state_root, endpoint, port, log), request)


def stop_endpoint(state_root: Path, endpoint: str) -> dict[str, Any]:
    """Stop every version process recorded for ``endpoint``; idempotent. The gateway keeps serving the
    other endpoints (this one then answers 503)."""
    edir = endpoint_dir(state_root, endpoint)
    if not edir.is_dir():
        return {"endpoint": endpoint, "stopped_pids": []}
    stopped: list[int] = []
    with endpoint_lock(edir):
        # A router of the one-endpoint layout (started with --state-dir <endpoint folder>) is stopped too.
        legacy = read_json(edir / "router.json") or {}
        if terminate(legacy.get("pid"), ROUTER_MODULE, str(edir)):
            stopped.append(legacy["pid"])
        for path in sorted((edir / "versions").glob("*.json")):
            record = read_json(path) or {}
            if terminate(record.get("pid"), SERVER_MODULE, str(_ready_file(edir, path.stem))):
                stopped.append(record["pid"])
            if record.get("status") in ("starting", "active"):
                record.update(status="stopped", stopped_at=now())
                write_json(path, record)
        active = read_json(edir / ACTIVE_FILE) or {}
        if terminate(active.get("pid"), SERVER_MODULE, str(_ready_file(edir, str(active.get("version"))))):
            stopped.append(active["pid"])
        # Nothing serves any more; an active.json left behind would describe a dead backend.
        (edir / ACTIVE_FILE).unlink(missing_ok=True)
    return {"endpoint": endpoint, "stopped_pids": stopped}


def stop_gateway(state_root: Path) -> dict[str, Any]:
    """Stop the gateway and every endpoint under ``state_root``; idempotent."""
    root = _root(state_root)
    if not root.is_dir():
        return {"stopped_pids": [], "endpoints": []}
    stopped: list[int] = []
    # Gateway first (no new traffic), then each endpoint under its own lock: never both locks at once,
    # since a deploy takes its endpoint's lock before the gateway's.
    with gateway_lock(root):
        gateway = read_json(root / GATEWAY_FILE) or {}
        if terminate(gateway.get("pid"), ROUTER_MODULE, str(root)):
            stopped.append(gateway["pid"])
    endpoints = known_endpoints(root)
    for name in endpoints:
        stopped += stop_endpoint(root, name)["stopped_pids"]
    return {"stopped_pids": stopped, "endpoints": endpoints}



def endpoint_status(state_root: Path, endpoint: str) -> dict[str, Any]:
    """What is recorded for ``endpoint`` and whether those processes are up and answering."""
    root = _root(state_root)
    edir = endpoint_dir(root, endpoint)
    active = read_json(edir / ACTIVE_FILE)
    gateway = gateway_status(root)
    answered: dict[str, Any] = {}
    if gateway["running"] and gateway["port"]:
        try:
            status, body = http_json("GET", model_url(gateway["url"], endpoint), timeout=2.0)
            answered = {"http_status": status, "version": body.get("version"), "error": body.get("error")}
        except OSError as exc:
            answered = {"error": str(exc)}
    versions = {}
    for path in sorted((edir / "versions").glob("*.json")) if edir.is_dir() else []:
        record = read_json(path) or {}
        pid = record.get("pid")
        versions[path.stem] = {
            "status": record.get("status"),
            "pid": pid,
            "url": record.get("url"),
            "model": record.get("model"),
            "variant": record.get("variant"),
            "running": bool(pid) and is_ours(pid, SERVER_MODULE, str(_ready_file(edir, path.stem))) and alive(pid),
        }
    active_version = active.get("version") if active else None
    return {
        "endpoint": endpoint,
        "endpoint_url": model_url(gateway["url"], endpoint) if gateway["url"] else None,
        "active_version": active_version,
        "active": {k: v for k, v in active.items() if k != "result"} if active else None,
        "healthy": answered.get("http_status") == 200 and answered.get("version") == active_version,
        "answered": answered,
        "gateway": gateway,
        "versions": versions,
    }
