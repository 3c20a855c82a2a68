"""Why a local gang ended badly: its workers' log tails, the error that ended each, and the GangError
the train task acts on (stopped for good, preempted after checkpointing, or failed)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from hybridflow.backends.errors import GangFailed, GangMoved, GangPreempted, GangStopped
from hybridflow.errors import GangError

# Same value as hybridflow.training.worker.PREEMPTED_EXIT_CODE; not imported because that pulls in torch.
PREEMPTED_EXIT_CODE = 75


def _tail(path: Path, lines: int = 25, max_lines: int = 80) -> str:
    """The log's last ``lines`` lines, or from its last traceback on (up to ``max_lines``), so a
    training function's error reaches the task log whole."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            text = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last)")]
    if starts and len(text) - starts[-1] > lines:
        return "\n".join(text[max(starts[-1] - 2, len(text) - max_lines):])
    return "\n".join(text[-lines:])


def _last_error(path: Path) -> str | None:
    """The exception line that ends the last traceback in a worker's log, if it has one."""
    lines = _tail(path, lines=80).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    after = [line for line in lines[starts[-1]:] if line and not line[0].isspace() and ": " in line]
    return after[-1].strip() if after else None


def _gang_error(
    job_name: str,
    failed: list[tuple[int, int]],
    rank: int,
    code: int,
    log_paths: list[Path],
    stop: dict | None,
) -> GangError:
    """The error for a gang whose ``failed`` ranks ((rank, code) each) exited non-zero, ``rank`` (exit
    ``code``) first; ``stop``: the stop asked for the gang, if any."""
    others = ", ".join(f"rank {r}: {c}" for r, c in failed if r != rank) or "none"
    tail = _tail(log_paths[rank])
    # A worker stopped on purpose exits 75 after its checkpoint; one still starting up when the stop came
    # ends on the signal itself (SIGTERM before its handler is set, SIGKILL after the grace period).
    on_purpose = stop is not None and code in (PREEMPTED_EXIT_CODE, -signal.SIGTERM, -signal.SIGKILL)
    if on_purpose:  # moved to make room (placed again elsewhere), or stopped for good
        kind, what = (GangMoved, "moved") if stop.get("move") else (GangStopped, "stopped")
        return kind(f"gang {job_name!r} was {what} after checkpointing: {stop.get('reason')}",
                    reason=str(stop.get("reason")), rank=rank, exit_code=code, log_tail=tail)
    if code == PREEMPTED_EXIT_CODE:
        return GangPreempted(
            f"gang {job_name!r} was preempted (rank {rank} exited {code} after checkpointing); "
            f"rerun to resume from the last checkpoint. Log {log_paths[rank]}:\n{tail}",
            rank=rank,
            exit_code=code,
            log_tail=tail,
        )
    # The first rank to exit is often a peer that lost the collective, not the one that
    # raised: name every other rank's own error too.
    causes = "".join(f"\nrank {r} raised: {err}" for r, _ in failed
                     if r != rank and (err := _last_error(log_paths[r])))
    return GangFailed(
        f"gang {job_name!r} failed: rank {rank} exited with code {code} (other ranks: {others}). "
        f"Log {log_paths[rank]}, last lines:\n{tail}{causes}",
        rank=rank,
        exit_code=code,
        log_tail=tail,
    )
