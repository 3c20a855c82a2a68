"""Blue/green deployment of a model version behind a stable endpoint on 127.0.0.1.

State of an endpoint lives in ``state_root/<endpoint>/``:

- ``active.json``: the version the router forwards to (``version``, ``url``, ``pid``, deploy ``result``);
  replaced atomically, which is the whole traffic switch.
- ``router.json`` / ``router.log``: the router process (pid, port) and its log.
- ``versions/<version>.json`` / ``.log`` / ``.ready``: each version's server process, its log, and the
  file the server writes its bound port into once it is serving.

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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.errors import DeploymentError

SERVER_MODULE = "hybridflow.serving.server"
ROUTER_MODULE = "hybridflow.serving.router"
HOST = "127.0.0.1"
VARIANTS = ("int8", "fp16", "fp32")
START_TIMEOUT_S = 120.0  # importing torch on a busy machine takes a while
ROUTER_START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LOCK_TIMEOUT_S = 300.0
LOAD_REQUESTS = 200
LOAD_THREADS = 4
SMOKE_BATCH = 1024  # the server's per-request limit
DRAIN_S = 1.0  # let requests already forwarded to the old version finish before it is stopped
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

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


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{kind}={value!r}: use 1-64 letters, digits, '.', '_' or '-' (it names files under the state root)"
        )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so readers (the router) see either the old or the new file, never half."""
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
def _endpoint_lock(edir: Path) -> Iterator[None]:
    """One deployer per endpoint at a time (Airflow retries and parallel runs)."""
    with open(edir / ".lock", "w") as fh:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() > deadline:
                    raise DeploymentError(
                        f"another deployment holds {edir / '.lock'} for over {LOCK_TIMEOUT_S:.0f}s; retry later"
                    ) from exc
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- layout


def endpoint_dir(state_root: Path, endpoint: str) -> Path:
    _check_name("endpoint", endpoint)
    return Path(state_root).resolve() / endpoint


def _ready_file(edir: Path, version: str) -> Path:
    return edir / "versions" / f"{version}.ready"


def _url(port: int) -> str:
    return f"http://{HOST}:{port}"


# --------------------------------------------------------------------------- steps


