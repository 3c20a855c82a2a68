"""Processes of the local backend: liveness (guarded against pid reuse), command lines, a free port
for the gang's rendezvous, the environment its workers start with, and workers that die with their
launcher (``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hybridflow

_PR_SET_PDEATHSIG = 1


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[19])


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True if ``pid`` runs (not a zombie) and, when given, started at ``start_ticks`` (guards pid reuse)."""
    if pid <= 0:
        return False
    stat = _proc_stat(pid)
    if stat is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state, started = stat
    if state in ("Z", "X"):
        return False
    return start_ticks is None or started == start_ticks


def _start_ticks(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        # The launcher may run with SIGTERM ignored or blocked (a task runner's own signal
        # handling); both survive exec and would make the worker deaf to its death signal.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The launcher may have died between fork and prctl; then nobody would ever signal us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _gang_env(job: Any, port: int) -> dict[str, str]:
    """The environment every worker of the gang starts with (rendezvous on loopback at ``port``)."""
    base_env = dict(os.environ)
    base_env.update(job.env)
    include_dir = str(Path(hybridflow.__file__).resolve().parents[1])
    base_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (include_dir, base_env.get("PYTHONPATH")) if p
    )
    base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the gang talks over loopback only
    base_env.setdefault("HYBRIDFLOW_DEVICE", "cpu")  # the embedded default trains anywhere; cuda: a GPU per rank
    base_env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(job.workers),
            "LOCAL_WORLD_SIZE": str(job.workers),  # every rank on this machine
            "PYTHONUNBUFFERED": "1",
        }
    )
    return base_env
