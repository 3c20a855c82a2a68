"""Blue/green deployment of model bundles behind one model gateway on 127.0.0.1.

Layout under ``state_root``:

- ``router.json`` / ``router.log`` / ``.gateway.lock``: the gateway process (pid, port), its log, and
  the lock that makes starting it safe when deploys of different endpoints race.
- ``<endpoint>/active.json``: the version the gateway forwards ``/v1/models/<endpoint>`` to
  (``version``, ``url``, ``pid``, deploy ``result``); replaced atomically, which is the whole switch.
- ``<endpoint>/.lock``: one deployer per endpoint at a time.
- ``<endpoint>/versions/<version>.json`` / ``.log`` / ``.ready``: each version's server process, its
  log, and the file the server writes its bound port into once it is serving.

Processes are started detached (own session) so they outlive the task that deployed them, and are
only ever stopped by recorded pid after checking that pid's command line is the process we started
(pids get reused).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.errors import DeploymentError
from hybridflow.serving.router import ACTIVE_FILE, ENDPOINT_RE, MODELS_PREFIX, known_endpoints
from hybridflow.serving.server import MAX_INSTANCES, BadRequest, InputSchema

SERVER_MODULE = "hybridflow.serving.server"
ROUTER_MODULE = "hybridflow.serving.router"
HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0  # importing torch on a busy machine takes a while
ROUTER_START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LOCK_TIMEOUT_S = 300.0
LOAD_REQUESTS = 200
LOAD_THREADS = 4
SMOKE_BATCH = MAX_INSTANCES  # the server's per-request limit
VERIFY_ROWS = 16
DRAIN_S = 1.0  # let requests already forwarded to the old version finish before it is stopped
GATEWAY_FILE = "router.json"
GATEWAY_LOG = "router.log"
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

Log = Callable[[str], Any] | logging.Logger | None


class _Failed(Exception):
    """A deployment step failed; the message says which and why."""


# --------------------------------------------------------------------------- small helpers


def _say(log: Log, message: str) -> None:
    if log is None:
        return
    if isinstance(log, logging.Logger) or hasattr(log, "info"):
        log.info(message)  # type: ignore[union-attr]
    else:
        log(message)


def _check_version(version: str) -> None:
    if not isinstance(version, str) or not _VERSION.match(version):
        raise ValueError(f"version={version!r}: use 1-64 letters, numbers, '.', '_' or '-' "
                         "(it names files under the state root)")


def _check_endpoint(endpoint: str) -> None:
    if not isinstance(endpoint, str) or not ENDPOINT_RE.match(endpoint):
        raise ValueError(f"endpoint={endpoint!r}: use 1-63 lowercase letters, numbers or '-' "
                         "(it is a URL path segment and a folder under the state root)")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so readers (the gateway) see either the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _tail(path: Path, since: int = 0, limit: int = 2000) -> str:
    """The end of what this attempt wrote (logs are appended to across attempts)."""
    try:
        data = path.read_bytes()[since:][-limit:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for any HTTP answer; OSError when nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = {}
    return status, parsed if isinstance(parsed, dict) else {}


def _child_env() -> dict[str, str]:
    import hybridflow

    env = dict(os.environ)
    # The child must import this very package even when it is not installed (e.g. run from a checkout).
    package_root = str(Path(hybridflow.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# --------------------------------------------------------------------------- processes


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _alive(pid: int) -> bool:
    try:  # reap it if it is our child, else it lingers as a zombie that looks alive
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    except OSError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _is_ours(pid: int, module: str, marker: str) -> bool:
    """True only for the process we started: its argv names our module and this endpoint's marker."""
    args = _cmdline(pid)
    return module in args and marker in args


def _terminate(pid: int | None, module: str, marker: str) -> bool:
    """Stop ``pid`` if it is still the process we started; True if it was stopped."""
    # Identity first: a zombie or a reused pid has another (or no) command line, and must not be
    # signalled or reaped here.
    if not pid or not _is_ours(pid, module, marker) or not _alive(pid):
        return False
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            time.sleep(0.05)
    return not _alive(pid)


