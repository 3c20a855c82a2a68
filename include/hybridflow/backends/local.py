"""The local gang backend: a training gang as N worker processes on this machine.

What the train task needs from a gang backend (the Kubernetes backend provides the same):
``run(GangJob, admission_timeout_s=, log=) -> GangResult`` (blocks until every worker exited 0;
raises :class:`GangNotAdmitted` when the gang was not admitted in time, so the caller can fail over
to the next placement candidate, :class:`GangPreempted` after a checkpointed stop it may relaunch,
:class:`GangStopped` for a stop for good, :class:`GangFailed` otherwise), ``cancel(job_name)`` for
``on_kill``, and ``usage()`` / ``queued()`` (GPUs held and waiting) for placement. ``GangJob.labels``
carries project, team and priority; ``team_cap`` on the job holds a team at its ``gpu_cap``.

A cluster's GPUs are modelled as slots in a pool file shared by every launcher on the machine
(Airflow workers, tests, the CLI). A gang is admitted only when all of its slots can be taken at
once: a partial gang would hold slots while waiting on peers that never start, and two such gangs
deadlock each other. Holdings name the launcher pid, so a launcher that died (kill -9, OOM) does
not leak slots: the next acquirer reclaims them.

Workers die with their launcher (``PR_SET_PDEATHSIG``): an orphaned gang would keep training,
keep its slots' GPUs busy and race a rerun for the same checkpoints.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hybridflow
from hybridflow.backends.base import ClusterLoad, GangBackend, GangJob, QueueStanding, standing_in
from hybridflow.backends.errors import (  # noqa: F401 - the train task and tests import them from here
    GangFailed,
    GangNotAdmitted,
    GangPreempted,
    GangStopped,
    GangWorkerExit,
)
from hybridflow.errors import GangError

# Same value as hybridflow.training.worker.PREEMPTED_EXIT_CODE; not imported because that pulls in torch.
PREEMPTED_EXIT_CODE = 75
WORKER_MODULE = "hybridflow.training.worker"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class GangResult:
    exit_codes: list[int]
    seconds: float
    log_paths: list[Path]
    job_dir: Path
    queued_s: float = 0.0  # waited for admission, since the gang first queued


# -- process helpers ---------------------------------------------------------------------------
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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _atomic_write_json(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True))
    tmp.replace(path)


# -- slot pool ---------------------------------------------------------------------------------
PRIORITY_RANK = {"critical": 0, "normal": 1, "batch": 2}
TEAMS_LOCK = "_teams.lock"


class LocalSlotPool:
    """``capacity`` slots of one cluster, shared across processes via a JSON file under flock.

    flock on a freshly opened file excludes other processes *and* other threads of this process
    (each open is its own lock owner), unlike lockf.

    Gangs that wait leave a ticket (``queue=True``); slots go to tickets in priority then arrival
    order, and a gang never overtakes a ticket ranked ahead of it (no starving a big gang behind
    a stream of small ones). A ticket held back only by its own team's cap does not block others.
    Team caps span every cluster under ``state_dir``: acquires with a cap take one estate-wide lock
    first (always before a cluster lock, so two locks never deadlock), and only acquires raise a
    team's count, so the count read under that lock is exact.
    """

    def __init__(self, state_dir: Path, cluster: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cluster {cluster!r} needs at least one slot, got capacity {capacity}")
        self.cluster = cluster
        self.capacity = capacity
        self.dir = Path(state_dir) / "slots"
        self.path = self.dir / f"{cluster}.json"
        self.lock_path = self.dir / f"{cluster}.lock"

    @contextmanager
    def _flock(self, path: Path) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        with self._flock(self.lock_path):
            try:
                state = json.loads(self.path.read_text())
            except FileNotFoundError:
                state = {}
            state.setdefault("holdings", {})
            state.setdefault("waiting", {})
            before = json.dumps(state, sort_keys=True)
            self._reclaim_dead(state["holdings"])
            self._reclaim_dead(state["waiting"])
            yield state
            if json.dumps(state, sort_keys=True) != before:
                _atomic_write_json(self.path, state)

    def _reclaim_dead(self, holdings: dict) -> None:
        now = time.time()
        for name, h in list(holdings.items()):
            # A lease (slots reserved by a waiting task's trigger) lapses if its task never comes for them.
            if not pid_alive(int(h["pid"]), h.get("pid_start")) or h.get("lease_until", now) < now:
                del holdings[name]

    def _team_held_elsewhere(self, team: str) -> int:
        """GPUs ``team`` holds on the other clusters' pools (read under the teams lock)."""
        held = 0
        for path in self.dir.glob("*.json"):
            if path == self.path:
                continue
            try:
                holdings = json.loads(path.read_text()).get("holdings", {})
            except (FileNotFoundError, ValueError):
                continue
            held += sum(
                int(h["slots"]) for h in holdings.values()
                if h.get("team") == team and pid_alive(int(h["pid"]), h.get("pid_start"))
            )
        return held

    def try_acquire(
        self,
        job_name: str,
        n: int,
        pid: int | None = None,
        *,
        priority: str = "normal",
        team: str | None = None,
        team_cap: int | None = None,
        queue: bool = False,
        since: float | None = None,
        lease_s: float | None = None,
        team_outside: int = 0,
    ) -> bool:
        """Take ``n`` slots for ``job_name`` all at once, or none. Idempotent per job name: taking
        slots the job already holds moves them to ``pid`` (and drops any lease).

        ``queue=True`` leaves (or refreshes) a ticket when the gang cannot start yet; it is removed
        when the gang is admitted, by :meth:`withdraw`, or when its process dies. ``since`` keeps a
        gang's place when its ticket is taken over by another process (a deferred task's trigger).
        ``lease_s``: the slots are reserved for that long only, unless the job takes them again.
        """
        if n < 1:
            raise ValueError(f"a gang needs at least one worker, got {n}")
        if n > self.capacity:
            raise GangError(
                f"gang {job_name!r} needs {n} slots but cluster {self.cluster!r} has only "
                f"{self.capacity}; request at most {self.capacity} workers"
            )
        if priority not in PRIORITY_RANK:
            raise ValueError(f"unknown priority {priority!r}; use one of {', '.join(PRIORITY_RANK)}")
        pid = os.getpid() if pid is None else pid
        if team is not None and team_cap is not None:
            with self._flock(self.dir / TEAMS_LOCK):
                elsewhere = self._team_held_elsewhere(team) + team_outside
                return self._try(job_name, n, pid, priority, team, team_cap, elsewhere, queue, since, lease_s)
        return self._try(job_name, n, pid, priority, team, None, 0, queue, since, lease_s)

    def _try(self, job_name: str, n: int, pid: int, priority: str, team: str | None, team_cap: int | None,
             team_elsewhere: int, queue: bool, since: float | None, lease_s: float | None) -> bool:
        with self._locked() as state:
            holdings, waiting = state["holdings"], state["waiting"]
            mine = holdings.get(job_name)
            ticket = waiting.get(job_name)
            now = time.time()
            since = ticket["since"] if ticket else (since or now)
            used = sum(int(h["slots"]) for name, h in holdings.items() if name != job_name)
            over_cap = False
            if team_cap is not None:
                team_here = sum(
                    int(h["slots"]) for name, h in holdings.items() if name != job_name and h.get("team") == team
                )
                over_cap = team_elsewhere + team_here + n > team_cap
            my_rank = (PRIORITY_RANK[priority], since)
            ahead = [
                name for name, t in waiting.items()
                if name != job_name and not t.get("over_cap")
                and (PRIORITY_RANK.get(t.get("priority"), 1), t["since"]) < my_rank
            ]
            if mine is None and (over_cap or ahead or used + n > self.capacity):
                if queue:
                    waiting[job_name] = {
                        "slots": n, "priority": priority, "team": team, "over_cap": over_cap,
                        "since": since, "pid": pid, "pid_start": _start_ticks(pid),
                    }
                return False
            waiting.pop(job_name, None)
            holdings[job_name] = {
                "slots": n,
                "pid": pid,
                "pid_start": _start_ticks(pid),
                "priority": priority,
                "team": team,
                "since": mine["since"] if mine else now,
                "queued_since": mine.get("queued_since", since) if mine else since,
            }
            if lease_s is not None:
                holdings[job_name]["lease_until"] = now + lease_s
            return True

    def withdraw(self, job_name: str) -> None:
        """Drop the gang's waiting ticket (it gave up or failed over)."""
        with self._locked() as state:
            state["waiting"].pop(job_name, None)

    def release(self, job_name: str) -> None:
        with self._locked() as state:
            state["holdings"].pop(job_name, None)

    def usage(self) -> int:
        with self._locked() as state:
            return sum(int(h["slots"]) for h in state["holdings"].values())

    def queued(self) -> int:
        """Slots asked for by gangs waiting for admission."""
        with self._locked() as state:
            return sum(int(t["slots"]) for t in state["waiting"].values())

    def holdings(self) -> dict[str, dict]:
        with self._locked() as state:
            return dict(state["holdings"])

    def waiting(self) -> dict[str, dict]:
        with self._locked() as state:
            return dict(state["waiting"])

    def load(self) -> ClusterLoad:
        """Held, queued and per-team slots, and the waiting gangs in admission order (a gang held
        only by its team's cap does not block the others: it comes last)."""
        with self._locked() as state:
            holdings, waiting = dict(state["holdings"]), dict(state["waiting"])
        teams: dict[str, int] = {}
        for h in holdings.values():
            if h.get("team"):
                teams[h["team"]] = teams.get(h["team"], 0) + int(h["slots"])
        order = sorted(waiting.items(), key=lambda kv: (bool(kv[1].get("over_cap")),
                                                        PRIORITY_RANK.get(kv[1].get("priority"), 1), kv[1]["since"]))
        return ClusterLoad(
            cluster=self.cluster, capacity=self.capacity, used=sum(int(h["slots"]) for h in holdings.values()),
            queued=sum(int(t["slots"]) for t in waiting.values()), teams=teams,
            waiting=tuple((name, int(t["slots"]), t.get("priority") or "normal", t.get("team")) for name, t in order),
        )

    def standing(self, job_name: str) -> QueueStanding:
        load = self.load()
        over_cap = bool(self.waiting().get(job_name, {}).get("over_cap"))
        found = standing_in(load, job_name)
        return QueueStanding(found.cluster, found.position, found.gpus_ahead, found.free, found.capacity, over_cap)


