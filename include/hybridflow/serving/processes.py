"""Processes and files of the local deploy target: start detached, identify by command line, stop.

Processes are started in their own session so they outlive the task that started them, and are
only ever stopped by recorded pid after checking that pid's command line is the process we started
(pids get reused). State files are replaced atomically, so readers see the old or the new file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.errors import DeploymentError

DRAIN_S = 1.0  # let requests already forwarded to the old version finish before it is stopped

STOP_TIMEOUT_S = 10.0
LOCK_TIMEOUT_S = 300.0

Log = Callable[[str], Any] | logging.Logger | None


def say(log: Log, message: str) -> None:
    if log is None:
        return
    if isinstance(log, logging.Logger) or hasattr(log, "info"):
        log.info(message)  # type: ignore[union-attr]
    else:
        log(message)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so readers (the gateway) see either the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def tail(path: Path, since: int = 0, limit: int = 2000) -> str:
    """The end of what this attempt wrote (logs are appended to across attempts)."""
    try:
        data = path.read_bytes()[since:][-limit:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# What a model server or the gateway reads from the environment that starts it. Nothing else is
# passed on: the task that starts them holds Airflow's database URL, Fernet key and JWT secret, cloud
# credentials and Connections (AIRFLOW__*, AIRFLOW_CONN_*, AWS_*), which a process answering HTTP must
# not hold.
CHILD_ENV = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "PYTHONPATH",  # where the model's own code (its bundle's entry points) is importable from
    "LD_LIBRARY_PATH",  # GPU and math libraries outside the virtualenv
})
CHILD_ENV_PREFIXES = (
    "LC_",  # locale
    "OMP_", "MKL_", "OPENBLAS_",  # math library threads
    "CUDA_", "NVIDIA_", "PYTORCH_",  # which GPUs, and torch's allocator
)


def child_env() -> dict[str, str]:
    """The environment of a model server or the gateway: :data:`CHILD_ENV` and :data:`CHILD_ENV_PREFIXES`
    of this one, and where to import this package from."""
    import hybridflow

    env = {k: v for k, v in os.environ.items() if k in CHILD_ENV or k.startswith(CHILD_ENV_PREFIXES)}
    # The child must import this very package even when it is not installed (e.g. run from a checkout).
    package_root = str(Path(hybridflow.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def alive(pid: int) -> bool:
    try:  # reap it if it is our child, else it lingers as a zombie that looks alive
        os.waitpid(pid, os.WNOHANG)
    except OSError:  # not our child, or already reaped
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def is_ours(pid: int, module: str, marker: str) -> bool:
    """True only for the process we started: its argv names our module and this endpoint's marker."""
    args = cmdline(pid)
    return module in args and marker in args


def terminate(pid: int | None, module: str, marker: str) -> bool:
    """Stop ``pid`` if it is still the process we started; True if it was stopped."""
    # Identity first: a zombie or a reused pid has another (or no) command line, and must not be
    # signalled or reaped here.
    if not pid or not is_ours(pid, module, marker) or not alive(pid):
        return False
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not alive(pid):
                return True
            time.sleep(0.05)
    return not alive(pid)


def stop_child(proc: subprocess.Popen) -> bool:
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


def spawn(args: list[str], log_path: Path, cwd: Path, python: str | None = None) -> subprocess.Popen:
    """``python -m args...`` detached, appending to ``log_path``; ``python``: this interpreter unless named
    (model servers run in their own environment)."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [python or sys.executable, "-m", *args],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=child_env(),
            start_new_session=True,  # survives the task process and its process-group kill
        )


@contextmanager
def locked(path: Path, holder: str) -> Iterator[None]:
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


def endpoint_lock(edir: Path) -> Any:
    """One deployer per endpoint at a time (Airflow retries and parallel runs)."""
    return locked(edir / ".lock", "another deployment of this endpoint")


def gateway_lock(root: Path) -> Any:
    """One gateway starter at a time: deploys of different endpoints share the gateway."""
    return locked(root / ".gateway.lock", "another deployment starting the gateway")

