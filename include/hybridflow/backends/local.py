"""The local gang backend: a training gang as N worker processes on this machine.

The contract of :class:`~hybridflow.backends.base.GangBackend`: ``submit(GangJob)`` queues the gang
and ``poll(handle)`` moves it on (admits it, starts its workers, supervises them) and says where it
is; ``run(GangJob, admission_timeout_s=, log=) -> GangResult`` is both in a loop (blocks until every
worker exited 0; raises :class:`GangNotAdmitted` when the gang was not admitted in time, so the
caller can fail over to the next placement candidate, :class:`GangPreempted` after a checkpointed
stop it may relaunch, :class:`GangStopped` for a stop for good, :class:`GangFailed` otherwise),
``cancel(job_name)`` for ``on_kill``, and ``load()`` (GPUs held and waiting) for placement.
``GangJob.labels`` carries project, team and priority; ``team_cap`` on the job holds a team at its
``gpu_cap``.

A cluster's GPUs are modelled as slots in a pool file shared by every launcher on the machine
(Airflow workers, tests, the CLI). A gang is admitted only when all of its slots can be taken at
once: a partial gang would hold slots while waiting on peers that never start, and two such gangs
deadlock each other. Holdings name the launcher pid, so a launcher that died (kill -9, OOM) does
not leak slots: the next acquirer reclaims them.

Workers die with their launcher (``PR_SET_PDEATHSIG``): an orphaned gang would keep training,
keep its slots' GPUs busy and race a rerun for the same checkpoints.

Its pieces: ``local_slots`` (the slot pool), ``local_queue`` (admission), ``local_launch`` (one
gang from submit to its end, a poll at a time), ``local_processes`` (liveness, death with the
launcher) and ``local_failures`` (what a failed gang raises).
"""


from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hybridflow.backends.base import (
    MISSING,
    PENDING,
    RUNNING,
    ClusterLoad,
    GangBackend,
    GangHandle,
    GangJob,
    GangRemnant,
    GangStatus,
    QueueStanding,
)
from hybridflow.backends.errors import (  # noqa: F401 - the train task and tests import them from here
    GangFailed,
    GangMoved,
    GangNotAdmitted,
    GangPreempted,
    GangStopped,
    GangWorkerExit,
)
from hybridflow.backends.local_failures import (  # noqa: F401 - tests import them from here
    PREEMPTED_EXIT_CODE,
    _gang_error,
    _last_error,
    _tail,
)
from hybridflow.backends.local_processes import (  # noqa: F401 - tests import them from here
    _PR_SET_PDEATHSIG,
    _cmdline,
    _die_with_parent,
    _free_port,
    _gang_env,
    _proc_stat,
    _start_ticks,
    pid_alive,
)
from hybridflow.backends.local_queue import LocalQueue, _check_job
from hybridflow.backends.local_slots import (  # noqa: F401 - the train task and tests import them from here
    PRIORITY_RANK,
    TEAMS_LOCK,
    LocalSlotPool,
    _atomic_write_json,
    _read_json,
    entry_alive,
)

WORKER_MODULE = "hybridflow.training.worker"


@dataclass(frozen=True)
class GangResult:
    exit_codes: list[int]
    seconds: float
    log_paths: list[Path]
    job_dir: Path
    queued_s: float = 0.0  # waited for admission, since the gang first queued


def _launch(
    job: GangJob,
    base_env: dict[str, str],
    spec_path: Path,
    run_dir: Path,
    log_paths: list[Path],
    procs: list[subprocess.Popen],
) -> None:
    """Start one worker per rank, each appended to ``procs`` as it starts (the caller stops them)."""
    for rank in range(job.workers):
        env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
        with open(log_paths[rank], "ab") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", WORKER_MODULE, "--spec", str(spec_path)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=run_dir,
                    preexec_fn=_die_with_parent(os.getpid()),
                )
            )


