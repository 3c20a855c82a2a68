"""One local gang from submit to its end, one poll at a time: the state a local
:class:`~hybridflow.backends.base.GangHandle` carries (:class:`LocalLaunch`), and what a poll does with
it (:func:`step`): try to admit the gang, start its workers once admitted, stream rank 0's log, stop
the other workers after a first failure, and, once every worker exited, release the slots and say
how the gang ended. The workers die with the thread that started them (``PR_SET_PDEATHSIG``), so a
launch is good only in the thread that submitted it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.backends.base import (
    APPLICATION,
    FAILED,
    PENDING,
    PREEMPTED,
    RUNNING,
    STOPPED,
    SUCCEEDED,
    GangJob,
    GangStatus,
)
from hybridflow.backends.errors import GangError, GangPreempted, GangStopped
from hybridflow.backends.local_processes import _free_port, _gang_env
from hybridflow.backends.local_slots import _atomic_write_json

if TYPE_CHECKING:
    from hybridflow.backends.local import LocalGangBackend


@dataclass
class LocalLaunch:
    """A local gang's state between polls: waiting for its slots (``procs`` empty), then running."""

    job: GangJob
    log: Callable[[str], None]
    since: float  # epoch when the gang first queued (an earlier try's, when it already waited)
    on_admitted: Callable[[float], None] | None = None
    preempted: set[str] = field(default_factory=set)  # batch gangs a critical gang already stopped
    announced: bool = False
    admitted: bool = False
    queued_s: float = 0.0
    procs: list[subprocess.Popen] = field(default_factory=list)
    run_dir: Path | None = None
    log_paths: list[Path] = field(default_factory=list)
    started: float = 0.0  # monotonic, when the workers started
    rank0: Any = None  # rank 0's log, open at what this launch writes
    partial: bytes = b""
    first_failure: tuple[int, int] | None = None
    ended: GangStatus | None = None
    error: GangError | None = None  # what the blocking run raises for a gang that did not succeed
    seconds: float = 0.0
    closed: bool = False

    def pump(self) -> None:
        """Pass on the lines rank 0 wrote since the last poll."""
        chunk = self.rank0.read() if self.rank0 is not None else b""
        if chunk:
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            for line in lines:
                self.log(line.decode(errors="replace"))


def step(backend: LocalGangBackend, launch: LocalLaunch) -> GangStatus:
    """One poll of a local gang (see the module docstring)."""
    if launch.ended is not None:
        return launch.ended
    if not launch.admitted:
        if not backend.admit_step(launch.job, since=launch.since, preempted=launch.preempted, log=launch.log):
            return _waiting(backend, launch)
        backend.pool.withdraw(launch.job.name)
        held = backend.pool.holdings().get(launch.job.name, {})
        launch.queued_s = max(0.0, time.time() - float(held.get("queued_since") or launch.since))
        launch.admitted = True
        try:
            if launch.on_admitted is not None:
                launch.on_admitted(launch.queued_s)
            _start(backend, launch)
        except BaseException:
            close(backend, launch)
            raise
        return GangStatus(RUNNING)
    return _supervise(backend, launch)


def _waiting(backend: LocalGangBackend, launch: LocalLaunch) -> GangStatus:
    job = launch.job
    standing = backend.pool.standing(job.name)
    why = (f"team {job.team} at its gpu_cap of {job.team_cap}" if standing.over_team_cap
           else standing.describe())
    if not launch.announced:
        launch.log(f"gang {job.name}: waiting for {job.workers} free slots on {backend.cluster} "
                   f"(priority {job.priority}; {why})")
        launch.announced = True
    return GangStatus(PENDING, message=why, standing=standing)


def _start(backend: LocalGangBackend, launch: LocalLaunch) -> None:
    """Stop what an earlier launch left running, then start one worker per rank and record them."""
    from hybridflow.backends.local import _launch

    job = launch.job
    backend._stop_leftovers(job.name, launch.log)
    # A stop asked for an earlier launch; this one was started after it (a cleared task).
    backend._stop_path(job.name).unlink(missing_ok=True)
    launch.run_dir = run_dir = backend.job_dir(job.name) / job.attempt
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "job.json"
    _atomic_write_json(spec_path, job.spec)
    launch.log_paths = [run_dir / f"rank-{r}.log" for r in range(job.workers)]
    port = _free_port()
    launch.log(f"gang {job.name} attempt {job.attempt}: starting {job.workers} workers on "
               f"{backend.cluster} (master 127.0.0.1:{port}, logs {run_dir})")
    # A reused attempt label appends to its logs; stream only what this launch writes.
    launch.log_paths[0].touch()
    launch.rank0 = open(launch.log_paths[0], "rb")  # noqa: SIM115 - closed by close()
    launch.rank0.seek(0, 2)
    launch.started = time.monotonic()
    _launch(job, _gang_env(job, port), spec_path, run_dir, launch.log_paths, launch.procs)
    backend._write_record(job, launch.procs)


def _supervise(backend: LocalGangBackend, launch: LocalLaunch) -> GangStatus:
    launch.pump()
    codes = [p.poll() for p in launch.procs]
    if launch.first_failure is None:
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            launch.first_failure = failed[0]
            launch.log(f"gang {launch.job.name}: rank {failed[0][0]} exited {failed[0][1]}; stopping the other workers")
            backend._terminate(launch.procs)
            codes = [p.poll() for p in launch.procs]
    if any(c is None for c in codes):
        return GangStatus(RUNNING)
    launch.pump()
    if launch.partial:
        launch.log(launch.partial.decode(errors="replace"))
        launch.partial = b""
    launch.seconds = time.monotonic() - launch.started
    failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    try:
        if failed:
            backend._raise_failure(launch.job, failed, launch.first_failure, launch.log_paths)
        launch.log(f"gang {launch.job.name}: all {launch.job.workers} workers finished in {launch.seconds:.1f}s")
        launch.ended = GangStatus(SUCCEEDED)
    except GangError as exc:
        launch.error = exc
        phase = STOPPED if isinstance(exc, GangStopped) else PREEMPTED if isinstance(exc, GangPreempted) else FAILED
        launch.ended = GangStatus(phase, message=str(exc), cause=APPLICATION if phase == FAILED else "")
    finally:
        close(backend, launch)
    return launch.ended


def close(backend: LocalGangBackend, launch: LocalLaunch) -> None:
    """Whatever became of the gang: a waiting one leaves the queue; a launched one's workers are
    stopped (SIGTERM, then SIGKILL after the grace period), its record removed and its slots released.
    A second call does nothing more."""
    if launch.closed:
        return
    launch.closed = True
    if not launch.admitted:
        backend.pool.withdraw(launch.job.name)
        return
    backend._terminate(launch.procs)
    if launch.rank0 is not None:
        launch.rank0.close()
        launch.rank0 = None
    backend._record_path(launch.job.name).unlink(missing_ok=True)
    backend.pool.release(launch.job.name)
