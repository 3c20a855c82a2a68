"""The local deploy target: blue/green of model bundles behind one model gateway on 127.0.0.1.

Layout under ``state_root``:

- ``router.json`` / ``router.log`` / ``.gateway.lock``: the gateway (:mod:`hybridflow.serving.gateway`).
- ``<endpoint>/active.json``: the version the gateway forwards ``/v1/models/<endpoint>`` to
  (``version``, ``url``, ``pid``, deploy ``result``) and, while a new version is a canary, that one
  with its share (``canary``: ``version``, ``url``, ``pid``, ``percent``); replaced atomically, which
  is the whole switch.
- ``<endpoint>/.lock``: one deployer per endpoint at a time.
- ``<endpoint>/versions/<version>.json`` / ``.log`` / ``.ready``: each version's server process, its
  log, and the file the server writes its bound port into once it is serving.

A new version must pass, in turn: readiness, health, the smoke test, the gate (a load test of it
and of the serving version side by side, :mod:`hybridflow.serving.rollout`), then each canary step
of ``serving.canary.steps`` over a window of traffic through the gateway, and one window after
promotion; the previous version serves until then and is stopped only after it. A failure anywhere
puts the previous version back in front of all traffic and stops the new one.

Processes are started detached and stopped only by recorded pid after checking it is still the
process we started (:mod:`hybridflow.serving.processes`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.errors import DeploymentError
from hybridflow.serving.base import DeployRequest, DeployTarget, Serving, Staged, roll
from hybridflow.serving.checks import (
    DeployPlan,
    StepFailed,
    backend_healthy,
    check_endpoint,
    http_json,
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
    DRAIN_S,
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
from hybridflow.serving.rollout import run_gate, run_window
from hybridflow.serving.router import ACTIVE_FILE, TAKEOVER, known_endpoints

if TYPE_CHECKING:
    from hybridflow.config import Estate, ServingSettings
    from hybridflow.config.pipeline import ModelServerSettings

SERVER_MODULE = "hybridflow.serving.server"
START_TIMEOUT_S = 120.0  # importing torch on a busy machine takes a while


def _root(state_root: Path) -> Path:
    return Path(state_root).resolve()


def endpoint_dir(state_root: Path, endpoint: str) -> Path:
    check_endpoint(endpoint)
    return _root(state_root) / endpoint


def _ready_file(edir: Path, version: str) -> Path:
    return edir / "versions" / f"{version}.ready"


def server_command(settings: ModelServerSettings) -> tuple[str, list[str]]:
    """(the python that runs model servers, the ``serving.server`` settings as its flags)."""
    try:
        from hybridflow.serving.runtime import serve_python, server_args
    except ImportError:  # a package without the model server's own environment: this interpreter
        return sys.executable, []
    return serve_python(), server_args(settings)


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
    switched: bool = False  # active.json names it (as the canary or as the version serving)
    stable_url: str | None = None  # the previous version's server, if it answered when the gate ran
    stable_figures: Any = None  # the previous version's figures in the last window it took traffic
    outcome: dict[str, Any] = field(default_factory=dict)


class LocalTarget(DeployTarget[_Started]):
    """Each version is its own server process on a free loopback port; the gateway on ``port``
    forwards the endpoint to whichever one ``active.json`` names."""

    name = "local"

    def __init__(self, state_root: Path, endpoint: str, port: int, log: Log = None,
                 settings: ServingSettings | None = None) -> None:
        from hybridflow.config import ServingSettings

        self.state_root, self.endpoint, self.port, self.log = state_root, endpoint, port, log
        self.settings = settings if settings is not None else ServingSettings()

    @classmethod
    def from_estate(cls, estate: Estate, endpoint: str, *, state_dir: Path, log: Any = None) -> LocalTarget:
        serving = estate.pipeline.serving
        return cls(Path(state_dir) / "serving", endpoint, serving.port, log, serving)

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
            ensure_gateway(self.root, self.port, self.log, self.settings.server)
        except StepFailed as exc:
            raise DeploymentError(f"{self.endpoint} version {current.version} is active but the gateway cannot "
                                  f"start: {exc}") from exc
        say(self.log, f"{self.endpoint} version {current.version} is already active and healthy on "
                      f"{self._endpoint_url}; nothing to do")
        return {**active["result"], "status": "kept"}

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
        python, flags = server_command(self.settings.server)
        proc = spawn([SERVER_MODULE, "--bundle", str(plan.bundle_dir), "--endpoint", self.endpoint,
                      "--version", version, "--port", "0", "--ready-file", str(ready), *flags], log_path, self.edir,
                     python=python)
        record: dict[str, Any] = {
            "endpoint": self.endpoint, "version": version, "model": card.model, "variant": card.variant,
            "bundle": str(plan.bundle_dir), "pid": proc.pid, "port": None, "url": None, "log": str(log_path),
            "status": "starting", "started_at": now(),
        }
        write_json(record_path, record)
        say(self.log, f"started {self.endpoint} version {version} ({card.model}, {card.variant}) as pid "
                      f"{proc.pid}; log {log_path}")
        return _Started(version, current, plan=plan, proc=proc, record=record, record_path=record_path,
                        log_path=log_path, ready=ready, log_since=log_since,
                        outcome=self._outcome(plan, current, proc.pid))

    def check(self, staged: _Started) -> None:
        """Gateway up, server ready and healthy, smoke metric within the gate, then the gate's numbers."""
        plan, proc, version, endpoint = staged.plan, staged.proc, staged.version, self.endpoint
        # While the new server loads its model: a gateway that cannot run fails the deploy early.
        staged.step = "gateway"
        ensure_gateway(self.root, self.port, self.log, self.settings.server)
        staged.step = "start"
        backend_port = wait_ready(proc, staged.ready, staged.log_path, staged.log_since, START_TIMEOUT_S)
        url = url_of(backend_port)
        staged.record.update(port=backend_port, url=url)
        staged.outcome["backend_url"] = url
        write_json(staged.record_path, staged.record)
        wait_healthy(url, endpoint, version, proc.pid)
        staged.step = "smoke test"
        rows = plan.rows
        value = plan.score(predict(url, endpoint, rows, version))
        gate = plan.metric.gate
        say(self.log, f"{endpoint} version {version} smoke {plan.metric.name} {value:.4f} on {len(rows)} known "
                      f"inputs (gate {gate:g}, {plan.metric.better} is better)")
        staged.outcome["smoke_metric"] = {"name": plan.metric.name, "value": value, "gate": gate}
        if not plan.metric.passes(value):
            side = "below" if plan.metric.better == "higher" else "above"
            raise StepFailed(f"smoke {plan.metric.name} {value:.4f} on {len(rows)} known inputs is {side} "
                             f"the gate {gate:g}")
        staged.step = "gate"
        previous = staged.previous
        if previous is not None and backend_healthy(dict(previous.detail), endpoint):
            staged.stable_url = previous.detail["url"]
        outcome, new, _ = run_gate(url, staged.stable_url, endpoint, rows, self.settings.gate, version=version,
                                   serving_version=previous.version if previous else None, log=self.log)
        staged.outcome.update(gate=outcome, p50_ms=new.p50_ms, p99_ms=new.p99_ms)
        if not outcome["passed"]:
            raise StepFailed("the gate: " + "; ".join(outcome["reasons"]))

    def _outcome(self, plan: DeployPlan, current: Serving | None, pid: int) -> dict[str, Any]:
        """The outcome (contract of :func:`hybridflow.pipeline.deploy`'s ``deploy.json``), filled in as
        the steps pass."""
        return {
            "endpoint": self.endpoint, "endpoint_url": self._endpoint_url, "version": plan.version,
            "previous_version": current.version if current else None, "model": plan.card.model,
            "variant": plan.card.variant, "target": self.name, "smoke_metric": None, "smoke_rows": len(plan.rows),
            "gate": None, "canary": [], "rolled_back": None, "status": "deploying", "backend_url": None, "pid": pid,
        }

    def steps(self, staged: _Started) -> list[int]:
        """``serving.canary.steps``; all at once when no previous version answers to share traffic with."""
        return list(self.settings.canary.steps) if staged.stable_url else [100]

    def _activate(self, staged: _Started, percent: int) -> None:
        plan, proc = staged.plan, staged.proc
        mine = {"version": staged.version, "url": staged.outcome["backend_url"], "pid": proc.pid}
        if percent < 100:
            stable = {k: v for k, v in dict(staged.previous.detail).items() if k != "canary"}
            body = {**stable, "canary": {**mine, "percent": percent, "since": now()}}
        else:
            body = {**mine, "model": plan.card.model, "variant": plan.card.variant, "bundle": str(plan.bundle_dir),
                    "activated_at": now(), "result": staged.outcome}
        # While the endpoint is taken over by the DR side (a cluster declared down), the gateway keeps
        # routing there: only a failback through the gate (hybridflow.dr.failover.serving_failback) ends it.
        takeover = (read_json(self.edir / ACTIVE_FILE) or {}).get(TAKEOVER)
        if takeover:
            body[TAKEOVER] = takeover
        staged.switched = True
        write_json(self.edir / ACTIVE_FILE, body)

    def shift(self, staged: _Started, percent: int) -> None:
        """``percent`` of the endpoint's requests go to the new version for one window of traffic, judged
        against the previous version's; at 100 the new version serves everything and that window is the
        check after promotion (the previous version still runs, to roll back to)."""
        staged.step = "after promotion" if percent >= 100 else f"canary at {percent} %"
        self._activate(staged, percent)
        previous = staged.previous.version if staged.previous and staged.stable_url else None
        if percent < 100:
            say(self.log, f"{self._endpoint_url}: {percent} % of requests to version {staged.version}, the rest to "
                          f"{previous}")
        else:
            say(self.log, f"switched {self._endpoint_url} to version {staged.version}")
            verify_gateway(self.port, self.endpoint, staged.version, staged.plan.rows)
        step, staged.stable_figures = run_window(
            url_of(self.port), self.endpoint, staged.plan.rows, self.settings.canary, self.settings.gate,
            percent=percent, version=staged.version, stable_version=previous, stable_before=staged.stable_figures,
            log=self.log)
        staged.outcome["canary"].append(step)
        if not step["passed"]:
            raise StepFailed(f"{staged.step}: " + "; ".join(step["reasons"]))
        if percent >= 100:
            staged.outcome["status"] = "deployed"
            self._activate(staged, 100)  # the result on record is the final one
            staged.record.update(status="active", activated_at=now())
            write_json(staged.record_path, staged.record)

    def rollback(self, staged: _Started, error: BaseException) -> Exception | None:
        previous = staged.previous
        if staged.switched:
            # The old version goes back in front before the new one stops: the endpoint never points nowhere.
            if previous is not None:
                write_json(self.edir / ACTIVE_FILE, {k: v for k, v in dict(previous.detail).items() if k != "canary"})
            else:
                (self.edir / ACTIVE_FILE).unlink(missing_ok=True)
        stop_child(staged.proc)
        staged.record.update(status="failed", error=f"{staged.step}: {error}", stopped_at=now())
        write_json(staged.record_path, staged.record)
        was = previous.version if previous else None
        staged.outcome.update(status="rolled_back", rolled_back={"step": staged.step, "reason": str(error),
                                                                 "serving": was})
        if not isinstance(error, StepFailed | OSError | DeploymentError):
            return None  # interrupted (e.g. the task was killed): no orphan left behind, the error stands
        keeps = f"version {was} keeps serving" if was else "no version was serving"
        moved = " and all traffic is back on it" if staged.switched and was else ""
        return DeploymentError(f"{self.endpoint} version {staged.version} was not deployed ({staged.step}): "
                               f"{error}. {keeps}{moved} on {self._endpoint_url}; server log: {staged.log_path}",
                               outcome=staged.outcome)

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
    serving: ServingSettings | None = None,
) -> dict[str, Any]:
    """Serve the model bundle ``bundle_dir`` as ``endpoint`` version ``version`` behind the gateway on
    ``http://127.0.0.1:{port}/v1/models/{endpoint}``: gate first, then canary steps.

    ``smoke`` is (inputs ``[n, d]`` in the signature's order, raw as a client sends them; targets
    ``[n]``); ``metric`` the model's metric spec (name, gate, ...); ``serving`` the estate's serving
    settings (its ``server``, ``gate`` and ``canary``; their defaults when None). The new version is
    started next to the old one, smoke-tested (its metric on what the server answers must pass the
    gate) and load-tested next to the serving version against ``serving.gate``; only then does it take
    traffic, in the steps of ``serving.canary``, each judged over a window against the serving
    version, and one window more once it serves everything. Any failure stops the new process, puts
    the old version back in front of all traffic and raises :class:`DeploymentError` (its
    ``outcome``: the figures so far); bad arguments raise ValueError before anything starts. Deploying
    the version that is already active and healthy returns its result (``status`` ``kept``) without
    touching anything.
    """
    request = DeployRequest(version, bundle_dir, metric=metric, smoke=lambda: smoke)
    return roll(LocalTarget(state_root, endpoint, port, log, serving), request)


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
        dr = active.get(TAKEOVER) or {}  # the DR side's server (hybridflow.dr.failover.serving)
        if terminate(dr.get("pid"), SERVER_MODULE, str(edir / TAKEOVER / f"{dr.get('version')}.ready")):
            stopped.append(dr["pid"])
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