# -- gang backend ------------------------------------------------------------------------------
class LocalGangBackend(LocalQueue, GangBackend):
    """Runs gangs as local processes against a :class:`LocalSlotPool`."""

    def __init__(
        self,
        state_dir: Path,
        cluster: str,
        capacity: int,
        *,
        grace_s: float = 30.0,
        poll_s: float = 0.2,
        critical_preempts_batch: bool = True,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.cluster = self.cluster_name = cluster
        self.pool = LocalSlotPool(self.state_dir, cluster, capacity)
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.critical_preempts_batch = critical_preempts_batch

    def load(self) -> ClusterLoad:
        return self.pool.load()

    def standing(self, job_name: str) -> QueueStanding:
        return self.pool.standing(job_name)

    @property
    def supervised_by_task(self) -> bool:
        return True  # workers die with their launcher (PR_SET_PDEATHSIG)

    @property
    def reads_private_storage(self) -> bool:
        return True  # the gang's processes run on this machine, next to private storage

    def find_gangs(self, labels, *, not_labels=None) -> list[str]:
        return sorted(
            g["name"] for g in self.running_gangs()
            if all(g["labels"].get(k) == v for k, v in labels.items())
            and not any(g["labels"].get(k) == v for k, v in (not_labels or {}).items())
        )

    def job_dir(self, job_name: str) -> Path:
        return self.state_dir / "jobs" / job_name

    def _record_path(self, job_name: str) -> Path:
        return self.job_dir(job_name) / "running.json"

    def _stop_path(self, job_name: str) -> Path:
        return self.job_dir(job_name) / "stop.json"

    def owner_path(self, job_name: str) -> Path:
        """The Airflow task the gang works for (``GangJob.owner``) and the Airflow instance that made it
        (``instance``), written when it first asks for slots."""
        return self.job_dir(job_name) / "owner.json"

    # -- submit, poll, run ---
    def submit(self, job: GangJob, *, pool: str | None = None, queue: str | None = None,
               log: Callable[[str], None] | Any = print, queued_since: float | None = None,
               on_admitted: Callable[[float], None] | None = None) -> GangHandle:
        """Queue ``job`` for its slots (one try to take them now); :meth:`poll` starts its workers once
        admitted and supervises them. ``log`` takes one line, or is a logger (lines go to ``log.info``);
        ``queued_since`` (epoch) keeps the place an earlier try already waited for; ``on_admitted`` is
        called with the seconds waited. Node pools and queues are not named on a local cluster.

        The handle is good only in this thread: the workers die when the thread that started them
        exits (PR_SET_PDEATHSIG). Whoever submits polls until the status is terminal, or closes the
        handle (:meth:`close`), which a terminal poll does itself."""
        from hybridflow.backends.local_launch import LocalLaunch, step

        _check_job(job)
        if hasattr(log, "info"):  # a logging/structlog logger, e.g. an operator's self.log
            log = log.info
        submitted_at = time.time()
        launch = LocalLaunch(job=job, log=log, since=queued_since or submitted_at, on_admitted=on_admitted)
        step(self, launch)
        return GangHandle(self.cluster, job.name, job.attempt, created=True, admitted=launch.admitted,
                          submitted_at=submitted_at, state=launch)

    def poll(self, handle: GangHandle) -> GangStatus:
        """One step of the gang's life (``local_launch.step``); a handle submitted in another process
        carries no launch, and reads :meth:`status` instead."""
        from hybridflow.backends.local_launch import step

        if handle.state is None:
            return self.status(handle.name)
        return step(self, handle.state)

    def close(self, handle: GangHandle) -> None:
        """Give up on a gang before it ended: it leaves the queue, or its workers are stopped and its
        slots released."""
        from hybridflow.backends.local_launch import close

        if handle.state is not None:
            close(self, handle.state)

    def run(
        self,
        job: GangJob,
        *,
        pool: str | None = None,
        queue: str | None = None,
        admission_timeout_s: float,
        log: Callable[[str], None] | Any = print,
        queued_since: float | None = None,
        on_admitted: Callable[[float], None] | None = None,
    ) -> GangResult:
        """:meth:`submit` and :meth:`poll` until the gang ended; returns when every worker exited 0.

        Raises GangNotAdmitted when the gang is not admitted within ``admission_timeout_s`` (it leaves
        the queue), GangPreempted for exit 75, GangStopped for a stop for good, GangFailed otherwise.
        The slots are released however this ends. Call from a long-lived thread: PR_SET_PDEATHSIG
        fires when the launching *thread* exits.
        """
        deadline = time.monotonic() + admission_timeout_s
        handle = self.submit(job, pool=pool, queue=queue, log=log, queued_since=queued_since, on_admitted=on_admitted)
        launch = handle.state
        try:
            while True:
                status = self.poll(handle)
                if status.terminal:
                    break
                if status.phase == PENDING:
                    if time.monotonic() >= deadline:
                        self._not_admitted(job, admission_timeout_s, launch.since, status.standing)
                    time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
                else:
                    time.sleep(self.poll_s)
        finally:
            self.close(handle)
        if launch.error is not None:
            raise launch.error
        return GangResult(exit_codes=[p.returncode for p in launch.procs], seconds=launch.seconds,
                          log_paths=launch.log_paths, job_dir=launch.run_dir, queued_s=launch.queued_s)

    def _not_admitted(self, job: GangJob, admission_timeout_s: float, since: float, standing: QueueStanding) -> NoReturn:
        cap = (f"team {job.team!r} holds its gpu_cap of {job.team_cap} GPUs" if standing.over_team_cap
               else standing.describe())
        raise GangNotAdmitted(
            f"gang {job.name!r} not admitted within {admission_timeout_s:g}s on cluster {self.cluster!r}: {cap}",
            cluster=self.cluster, over_team_cap=standing.over_team_cap, queued_since=since, standing=standing)

    def _write_record(self, job: GangJob, procs: list[subprocess.Popen]) -> None:
        # Also read (never written) by metering.local_exporter, the stand-in dcgm-exporter of
        # local slots: keep "cluster", "labels" and "workers" (rank, pid) when changing this.
        _atomic_write_json(
            self._record_path(job.name),
            {
                "attempt": job.attempt,
                "cluster": self.cluster,
                "labels": dict(job.labels),
                "launcher_pid": os.getpid(),
                "workers": [
                    {"rank": r, "pid": p.pid, "pid_start": _start_ticks(p.pid)}
                    for r, p in enumerate(procs)
                ],
            },
        )

    def _raise_failure(
        self,
        job: GangJob,
        failed: list[tuple[int, int]],
        first_failure: tuple[int, int] | None,
        log_paths: list[Path],
    ) -> NoReturn:
        """GangStopped, GangPreempted or GangFailed for the gang's failed ranks ((rank, code) each)."""
        rank, code = first_failure or failed[0]
        stop = _read_json(self._stop_path(job.name))
        if stop is not None:  # it was asked of this launch: a relaunch is not stopped by it
            self._stop_path(job.name).unlink(missing_ok=True)
        raise _gang_error(job.name, failed, rank, code, log_paths, stop)

    def _terminate(self, procs: list[subprocess.Popen]) -> None:
        """SIGTERM (workers checkpoint and exit 75), then SIGKILL after the grace period."""
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _stop_leftovers(self, job_name: str, log: Callable[[str], None]) -> None:
        """Workers of an earlier launch of this job that are still alive would race this one."""
        record_path = self._record_path(job_name)
        try:
            record = json.loads(record_path.read_text())
        except (FileNotFoundError, ValueError):
            return
        pids = self._live_workers(record)
        if pids:
            log(f"gang {job_name}: stopping {len(pids)} leftover workers of attempt {record.get('attempt')}")
            self._kill_pids(pids)
        record_path.unlink(missing_ok=True)

    @staticmethod
    def _live_workers(record: dict) -> list[int]:
        # Pid reuse guard: same start time and still our worker module on the command line.
        return [
            w["pid"]
            for w in record.get("workers", [])
            if pid_alive(w["pid"], w.get("pid_start")) and WORKER_MODULE in _cmdline(w["pid"])
        ]

    def _kill_pids(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError as exc:
                    if exc.errno != errno.ESRCH:
                        raise

    def status(self, name: str) -> GangStatus:
        """Running while the gang's workers live, pending while its ticket waits in the queue, else
        missing: how a finished gang ended is its launcher's to say (the train task supervises it and
        relaunches it after a preemption, so no restarts are counted here)."""
        record = _read_json(self._record_path(name))
        if record and self._live_workers(record):
            return GangStatus(RUNNING)
        return GangStatus(PENDING) if name in self.pool.waiting() else GangStatus(MISSING)

    def running_gangs(self) -> list[dict]:
        """Gangs of this cluster with live workers: ``{"name", "attempt", "labels"}`` each."""
        out = []
        for path in sorted((self.state_dir / "jobs").glob("*/running.json")):
            record = _read_json(path)
            if not record or record.get("cluster", self.cluster) != self.cluster:
                continue
            if self._live_workers(record):
                out.append({"name": path.parent.name, "attempt": record.get("attempt"),
                            "labels": record.get("labels") or {}})
        return out

    def remnants(self) -> list[GangRemnant]:
        from hybridflow.backends.local_remnants import remnants

        return remnants(self)

    def clear(self, remnant: GangRemnant, reason: str) -> None:
        from hybridflow.backends.local_remnants import clear

        clear(self, remnant, reason)

    def stop(self, job_name: str, reason: str) -> bool:
        """Stop a running gang for good: like :meth:`cancel` (SIGTERM, the workers checkpoint), but
        its launcher raises :class:`GangStopped` with ``reason`` instead of a relaunchable preemption."""
        _atomic_write_json(self._stop_path(job_name), {"reason": reason, "at": time.time()})
        stopped = self.cancel(job_name)
        if not stopped:
            self._stop_path(job_name).unlink(missing_ok=True)
        return stopped

    def move(self, job_name: str, reason: str) -> bool:
        """Stop a running gang so that its task places it elsewhere (making room for work that may run
        only here): like :meth:`stop`, the workers checkpoint first, but its launcher raises
        :class:`GangMoved` with ``reason``, which the train task answers by placing the run again."""
        _atomic_write_json(self._stop_path(job_name), {"reason": reason, "at": time.time(), "move": True})
        moved = self.cancel(job_name)
        if not moved:
            self._stop_path(job_name).unlink(missing_ok=True)
        return moved

    def cancel(self, job_name: str) -> bool:
        """Stop a running gang recorded in state (used by an operator's on_kill). The workers get
        SIGTERM, so they checkpoint first. Returns False if no live gang was found."""
        try:
            record = json.loads(self._record_path(job_name).read_text())
        except (FileNotFoundError, ValueError):
            return False
        pids = self._live_workers(record)
        self._kill_pids(pids)
        # A launcher in this process releases in its finally; a dead one never will.
        if not pid_alive(int(record.get("launcher_pid", 0))):
            self.pool.release(job_name)
            self._record_path(job_name).unlink(missing_ok=True)
        return bool(pids)
