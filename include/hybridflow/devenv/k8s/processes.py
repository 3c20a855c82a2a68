"""The control plane's processes: started in their own session with a log file each, found again by
pid and the binary they run (so ``down`` ends only what ``up`` started), stopped with SIGTERM then
SIGKILL, and waited for with a readiness probe that fails fast when the process has exited."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached: the message names the cause and the fix."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def start(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **(env or {})})


def runs(pid: int, binary: str) -> bool:
    """Whether ``pid`` is alive and runs ``binary`` (a pid reused by another program is not ours)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":  # exited, not yet reaped by its parent
        return False
    # A script runs as its interpreter with the script's path as the first argument.
    return binary in [arg.decode(errors="replace") for arg in cmdline[:2]]


def stop(pid: int, binary: str, *, grace_s: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after ``grace_s``; True when the process was ours and is gone."""
    if not runs(pid, binary):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not runs(pid, binary):
            _reap(pid)
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for _ in range(50):
        if not runs(pid, binary):
            break
        time.sleep(0.1)
    _reap(pid)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_ready(name: str, child: subprocess.Popen, probe: Callable[[], bool], log: Path, *, timeout_s: float,
               fix: str = "") -> float:
    """Poll ``probe`` until it is true; seconds waited. Fails at once, with the log's tail, when the
    process exits, and after ``timeout_s`` naming what did not get ready."""
    started = time.monotonic()
    while True:
        if child.poll() is not None:
            raise ControlPlaneError(f"{name} exited while starting; the end of {log}:\n{log_tail(log)}"
                                    + (f"\n{fix}" if fix else ""))
        try:
            if probe():
                return time.monotonic() - started
        except Exception:  # noqa: BLE001 - not answering yet
            pass
        if time.monotonic() - started > timeout_s:
            raise ControlPlaneError(
                f"{name} did not get ready within {timeout_s:.0f} s; the end of {log}:\n{log_tail(log)}\n"
                + (fix or "A loaded machine may need more time: set HYBRIDFLOW_K8S_READY_TIMEOUT_S (seconds)."))
        time.sleep(0.25)