def _wait_ready(proc: subprocess.Popen, ready: Path, log_path: Path, since: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise _Failed(
                f"the server exited with code {code} before serving; log tail:\n{_tail(log_path, since)}"
            )
        info = _read_json(ready)
        if info and info.get("pid") == proc.pid and isinstance(info.get("port"), int):
            return info["port"]
        time.sleep(0.1)
    raise _Failed(
        f"the server did not start serving within {timeout:.0f}s; log tail:\n{_tail(log_path, since)}"
    )


def _wait_healthy(url: str, version: str, pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = _http_json("GET", f"{url}/healthz", timeout=2.0)
            if status == 200 and body.get("version") == version and body.get("pid") == pid:
                return
            last = f"HTTP {status} {body}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise _Failed(f"{url}/healthz did not report version {version} within {timeout:.0f}s (last: {last})")


def _predict(url: str, pixels: np.ndarray, version: str) -> np.ndarray:
    out: list[int] = []
    for start in range(0, len(pixels), SMOKE_BATCH):
        rows = pixels[start : start + SMOKE_BATCH].tolist()
        status, body = _http_json("POST", f"{url}/predict", {"instances": rows}, timeout=30.0)
        if status != 200:
            raise _Failed(f"POST {url}/predict answered HTTP {status}: {body.get('error', body)}")
        if body.get("version") != version:
            raise _Failed(
                f"POST {url}/predict answered from version {body.get('version')!r}, not {version!r}"
            )
        out.extend(body["predictions"])
    return np.asarray(out, dtype=np.int64)


def _load_check(url: str, pixels: np.ndarray, version: str) -> tuple[float, float]:
    """Single-row requests from a few threads; any error fails the deployment."""
    rows = [pixels[i % len(pixels)].tolist() for i in range(LOAD_REQUESTS)]

    def one(row: list) -> tuple[float, str | None]:
        start = time.perf_counter()
        try:
            status, body = _http_json("POST", f"{url}/predict", {"instances": [row]}, timeout=10.0)
        except OSError as exc:
            return time.perf_counter() - start, str(exc)
        elapsed = time.perf_counter() - start
        if status != 200 or body.get("version") != version:
            return elapsed, f"HTTP {status} {body}"
        return elapsed, None

    with ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
        results = list(pool.map(one, rows))
    errors = [err for _, err in results if err]
    if errors:
        raise _Failed(
            f"load check: {len(errors)}/{LOAD_REQUESTS} requests failed (error rate must be 0); first: {errors[0]}"
        )
    ms = np.asarray([t for t, _ in results]) * 1000.0
    return round(float(np.percentile(ms, 50)), 3), round(float(np.percentile(ms, 95)), 3)


def _router_identity(port: int, marker: str) -> bool | None:
    """True: our router answers on ``port``; None: nothing answers; False: something else does."""
    try:
        _, body = _http_json("GET", f"{_url(port)}/healthz", timeout=2.0)
    except OSError:
        return None
    return body.get("router") is True and body.get("state_dir") == marker


def _ensure_router(edir: Path, port: int, log: Log) -> None:
    marker = str(edir)
    found = _router_identity(port, marker)
    if found:
        return
    if found is False:
        raise _Failed(
            f"port {port} is answered by something other than the router for {edir}; "
            f"free it or choose another serving port"
        )
    recorded = _read_json(edir / "router.json") or {}
    _terminate(recorded.get("pid"), ROUTER_MODULE, marker)  # ours but not answering on this port
    log_path = edir / "router.log"
    since = _log_size(log_path)
    proc = _spawn([ROUTER_MODULE, "--state-dir", marker, "--port", str(port)], log_path, edir)
    _write_json(
        edir / "router.json", {"pid": proc.pid, "port": port, "log": str(log_path), "started_at": _now()}
    )
    _say(log, f"started router pid {proc.pid} on {_url(port)}")
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise _Failed(f"the router exited with code {code}; log tail:\n{_tail(log_path, since)}")
        if _router_identity(port, marker):
            return
        time.sleep(0.1)
    _terminate(proc.pid, ROUTER_MODULE, marker)
    raise _Failed(f"the router did not answer on port {port} within {ROUTER_START_TIMEOUT_S:.0f}s")


def _verify_router(port: int, version: str, pixels: np.ndarray, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            status, body = _http_json("GET", f"{_url(port)}/healthz", timeout=3.0)
            if status == 200 and body.get("version") == version:
                _predict(_url(port), pixels[:16], version)
                return
            last = f"/healthz HTTP {status} {body}"
        except (OSError, _Failed) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise _Failed(f"the router on port {port} does not serve version {version} after the switch ({last})")


def _backend_healthy(active: dict[str, Any]) -> bool:
    try:
        status, body = _http_json("GET", f"{active['url']}/healthz", timeout=2.0)
    except (OSError, KeyError, TypeError):
        return False
    return (
        status == 200
        and body.get("version") == active.get("version")
        and body.get("pid") == active.get("pid")
    )


# --------------------------------------------------------------------------- public API


def deploy(
    model_path: Path,
    variant: str,
    version: str,
    *,
    state_root: Path,
    endpoint: str,
    port: int,
    smoke: tuple[np.ndarray, np.ndarray],
    min_smoke_accuracy: float,
    log: Log = None,
) -> dict[str, Any]:
    """Serve ``model_path`` as ``version`` behind ``http://127.0.0.1:{port}``, blue/green.

    The new version is started next to the old one, smoke- and load-tested directly, and only then
    does ``active.json`` switch. Any failure before (or while verifying) the switch stops the new
    process, leaves the old version serving and raises :class:`DeploymentError`. Deploying the version
    that is already active and healthy returns its original result without touching anything.
    """
    _check_name("version", version)
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; use one of {', '.join(VARIANTS)}")
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port={port!r}; use a TCP port 1..65535")
    if not 0.0 <= float(min_smoke_accuracy) <= 1.0:
        raise ValueError(f"min_smoke_accuracy={min_smoke_accuracy!r}; use a fraction in 0..1")
    pixels, labels = np.asarray(smoke[0]), np.asarray(smoke[1]).astype(np.int64)
    if pixels.ndim != 2 or pixels.shape[1] != 64 or len(pixels) == 0 or labels.shape != (len(pixels),):
        raise ValueError(
            f"smoke must be (raw pixels [n, 64], labels [n]) with n >= 1; got {pixels.shape} and {labels.shape}"
        )
    model_path = Path(model_path).resolve()
    if not model_path.is_file():
        raise DeploymentError(f"model artefact {model_path} does not exist; nothing was deployed")

    edir = endpoint_dir(state_root, endpoint)
    vdir = edir / "versions"
    vdir.mkdir(parents=True, exist_ok=True)
    with _endpoint_lock(edir):
        active_path = edir / "active.json"
        active = _read_json(active_path)
        previous = active.get("version") if active else None

        if (
            active
            and previous == version
            and isinstance(active.get("result"), dict)
            and _backend_healthy(active)
        ):
            try:
                _ensure_router(edir, port, log)
            except _Failed as exc:
                raise DeploymentError(
                    f"version {version} is active but its router cannot start: {exc}"
                ) from exc
            _say(log, f"version {version} is already active and healthy on {_url(port)}; nothing to do")
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
        proc = _spawn(
            [
                SERVER_MODULE,
                "--model",
                str(model_path),
                "--variant",
                variant,
                "--version",
                version,
                "--port",
                "0",
                "--ready-file",
                str(ready),
            ],
            log_path,
            edir,
        )
        record: dict[str, Any] = {
            "version": version,
            "variant": variant,
            "model_path": str(model_path),
            "pid": proc.pid,
            "port": None,
            "url": None,
            "log": str(log_path),
            "status": "starting",
            "started_at": _now(),
        }
        _write_json(record_path, record)
        _say(log, f"started version {version} ({variant}) as pid {proc.pid}; log {log_path}")

        def fail(step: str, exc: BaseException) -> DeploymentError:
            _terminate(proc.pid, SERVER_MODULE, str(ready))
            record.update(status="failed", error=f"{step}: {exc}", stopped_at=_now())
            _write_json(record_path, record)
            keeps = f"version {previous} keeps serving" if previous else "no version was serving"
            return DeploymentError(
                f"version {version} was not deployed ({step}): {exc}. {keeps} on {_url(port)}; "
                f"server log: {log_path}"
            )

        step = "start"
        try:
            backend_port = _wait_ready(proc, ready, log_path, log_since, START_TIMEOUT_S)
            url = _url(backend_port)
            record.update(port=backend_port, url=url)
            _write_json(record_path, record)
            _wait_healthy(url, version, proc.pid)
            step = "smoke test"
            predictions = _predict(url, pixels, version)
            smoke_accuracy = round(float(np.mean(predictions == labels)), 6)
            _say(log, f"version {version} smoke accuracy {smoke_accuracy:.4f} on {len(labels)} known inputs")
            if smoke_accuracy < min_smoke_accuracy:
                raise _Failed(
                    f"smoke accuracy {smoke_accuracy:.4f} on {len(labels)} known inputs is below "
                    f"min_smoke_accuracy {min_smoke_accuracy}"
                )
            step = "load check"
            p50, p95 = _load_check(url, pixels, version)
            _say(log, f"version {version} load check: {LOAD_REQUESTS} requests, p50 {p50} ms, p95 {p95} ms")
            step = "router"
            _ensure_router(edir, port, log)
        except (_Failed, OSError) as exc:
            raise fail(step, exc) from exc
        except BaseException as exc:  # interrupted (e.g. task killed): never leave an orphan behind
            fail(step, exc)
            raise

        result = {
            "endpoint_url": _url(port),
            "version": version,
            "previous_version": previous,
            "smoke_accuracy": smoke_accuracy,
            "p50_ms": p50,
            "p95_ms": p95,
            "variant": variant,
            "backend_url": url,
            "pid": proc.pid,
        }
        _write_json(
            active_path,
            {
                "version": version,
                "url": url,
                "pid": proc.pid,
                "variant": variant,
                "model_path": str(model_path),
                "activated_at": _now(),
                "result": result,
            },
        )
        _say(log, f"switched {_url(port)} to version {version}")
        try:
            _verify_router(port, version, pixels)
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
            _say(
                log,
                f"previous version {previous} (pid {active['pid']}) "
                f"{'stopped' if stopped else 'was not running'}",
            )
        return result


def stop_endpoint(state_root: Path, endpoint: str) -> dict[str, Any]:
    """Stop the router and every version process recorded for ``endpoint``; idempotent."""
    edir = endpoint_dir(state_root, endpoint)
    if not edir.is_dir():
        return {"endpoint": endpoint, "stopped_pids": []}
    stopped: list[int] = []
    with _endpoint_lock(edir):
        router = _read_json(edir / "router.json") or {}
        if _terminate(router.get("pid"), ROUTER_MODULE, str(edir)):
            stopped.append(router["pid"])
        for path in sorted((edir / "versions").glob("*.json")):
            record = _read_json(path) or {}
            version = path.stem
            if _terminate(record.get("pid"), SERVER_MODULE, str(_ready_file(edir, version))):
                stopped.append(record["pid"])
            if record.get("status") in ("starting", "active"):
                record.update(status="stopped", stopped_at=_now())
                _write_json(path, record)
        active = _read_json(edir / "active.json") or {}
        if _terminate(active.get("pid"), SERVER_MODULE, str(_ready_file(edir, str(active.get("version"))))):
            stopped.append(active["pid"])
        # Nothing serves any more; an active.json left behind would describe a dead backend.
        (edir / "active.json").unlink(missing_ok=True)
    return {"endpoint": endpoint, "stopped_pids": stopped}


def endpoint_status(state_root: Path, endpoint: str) -> dict[str, Any]:
    """What is recorded for ``endpoint`` and whether those processes are up."""
    edir = endpoint_dir(state_root, endpoint)
    active = _read_json(edir / "active.json")
    router = _read_json(edir / "router.json") or {}
    router_port = router.get("port")
    router_up = (
        bool(router.get("pid"))
        and _is_ours(router["pid"], ROUTER_MODULE, str(edir))
        and _alive(router["pid"])
    )
    answered: dict[str, Any] = {}
    if router_up and router_port:
        try:
            status, body = _http_json("GET", f"{_url(router_port)}/healthz", timeout=2.0)
            answered = {"http_status": status, "version": body.get("version"), "status": body.get("status")}
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
            "variant": record.get("variant"),
            "running": bool(pid)
            and _is_ours(pid, SERVER_MODULE, str(_ready_file(edir, path.stem)))
            and _alive(pid),
        }
    return {
        "endpoint": endpoint,
        "endpoint_url": _url(router_port) if router_port else None,
        "active_version": active.get("version") if active else None,
        "active": {k: v for k, v in active.items() if k != "result"} if active else None,
        "healthy": answered.get("http_status") == 200,
        "router": {"pid": router.get("pid"), "port": router_port, "running": router_up, **answered},
        "versions": versions,
    }
