"""Processes of the local backend: liveness (guarded against pid reuse), command lines, a free port
for the gang's rendezvous, and workers that die with their launcher (``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

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