# -- gang backend ------------------------------------------------------------------------------
class LocalGangBackend(GangBackend):
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

    # -- admission ---
    def admit_step(self, job: GangJob, *, since: float | None = None, lease_s: float | None = None,
                   pid: int | None = None, preempted: set[str] | None = None,
                   log: Callable[[str], None] = print) -> bool:
        """One try to admit ``job``: take its slots, or leave its ticket (keeping its place from
        ``since``); a critical gang also stops batch gangs in its way. ``lease_s`` reserves the
        slots for the task that will launch the gang (a trigger admits on its behalf)."""
        if self.pool.try_acquire(job.name, job.workers, pid, priority=job.priority, team=job.team,
                                 team_cap=job.team_cap, queue=True, since=since, lease_s=lease_s,
                                 team_outside=job.team_held_outside):
            return True
        if job.priority == "critical" and self.critical_preempts_batch and preempted is not None:
            preempted |= self._preempt_batch(job, preempted, log)
        return False

    def _admit(self, job: GangJob, admission_timeout_s: float, log: Callable[[str], None],
               queued_since: float | None) -> float:
        """Wait up to ``admission_timeout_s`` for the gang's slots; returns the seconds it waited
        since it first queued (``queued_since``, epoch, when an earlier try already waited)."""
        deadline = time.monotonic() + admission_timeout_s
        since = queued_since or time.time()
        announced = False
        preempted: set[str] = set()
        try:
            while not self.admit_step(job, since=since, preempted=preempted, log=log):
                standing = self.pool.standing(job.name)
                if time.monotonic() >= deadline:
                    cap = (f"team {job.team!r} holds its gpu_cap of {job.team_cap} GPUs" if standing.over_team_cap
                           else standing.describe())
                    raise GangNotAdmitted(
                        f"gang {job.name!r} not admitted within {admission_timeout_s:g}s on cluster "
                        f"{self.cluster!r}: {cap}", cluster=self.cluster, over_team_cap=standing.over_team_cap,
                        queued_since=since, standing=standing,
                    )
                if not announced:
                    why = (f"team {job.team} at its gpu_cap of {job.team_cap}" if standing.over_team_cap
                           else standing.describe())
                    log(f"gang {job.name}: waiting for {job.workers} free slots on {self.cluster} "
                        f"(priority {job.priority}; {why})")
                    announced = True
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        finally:
            self.pool.withdraw(job.name)
        held = self.pool.holdings().get(job.name, {})
        return max(0.0, time.time() - float(held.get("queued_since") or since))

    def _preempt_batch(self, job: GangJob, already: set[str], log: Callable[[str], None]) -> set[str]:
        """Stop the newest batch gangs until ``job`` fits: SIGTERM, so each checkpoints and exits as
        preempted (its train task relaunches it, and it queues behind this critical gang)."""
        holdings = self.pool.holdings()
        if any(name in holdings for name in already):
            return set()  # earlier victims are still shutting down; their slots are on the way
        free = self.pool.capacity - sum(int(h["slots"]) for h in holdings.values())
        batch = sorted(
            ((name, h) for name, h in holdings.items() if h.get("priority") == "batch" and name != job.name),
            key=lambda item: -float(item[1].get("since", 0)),
        )
        if free + sum(int(h["slots"]) for _, h in batch) < job.workers:
            return set()  # stopping every batch gang would not be enough: do not stop any
        victims: set[str] = set()
        for name, h in batch:
            if free >= job.workers:
                break
            log(f"gang {job.name} (critical): preempting batch gang {name} ({h['slots']} slots); it checkpoints first")
            if self.cancel(name):
                victims.add(name)
            free += int(h["slots"])
        return victims

    # -- run ---
    def run(
        self,
        job: GangJob,
        *,
        admission_timeout_s: float,
        log: Callable[[str], None] | Any = print,
        queued_since: float | None = None,
        on_admitted: Callable[[float], None] | None = None,
    ) -> GangResult:
        """Admit, launch and supervise the gang; returns when every worker exited 0.

        ``log`` is a callable taking one line, or a logger (lines go to ``log.info``).

        Raises GangError if not admitted or a worker fails (GangPreempted for exit 75). The slots
        are released however this ends. Call from a long-lived thread: PR_SET_PDEATHSIG fires when
        the launching *thread* exits.
        """
        for label, value in (("job name", job.name), ("attempt", job.attempt)):
            if not value or "/" in value or value in (".", ".."):
                raise GangError(
                    f"{label} {value!r} cannot name a folder; use letters, numbers, '-', '_' or '.'"
                )
        if job.workers < 1:
            raise GangError(f"gang {job.name!r} needs at least one worker, got {job.workers}")
        if hasattr(log, "info"):  # a logging/structlog logger, e.g. an operator's self.log
            log = log.info
        queued_s = self._admit(job, admission_timeout_s, log, queued_since)
        procs: list[subprocess.Popen] = []
        try:
            if on_admitted is not None:
                on_admitted(queued_s)
            self._stop_leftovers(job.name, log)
            # A stop asked for an earlier launch; this one was started after it (a cleared task).
            self._stop_path(job.name).unlink(missing_ok=True)
            run_dir = self.job_dir(job.name) / job.attempt
            run_dir.mkdir(parents=True, exist_ok=True)
            spec_path = run_dir / "job.json"
            _atomic_write_json(spec_path, job.spec)
            log_paths = [run_dir / f"rank-{r}.log" for r in range(job.workers)]
            port = _free_port()
            base_env = dict(os.environ)
            base_env.update(job.env)
            include_dir = str(Path(hybridflow.__file__).resolve().parents[1])
            base_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (include_dir, base_env.get("PYTHONPATH")) if p
            )
            base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the gang talks over loopback only
            base_env.update(
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(job.workers),
                    "PYTHONUNBUFFERED": "1",
                }
            )
            log(
                f"gang {job.name} attempt {job.attempt}: starting {job.workers} workers on "
                f"{self.cluster} (master 127.0.0.1:{port}, logs {run_dir})"
            )
            # A reused attempt label appends to its logs; stream only what this launch writes.
            rank0_offset = log_paths[0].stat().st_size if log_paths[0].exists() else 0
            started = time.monotonic()
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
            codes, first_failure = self._supervise(job, procs, log_paths[0], rank0_offset, log)
            seconds = time.monotonic() - started
            failed = [(r, c) for r, c in enumerate(codes) if c != 0]
            if failed:
                rank, code = first_failure or failed[0]
                others = ", ".join(f"rank {r}: {c}" for r, c in failed if r != rank) or "none"
                tail = _tail(log_paths[rank])
                stop = _read_json(self._stop_path(job.name))
                if code == PREEMPTED_EXIT_CODE and stop is not None:
                    self._stop_path(job.name).unlink(missing_ok=True)
                    raise GangStopped(
                        f"gang {job.name!r} was stopped after checkpointing: {stop.get('reason')}",
                        reason=str(stop.get("reason")),
                        rank=rank,
                        exit_code=code,
                        log_tail=tail,
                    )
                if code == PREEMPTED_EXIT_CODE:
                    raise GangPreempted(
                        f"gang {job.name!r} was preempted (rank {rank} exited {code} after checkpointing); "
                        f"rerun to resume from the last checkpoint. Log {log_paths[rank]}:\n{tail}",
                        rank=rank,
                        exit_code=code,
                        log_tail=tail,
                    )
                # The first rank to exit is often a peer that lost the collective, not the one that
                # raised: name every other rank's own error too.
                causes = "".join(f"\nrank {r} raised: {err}" for r, _ in failed
                                 if r != rank and (err := _last_error(log_paths[r])))
                raise GangFailed(
                    f"gang {job.name!r} failed: rank {rank} exited with code {code} (other ranks: {others}). "
                    f"Log {log_paths[rank]}, last lines:\n{tail}{causes}",
                    rank=rank,
                    exit_code=code,
                    log_tail=tail,
                )
            log(f"gang {job.name}: all {job.workers} workers finished in {seconds:.1f}s")
            return GangResult(exit_codes=codes, seconds=seconds, log_paths=log_paths, job_dir=run_dir,
                              queued_s=queued_s)
        finally:
            self._terminate(procs)
            self._record_path(job.name).unlink(missing_ok=True)
            self.pool.release(job.name)

    def _supervise(
        self,
        job: GangJob,
        procs: list[subprocess.Popen],
        rank0_log: Path,
        rank0_offset: int,
        log: Callable[[str], None],
    ) -> tuple[list[int], tuple[int, int] | None]:
        """Wait for all workers, streaming rank 0's log; on the first failure stop the others.
        Returns the exit codes and the (rank, code) of the first failure seen."""
        first_failure: tuple[int, int] | None = None
        partial = b""
        with open(rank0_log, "rb") as stream:
            stream.seek(rank0_offset)

            def pump() -> None:
                nonlocal partial
                chunk = stream.read()
                if chunk:
                    *lines, partial = (partial + chunk).split(b"\n")
                    for line in lines:
                        log(line.decode(errors="replace"))

            while True:
                pump()
                codes = [p.poll() for p in procs]
                if first_failure is None:
                    failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                    if failed:
                        first_failure = failed[0]
                        log(
                            f"gang {job.name}: rank {failed[0][0]} exited {failed[0][1]}; stopping the other workers"
                        )
                        self._terminate(procs)
                        continue
                if all(c is not None for c in codes):
                    break
                time.sleep(self.poll_s)
            pump()
            if partial:
                log(partial.decode(errors="replace"))
        return [p.returncode for p in procs], first_failure

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

    def stop(self, job_name: str, reason: str) -> bool:
        """Stop a running gang for good: like :meth:`cancel` (SIGTERM, the workers checkpoint), but
        its launcher raises :class:`GangStopped` with ``reason`` instead of a relaunchable preemption."""
        _atomic_write_json(self._stop_path(job_name), {"reason": reason, "at": time.time()})
        stopped = self.cancel(job_name)
        if not stopped:
            self._stop_path(job_name).unlink(missing_ok=True)
        return stopped

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
