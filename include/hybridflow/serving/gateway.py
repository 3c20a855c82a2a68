"""The model gateway of the local deploy target: one stable port on 127.0.0.1 in front of every
endpoint under a state root (:mod:`hybridflow.serving.router`); started once, shared by all deploys.

Under the state root: ``router.json`` (pid, port), ``router.log``, and ``.gateway.lock``, which makes
starting it safe when deploys of different endpoints race.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.serving.checks import StepFailed, http_json, model_url, predict, url_of
from hybridflow.serving.processes import (
    Log,
    alive,
    gateway_lock,
    is_ours,
    log_size,
    now,
    read_json,
    say,
    spawn,
    stop_child,
    tail,
    terminate,
    write_json,
)

if TYPE_CHECKING:
    from hybridflow.config.pipeline import ModelServerSettings

ROUTER_MODULE = "hybridflow.serving.router"
ROUTER_START_TIMEOUT_S = 30.0
GATEWAY_FILE = "router.json"
GATEWAY_LOG = "router.log"
VERIFY_ROWS = 16


def gateway_identity(port: int, root: Path, timeout: float = 2.0) -> bool | None:
    """True: our gateway answers on ``port``; None: nothing answers; False: something else does."""
    return probe_gateway(port, root, timeout)[0]


def probe_gateway(port: int, root: Path, timeout: float = 2.0) -> tuple[bool | None, dict[str, Any]]:
    try:
        _, body = http_json("GET", f"{url_of(port)}/healthz", timeout=timeout)
    except OSError:
        return None, {}
    return body.get("router") is True and body.get("state_root") == str(root), body


def gateway_args(settings: ModelServerSettings | None) -> list[str]:
    """The gateway's bounds as the model servers behind it have theirs (``serving.server``): a body
    they would refuse is not worth buffering, and a client gets the same time to send its request."""
    if settings is None:
        return []
    return ["--max-body-mib", str(settings.max_body_mib), "--request-timeout-s", str(settings.request_timeout_s)]


def ensure_gateway(root: Path, port: int, log: Log, settings: ModelServerSettings | None = None) -> None:
    """Our gateway answers on ``port`` for ``root`` (started if nothing answers there), bounded by
    ``settings`` (the model servers', :func:`gateway_args`)."""
    with gateway_lock(root):
        marker = str(root)
        found, body = probe_gateway(port, root)
        if found:
            return
        if found is False:
            if isinstance(body.get("state_dir"), str) and Path(body["state_dir"]).parent == root:
                raise StepFailed(f"port {port} is held by the one-endpoint router of an earlier version for "
                                 f"{body['state_dir']} (pid {body.get('pid')}); stop it with stop_gateway({root}) "
                                 "and deploy again")
            raise StepFailed(f"port {port} is answered by something other than the model gateway for {root}; "
                             "free it or choose another serving port")
        recorded = read_json(root / GATEWAY_FILE) or {}
        terminate(recorded.get("pid"), ROUTER_MODULE, marker)  # ours but not answering on this port
        log_path = root / GATEWAY_LOG
        since = log_size(log_path)
        proc = spawn([ROUTER_MODULE, "--state-root", marker, "--port", str(port), *gateway_args(settings)],
                     log_path, root)
        write_json(root / GATEWAY_FILE, {"pid": proc.pid, "port": port, "log": str(log_path), "started_at": now()})
        say(log, f"started the model gateway pid {proc.pid} on {url_of(port)}")
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                raise StepFailed(f"the gateway exited with code {code}; log tail:\n{tail(log_path, since)}")
            if gateway_identity(port, root, timeout=0.5):  # a fresh gateway answers at once
                return
            time.sleep(0.1)
        stop_child(proc)
        raise StepFailed(f"the gateway did not answer on port {port} within {ROUTER_START_TIMEOUT_S:.0f}s")


def verify_gateway(port: int, endpoint: str, version: str, rows: list[list[Any]], timeout: float = 10.0) -> None:
    base = url_of(port)
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            status, body = http_json("GET", model_url(base, endpoint), timeout=3.0)
            if status == 200 and body.get("version") == version:
                predict(base, endpoint, rows[:VERIFY_ROWS], version)
                return
            last = f"GET {model_url(base, endpoint)} HTTP {status} {body}"
        except (OSError, StepFailed) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise StepFailed(f"the gateway on port {port} does not serve {endpoint} version {version} after the switch ({last})")


def gateway_status(root: Path) -> dict[str, Any]:
    gateway = read_json(root / GATEWAY_FILE) or {}
    pid, port = gateway.get("pid"), gateway.get("port")
    running = bool(pid) and is_ours(pid, ROUTER_MODULE, str(root)) and alive(pid)
    return {"pid": pid, "port": port, "url": url_of(port) if port else None, "running": running}