def _stop_child(proc: subprocess.Popen) -> bool:
    """Stop a process this deployer started itself: until it is reaped its pid cannot be reused, and
    for a moment after the spawn its /proc command line still reads empty (so no identity check)."""
    if proc.poll() is not None:
        return False
    for stop in (proc.terminate, proc.kill):
        stop()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
            return True
        except subprocess.TimeoutExpired:
            pass
    return False


def _spawn(args: list[str], log_path: Path, cwd: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", *args],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=_child_env(),
            start_new_session=True,  # survives the task process and its process-group kill
        )


@contextmanager
def _locked(path: Path, holder: str) -> Iterator[None]:
    """An exclusive flock on ``path``, waited for at most LOCK_TIMEOUT_S."""
    with open(path, "w") as fh:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() > deadline:
                    raise DeploymentError(
                        f"{holder} holds {path} for over {LOCK_TIMEOUT_S:.0f}s; retry later"
                    ) from exc
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _endpoint_lock(edir: Path) -> Any:
    """One deployer per endpoint at a time (Airflow retries and parallel runs)."""
    return _locked(edir / ".lock", "another deployment of this endpoint")


def _gateway_lock(root: Path) -> Any:
    """One gateway starter at a time: deploys of different endpoints share the gateway."""
    return _locked(root / ".gateway.lock", "another deployment starting the gateway")


# --------------------------------------------------------------------------- layout


def _root(state_root: Path) -> Path:
    return Path(state_root).resolve()


def endpoint_dir(state_root: Path, endpoint: str) -> Path:
    _check_endpoint(endpoint)
    return _root(state_root) / endpoint


def _ready_file(edir: Path, version: str) -> Path:
    return edir / "versions" / f"{version}.ready"


def _url(port: int) -> str:
    return f"http://{HOST}:{port}"


def _model_url(base: str, endpoint: str) -> str:
    return f"{base}{MODELS_PREFIX}{endpoint}"


# --------------------------------------------------------------------------- arguments


class _Plan:
    """What a deployment needs, checked before anything is started."""

    def __init__(self, bundle_dir: Path, version: str, endpoint: str, port: int,
                 smoke: tuple[np.ndarray, np.ndarray], metric: Mapping[str, Any]) -> None:
        from hybridflow import bundle, scoring
        from hybridflow.registry import METRICS, MetricSpec

        _check_version(version)
        _check_endpoint(endpoint)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port={port!r}; use a TCP port 1..65535")
        self.bundle_dir = Path(bundle_dir).resolve()
        try:
            self.card = bundle.read_card(self.bundle_dir)
        except (FileNotFoundError, ValueError) as exc:
            raise DeploymentError(f"{exc}; nothing was deployed") from exc
        if not (self.bundle_dir / bundle.WEIGHTS_FILE).is_file():
            raise DeploymentError(f"{self.bundle_dir} has no {bundle.WEIGHTS_FILE}; nothing was deployed")
        if self.card.variant not in bundle.VARIANTS:
            raise DeploymentError(f"{self.bundle_dir}: variant {self.card.variant!r} is not one of "
                                  f"{', '.join(bundle.VARIANTS)}; nothing was deployed")
        try:
            self.schema = InputSchema(self.card.signature)
        except ValueError as exc:
            raise DeploymentError(f"{self.bundle_dir}: the card's signature is invalid: {exc}") from exc
        self.output = self.card.output

        if not isinstance(metric, Mapping):
            raise ValueError(f"metric={metric!r}; pass the model's metric spec {{name, gate, ...}} (models.yaml)")
        self.metric = MetricSpec.model_validate(dict(metric))
        if self.output["type"] not in METRICS[self.metric.name][1]:
            raise ValueError(f"metric {self.metric.name} cannot score the {self.output['type']} output of "
                             f"{self.card.model}; use the model's registered metric")

        x, y = np.asarray(smoke[0]), np.asarray(smoke[1])
        width = self.schema.width
        if x.ndim != 2 or x.shape[1] != width or len(x) == 0 or y.shape != (len(x),):
            raise ValueError(f"smoke must be (inputs [n, {width}] in {self.card.model}'s signature order, "
                             f"targets [n]) with n >= 1; got {list(x.shape)} and {list(y.shape)}")
        if not np.issubdtype(x.dtype, np.number) and x.dtype != np.bool_:
            raise ValueError(f"smoke inputs must be numbers, got dtype {x.dtype}")
        self.rows = self.schema.instances(x)
        try:  # the smoke rows must be requests the new server accepts
            for start in range(0, len(self.rows), SMOKE_BATCH):
                self.schema.parse({"instances": self.rows[start:start + SMOKE_BATCH]})
        except BadRequest as exc:
            raise ValueError(f"smoke inputs do not fit {self.card.model}'s signature: {exc}") from exc
        self.targets = y
        try:  # targets the metric cannot score (e.g. one class for roc_auc) fail here, not after a start
            scoring.metric_value(self.metric.name, y, self._as_predictions(y), self.output)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"smoke targets cannot be scored with {self.metric.name}: {exc}") from exc

    def _as_predictions(self, values: Any) -> np.ndarray:
        return np.asarray(values, dtype=np.int64 if self.output["type"] == "class" else np.float64)

    def score(self, predictions: list[Any]) -> float:
        from hybridflow import scoring

        value = scoring.metric_value(self.metric.name, self.targets, self._as_predictions(predictions), self.output)
        return round(float(value), 6)


# --------------------------------------------------------------------------- steps


def _wait_ready(proc: subprocess.Popen, ready: Path, log_path: Path, since: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise _Failed(f"the server exited with code {code} before serving; log tail:\n{_tail(log_path, since)}")
        info = _read_json(ready)
        if info and info.get("pid") == proc.pid and isinstance(info.get("port"), int):
            return info["port"]
        time.sleep(0.1)
    raise _Failed(f"the server did not start serving within {timeout:.0f}s; log tail:\n{_tail(log_path, since)}")


def _wait_healthy(url: str, endpoint: str, version: str, pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = _http_json("GET", f"{url}/healthz", timeout=2.0)
            if status == 200 and (body.get("endpoint"), body.get("version"), body.get("pid")) == \
                    (endpoint, version, pid):
                return
            last = f"HTTP {status} {body}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise _Failed(f"{url}/healthz did not report {endpoint} version {version} within {timeout:.0f}s (last: {last})")


def _predict(base: str, endpoint: str, rows: list[list[Any]], version: str) -> list[Any]:
    url = f"{_model_url(base, endpoint)}:predict"
    out: list[Any] = []
    for start in range(0, len(rows), SMOKE_BATCH):
        status, body = _http_json("POST", url, {"instances": rows[start:start + SMOKE_BATCH]}, timeout=30.0)
        if status != 200:
            raise _Failed(f"POST {url} answered HTTP {status}: {body.get('error', body)}")
        if body.get("version") != version:
            raise _Failed(f"POST {url} answered from version {body.get('version')!r}, not {version!r}")
        out.extend(body["predictions"])
    return out


def _load_check(base: str, endpoint: str, rows: list[list[Any]], version: str) -> tuple[float, float]:
    """Single-row requests from a few threads; any error fails the deployment."""
    url = f"{_model_url(base, endpoint)}:predict"
    requests = [rows[i % len(rows)] for i in range(LOAD_REQUESTS)]

    def one(row: list[Any]) -> tuple[float, str | None]:
        start = time.perf_counter()
        try:
            status, body = _http_json("POST", url, {"instances": [row]}, timeout=10.0)
        except OSError as exc:
            return time.perf_counter() - start, str(exc)
        elapsed = time.perf_counter() - start
        if status != 200 or body.get("version") != version:
            return elapsed, f"HTTP {status} {body}"
        return elapsed, None

    with ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
        results = list(pool.map(one, requests))
    errors = [err for _, err in results if err]
    if errors:
        raise _Failed(f"load check: {len(errors)}/{LOAD_REQUESTS} requests failed (error rate must be 0); "
                      f"first: {errors[0]}")
    ms = np.asarray([t for t, _ in results]) * 1000.0
    return round(float(np.percentile(ms, 50)), 3), round(float(np.percentile(ms, 95)), 3)


def _gateway_identity(port: int, root: Path, timeout: float = 2.0) -> bool | None:
    """True: our gateway answers on ``port``; None: nothing answers; False: something else does."""
    return _probe_gateway(port, root, timeout)[0]


def _probe_gateway(port: int, root: Path, timeout: float = 2.0) -> tuple[bool | None, dict[str, Any]]:
    try:
        _, body = _http_json("GET", f"{_url(port)}/healthz", timeout=timeout)
    except OSError:
        return None, {}
    return body.get("router") is True and body.get("state_root") == str(root), body


def _ensure_gateway(root: Path, port: int, log: Log) -> None:
    with _gateway_lock(root):
        marker = str(root)
        found, body = _probe_gateway(port, root)
        if found:
            return
        if found is False:
            if isinstance(body.get("state_dir"), str) and Path(body["state_dir"]).parent == root:
                raise _Failed(f"port {port} is held by the one-endpoint router of an earlier version for "
                              f"{body['state_dir']} (pid {body.get('pid')}); stop it with stop_gateway({root}) "
                              "and deploy again")
            raise _Failed(f"port {port} is answered by something other than the model gateway for {root}; "
                          "free it or choose another serving port")
        recorded = _read_json(root / GATEWAY_FILE) or {}
        _terminate(recorded.get("pid"), ROUTER_MODULE, marker)  # ours but not answering on this port
        log_path = root / GATEWAY_LOG
        since = _log_size(log_path)
        proc = _spawn([ROUTER_MODULE, "--state-root", marker, "--port", str(port)], log_path, root)
        _write_json(root / GATEWAY_FILE, {"pid": proc.pid, "port": port, "log": str(log_path), "started_at": _now()})
        _say(log, f"started the model gateway pid {proc.pid} on {_url(port)}")
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                raise _Failed(f"the gateway exited with code {code}; log tail:\n{_tail(log_path, since)}")
            if _gateway_identity(port, root, timeout=0.5):  # a fresh gateway answers at once
                return
            time.sleep(0.1)
        _stop_child(proc)
        raise _Failed(f"the gateway did not answer on port {port} within {ROUTER_START_TIMEOUT_S:.0f}s")


def _verify_gateway(port: int, endpoint: str, version: str, rows: list[list[Any]], timeout: float = 10.0) -> None:
    base = _url(port)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            status, body = _http_json("GET", _model_url(base, endpoint), timeout=3.0)
            if status == 200 and body.get("version") == version:
                _predict(base, endpoint, rows[:VERIFY_ROWS], version)
                return
            last = f"GET {_model_url(base, endpoint)} HTTP {status} {body}"
        except (OSError, _Failed) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise _Failed(f"the gateway on port {port} does not serve {endpoint} version {version} after the switch ({last})")


def _backend_healthy(active: dict[str, Any], endpoint: str) -> bool:
    try:
        status, body = _http_json("GET", f"{active['url']}/healthz", timeout=2.0)
    except (OSError, KeyError, TypeError):
        return False
    return status == 200 and (body.get("endpoint"), body.get("version"), body.get("pid")) == \
        (endpoint, active.get("version"), active.get("pid"))


# --------------------------------------------------------------------------- public API


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
    plan = _Plan(bundle_dir, version, endpoint, port, smoke, metric)
    card, rows = plan.card, plan.rows
    root = _root(state_root)
    edir = endpoint_dir(root, endpoint)
    vdir = edir / "versions"
    vdir.mkdir(parents=True, exist_ok=True)
    endpoint_url = _model_url(_url(port), endpoint)
    with _endpoint_lock(edir):
        active_path = edir / ACTIVE_FILE
        active = _read_json(active_path)
        previous = active.get("version") if active else None

        if active and previous == version and isinstance(active.get("result"), dict) and \
                _backend_healthy(active, endpoint):
            try:
                _ensure_gateway(root, port, log)
            except _Failed as exc:
                raise DeploymentError(f"{endpoint} version {version} is active but the gateway cannot start: "
                                      f"{exc}") from exc
            _say(log, f"{endpoint} version {version} is already active and healthy on {endpoint_url}; nothing to do")
            return active["result"]

        record_path = vdir / f"{version}.json"
        log_path = vdir / f"{version}.log"
        ready = _ready_file(edir, version)
        leftover = _read_json(record_path) or {}
        if leftover.get("pid") and leftover.get("pid") != (active or {}).get("pid"):
            # An inactive process of this version (e.g. a crashed deployer's) would be orphaned otherwise.
            _terminate(leftover["pid"], SERVER_MODULE, str(ready))
        ready.unlink(missing_ok=True)

        log_since = _log_size(log_path)
        proc = _spawn([SERVER_MODULE, "--bundle", str(plan.bundle_dir), "--endpoint", endpoint,
                       "--version", version, "--port", "0", "--ready-file", str(ready)], log_path, edir)
        record: dict[str, Any] = {
            "endpoint": endpoint, "version": version, "model": card.model, "variant": card.variant,
            "bundle": str(plan.bundle_dir), "pid": proc.pid, "port": None, "url": None, "log": str(log_path),
            "status": "starting", "started_at": _now(),
        }
        _write_json(record_path, record)
        _say(log, f"started {endpoint} version {version} ({card.model}, {card.variant}) as pid {proc.pid}; "
                  f"log {log_path}")

        def fail(step: str, exc: BaseException) -> DeploymentError:
            _stop_child(proc)
            record.update(status="failed", error=f"{step}: {exc}", stopped_at=_now())
            _write_json(record_path, record)
            keeps = f"version {previous} keeps serving" if previous else "no version was serving"
            return DeploymentError(f"{endpoint} version {version} was not deployed ({step}): {exc}. {keeps} on "
                                   f"{endpoint_url}; server log: {log_path}")

        step = "gateway"
        try:
            # While the new server loads its model: a gateway that cannot run fails the deploy early.
            _ensure_gateway(root, port, log)
            step = "start"
            backend_port = _wait_ready(proc, ready, log_path, log_since, START_TIMEOUT_S)
            url = _url(backend_port)
            record.update(port=backend_port, url=url)
            _write_json(record_path, record)
            _wait_healthy(url, endpoint, version, proc.pid)
            step = "smoke test"
            value = plan.score(_predict(url, endpoint, rows, version))
            gate = plan.metric.gate
            _say(log, f"{endpoint} version {version} smoke {plan.metric.name} {value:.4f} on {len(rows)} known "
                      f"inputs (gate {gate:g}, {plan.metric.better} is better)")
            if not plan.metric.passes(value):
                side = "below" if plan.metric.better == "higher" else "above"
                raise _Failed(f"smoke {plan.metric.name} {value:.4f} on {len(rows)} known inputs is {side} "
                              f"the gate {gate:g}")
            step = "load check"
            p50, p95 = _load_check(url, endpoint, rows, version)
            _say(log, f"{endpoint} version {version} load check: {LOAD_REQUESTS} requests, p50 {p50} ms, "
                      f"p95 {p95} ms")
        except (_Failed, OSError, DeploymentError) as exc:
            raise fail(step, exc) from exc
        except BaseException as exc:  # interrupted (e.g. task killed): never leave an orphan behind
            fail(step, exc)
            raise

        result = {
            "endpoint": endpoint,
            "endpoint_url": endpoint_url,
            "version": version,
            "previous_version": previous,
            "model": card.model,
            "variant": card.variant,
            "smoke_metric": {"name": plan.metric.name, "value": value, "gate": gate},
            "smoke_rows": len(rows),
            "p50_ms": p50,
            "p95_ms": p95,
            "backend_url": url,
            "pid": proc.pid,
        }
        _write_json(active_path, {
            "version": version, "url": url, "pid": proc.pid, "model": card.model, "variant": card.variant,
            "bundle": str(plan.bundle_dir), "activated_at": _now(), "result": result,
        })
        _say(log, f"switched {endpoint_url} to version {version}")
        try:
            _verify_gateway(port, endpoint, version, rows)
        except BaseException as exc:
            # Put the old version back before stopping the new one, so the endpoint never points nowhere.
            if active:
                _write_json(active_path, active)
            else:
                active_path.unlink(missing_ok=True)
            err = fail("verify after switch", exc)
            if isinstance(exc, _Failed | OSError):
                raise err from exc
            raise
        record.update(status="active", activated_at=_now())
        _write_json(record_path, record)

        if active and active.get("pid") and active["pid"] != proc.pid:
            time.sleep(DRAIN_S)
            stopped = _terminate(active["pid"], SERVER_MODULE, str(_ready_file(edir, str(previous))))
            old_path = vdir / f"{previous}.json"
            old = _read_json(old_path)
            if old and old.get("pid") == active["pid"]:
                old.update(status="stopped", stopped_at=_now())
                _write_json(old_path, old)
            _say(log, f"previous version {previous} (pid {active['pid']}) {'stopped' if stopped else 'was not running'}")
        return result


def stop_endpoint(state_root: Path, endpoint: str) -> dict[str, Any]:
    """Stop every version process recorded for ``endpoint``; idempotent. The gateway keeps serving the
    other endpoints (this one then answers 503)."""
    edir = endpoint_dir(state_root, endpoint)
    if not edir.is_dir():
        return {"endpoint": endpoint, "stopped_pids": []}
    stopped: list[int] = []
    with _endpoint_lock(edir):
        # A router of the one-endpoint layout (started with --state-dir <endpoint folder>) is stopped too.
        legacy = _read_json(edir / "router.json") or {}
        if _terminate(legacy.get("pid"), ROUTER_MODULE, str(edir)):
            stopped.append(legacy["pid"])
        for path in sorted((edir / "versions").glob("*.json")):
            record = _read_json(path) or {}
            if _terminate(record.get("pid"), SERVER_MODULE, str(_ready_file(edir, path.stem))):
                stopped.append(record["pid"])
            if record.get("status") in ("starting", "active"):
                record.update(status="stopped", stopped_at=_now())
                _write_json(path, record)
        active = _read_json(edir / ACTIVE_FILE) or {}
        if _terminate(active.get("pid"), SERVER_MODULE, str(_ready_file(edir, str(active.get("version"))))):
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
    with _gateway_lock(root):
        gateway = _read_json(root / GATEWAY_FILE) or {}
        if _terminate(gateway.get("pid"), ROUTER_MODULE, str(root)):
            stopped.append(gateway["pid"])
    endpoints = known_endpoints(root)
    for name in endpoints:
        stopped += stop_endpoint(root, name)["stopped_pids"]
    return {"stopped_pids": stopped, "endpoints": endpoints}


def _gateway_status(root: Path) -> dict[str, Any]:
    gateway = _read_json(root / GATEWAY_FILE) or {}
    pid, port = gateway.get("pid"), gateway.get("port")
    running = bool(pid) and _is_ours(pid, ROUTER_MODULE, str(root)) and _alive(pid)
    return {"pid": pid, "port": port, "url": _url(port) if port else None, "running": running}


def endpoint_status(state_root: Path, endpoint: str) -> dict[str, Any]:
    """What is recorded for ``endpoint`` and whether those processes are up and answering."""
    root = _root(state_root)
    edir = endpoint_dir(root, endpoint)
    active = _read_json(edir / ACTIVE_FILE)
    gateway = _gateway_status(root)
    answered: dict[str, Any] = {}
    if gateway["running"] and gateway["port"]:
        try:
            status, body = _http_json("GET", _model_url(gateway["url"], endpoint), timeout=2.0)
            answered = {"http_status": status, "version": body.get("version"), "error": body.get("error")}
        except OSError as exc:
            answered = {"error": str(exc)}
    versions = {}
    for path in sorted((edir / "versions").glob("*.json")) if edir.is_dir() else []:
        record = _read_json(path) or {}
        pid = record.get("pid")
        versions[path.stem] = {
            "status": record.get("status"),
            "pid": pid,
            "url": record.get("url"),
            "model": record.get("model"),
            "variant": record.get("variant"),
            "running": bool(pid) and _is_ours(pid, SERVER_MODULE, str(_ready_file(edir, path.stem))) and _alive(pid),
        }
    active_version = active.get("version") if active else None
    return {
        "endpoint": endpoint,
        "endpoint_url": _model_url(gateway["url"], endpoint) if gateway["url"] else None,
        "active_version": active_version,
        "active": {k: v for k, v in active.items() if k != "result"} if active else None,
        "healthy": answered.get("http_status") == 200 and answered.get("version") == active_version,
        "answered": answered,
        "gateway": gateway,
        "versions": versions,
    }
