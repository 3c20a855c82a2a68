"""The contract every cluster backend keeps, and what placement reads from a cluster.

A :class:`GangBackend` runs gang jobs on one cluster of the estate (``backend`` in clusters.yaml):
:meth:`~GangBackend.submit` a gang (or re-attach to it) and :meth:`~GangBackend.poll` its
:class:`GangHandle` (waiting with its place in the queue, running, succeeded, preempted, stopped,
failed with the reason), or both in one blocking :meth:`~GangBackend.run`; :meth:`~GangBackend.cancel`
(the task was stopped), :meth:`~GangBackend.stop` (stopped for good, e.g. a budget freeze), and
:meth:`~GangBackend.load`: GPUs in use, GPUs queued and GPUs held per team, as the cluster itself
reports them; plus what a kind of backend offers (:attr:`~GangBackend.supervised_by_task`,
:attr:`~GangBackend.reads_private_storage`). :func:`hybridflow.backends.gang_backend` is the one
place that picks the implementation for a cluster.

:class:`ClusterLoad` is what placement, the spill threshold and the team caps work from; a cluster
whose load cannot be read is ``reachable=False`` with the reason, and placement never chooses it.
:class:`QueueStanding` is where one waiting gang stands in its cluster's queue.
"""

from __future__ import annotations

import hashlib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from hybridflow.errors import ConfigError

OWNER_KEYS = ("dag_id", "run_id", "task_id", "try_number")

# Which Airflow deployment made a gang: the label hybridflow.io/instance on a Kubernetes gang's job,
# pods, Secret and Service, the key "instance" in a local gang's owner.json. Its reaper releases only
# its own gangs (another deployment's run ids mean nothing in this one's metadata database).
INSTANCE_KEY = "instance"
INSTANCE_ENV = "HYBRIDFLOW_INSTANCE"
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def instance_identity() -> str:
    """This Airflow deployment's identity on the gangs it makes: ``$HYBRIDFLOW_INSTANCE`` (set it to
    the same value on every Airflow component of a deployment), else ``airflow-`` and 12 hex digits
    of the SHA-256 of the address of the deployment's Execution API (``[core]
    execution_api_server_url``, by default ``[api] base_url`` + ``/execution/``; scheme, host, port
    and path, never credentials or a query), which every worker of one deployment reports to.

    Not the metadata database: Airflow 3 hides its location from task processes (the train and
    reaper tasks that label and judge gangs), replacing it with a URL that names no database."""
    value = os.environ.get(INSTANCE_ENV, "").strip()
    if not value:
        return "airflow-" + hashlib.sha256(_execution_api().encode()).hexdigest()[:12]
    if not _INSTANCE_RE.match(value):
        raise ConfigError(f"{INSTANCE_ENV}={value!r} cannot name an Airflow instance on a gang (it becomes the "
                          "label hybridflow.io/instance): use at most 63 letters, digits, '-', '_' or '.', "
                          "starting and ending with a letter or digit, e.g. HYBRIDFLOW_INSTANCE=prod-eu")
    return value


def _execution_api() -> str:
    from urllib.parse import urlsplit

    from airflow.executors.base_executor import get_execution_api_server_url

    url = urlsplit(get_execution_api_server_url())
    return f"{url.scheme}://{(url.hostname or '').lower()}:{url.port or ''}{url.path.rstrip('/')}"


def owner_annotations(owner: Mapping[str, Any]) -> dict[str, str]:
    """Kubernetes annotations naming a gang's owner (``GangJob.owner``): ``hybridflow.io/dag-id``,
    ``run-id``, ``task-id``, ``try-number`` (label values cannot hold run ids); empty without one.
    Read back by :func:`hybridflow.reaper.owners.owner_from_annotations`."""
    return {f"hybridflow.io/{k.replace('_', '-')}": str(owner[k]) for k in OWNER_KEYS
            if owner and owner.get(k) is not None}


@dataclass(frozen=True)
class GangJob:
    name: str  # deterministic per run (e.g. "<dag>-<run>-train") so a retry finds its own slots
    workers: int
    spec: dict  # written to job.json for the workers; must not hold credentials
    env: dict[str, str] = field(default_factory=dict, repr=False)  # extra env, incl. store credentials
    attempt: str = "1"
    # Who the gang works for (project, team, priority, interruptible), kept with the running gang so a
    # budget freeze can find a project's gangs and admission can order, cap and preempt by them.
    labels: dict[str, str] = field(default_factory=dict)
    # The team's gpu_cap over the estate (None: no cap, e.g. critical runs), and the GPUs the team
    # holds on clusters outside this machine's slot pools (Kubernetes), which count against it too.
    team_cap: int | None = None
    team_held_outside: int = 0
    # The Airflow task the gang works for ("dag_id", "run_id", "task_id", "try_number", as strings),
    # kept with the gang so the resource reaper can tell a gang whose run ended from a live one.
    owner: dict[str, str] = field(default_factory=dict)

    @property
    def priority(self) -> str:
        return self.labels.get("priority", "normal")

    @property
    def team(self) -> str | None:
        return self.labels.get("team")

    @property
    def movable(self) -> bool:
        """The gang may be moved to a public cluster to make room for private-only work (label
        ``movable``, set by the train task: interruptible, may run public, move budget left)."""
        return self.labels.get("movable") == "true"

    @property
    def private_only(self) -> bool:
        """The gang may run only on private clusters (label ``private_only``, set by the train task)."""
        return self.labels.get("private_only") == "true"


def owner_from_annotations(annotations: Mapping[str, str] | None) -> dict[str, str]:
    """The owner keys named by :func:`owner_annotations` (empty when they name none)."""
    annotations = annotations or {}
    found = {k: annotations.get(f"hybridflow.io/{k.replace('_', '-')}") for k in OWNER_KEYS}
    return {k: str(v) for k, v in found.items() if v is not None}


@dataclass(frozen=True)
class ConnectionProblem:
    """Why the cluster's Connection cannot be used now, and what to change."""

    cluster: str
    conn_id: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"cluster {self.cluster} (Connection {self.conn_id}): {self.problem}; {self.fix}"


@dataclass(frozen=True)
class GangRemnant:
    """Something a backend made for a gang that is there now: the gang itself, or a part of one whose
    gang is gone (a Kubernetes pod or Secret, a local slot holding or queue ticket). The resource
    reaper judges it by ``owner`` (the keys of :data:`OWNER_KEYS` as the gang carries them; empty:
    it names none) and ``instance`` (the Airflow instance that made it), and releases it with
    :meth:`GangBackend.clear`."""

    kind: str  # gang-job, gang-pod, gang-secret (Kubernetes); local-gang, slot-holding, queue-ticket (local)
    name: str
    owner: Mapping[str, str] = field(default_factory=dict)
    instance: str | None = None
    gpus: int = 0  # GPUs it holds now
    since: datetime | None = None
    reason: str = ""  # why it is a leftover without an owner (e.g. its gang job is gone)
    detail: dict = field(default_factory=dict, compare=False)
    # How to hand one that names no instance to instance "{instance}" (filled in by the reader).
    handover: str = ""


@dataclass(frozen=True)
class ClusterLoad:
    """One reading of a cluster: GPUs held by admitted gangs (``used``), GPUs asked for by gangs
    waiting for admission (``queued``), GPUs each team holds (``teams``) and, per waiting gang in
    admission order, ``(name, gpus, priority, team)`` (``waiting``). ``reachable`` False: the
    numbers are unknown (zeros), ``reason`` says why."""

    cluster: str
    capacity: int
    used: int = 0
    queued: int = 0
    teams: Mapping[str, int] = field(default_factory=dict)
    waiting: tuple[tuple[str, int, str, str | None], ...] = ()
    reachable: bool = True
    reason: str = ""
    # Kubernetes: the team queues that exist on the cluster (Volcano Queues, Kueue LocalQueues of the
    # namespace); None where queues are not named (the local backend) or could not be read.
    queues: frozenset[str] | None = None
    # GPUs of waiting gangs that may run only on private clusters (restricted data, or regions only
    # private clusters are in): placement keeps private capacity for them (hybridflow.placement.reserve).
    # The local pool knows them; a Kubernetes cluster counts its waiting gangs labelled private_only.
    private_only_queued: int = 0

    @property
    def free(self) -> int:
        return max(self.capacity - self.used, 0)

    def has_room(self, gpus: int) -> bool:
        """A gang of ``gpus`` would be admitted now: free GPUs and nobody queued ahead of it."""
        return self.reachable and self.queued == 0 and self.free >= gpus

    @classmethod
    def unknown(cls, cluster: str, capacity: int, reason: str) -> ClusterLoad:
        return cls(cluster=cluster, capacity=capacity, reachable=False, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["teams"] = dict(self.teams)
        out["waiting"] = [list(w) for w in self.waiting]
        out["queues"] = None if self.queues is None else sorted(self.queues)
        return out


@dataclass(frozen=True)
class QueueStanding:
    """Where a waiting gang stands: 1-based ``position`` among the gangs waiting on the cluster (0:
    not waiting), the GPUs of the gangs ahead of it, the cluster's free GPUs and capacity, and
    ``over_team_cap`` when its team's gpu_cap is what holds it."""

    cluster: str
    position: int
    gpus_ahead: int
    free: int
    capacity: int
    over_team_cap: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.over_team_cap:
            return "held by its team's gpu_cap"
        if self.position <= 0:
            return f"not queued; {self.free} of {self.capacity} GPUs free"
        return (f"position {self.position} in the queue of {self.cluster}, {self.gpus_ahead} GPUs ahead of it, "
                f"{self.free} of {self.capacity} GPUs free")


def standing_in(load: ClusterLoad, name: str) -> QueueStanding:
    """``name``'s standing from a load reading (0 when it is not among the waiting gangs)."""
    ahead = 0
    for position, (other, gpus, _priority, _team) in enumerate(load.waiting, start=1):
        if other == name:
            return QueueStanding(load.cluster, position, ahead, load.free, load.capacity)
        ahead += gpus
    return QueueStanding(load.cluster, 0, 0, load.free, load.capacity)


# A gang's phase, whatever runs it: pending (waiting for admission), running, restarting (its
# scheduler relaunches it after a preemption), succeeded, failed, missing (no such gang); and, where
# the task relaunches the gang itself (the local backend), preempted (checkpointed and stopped: the
# task may relaunch it) and stopped (stopped for good: a budget freeze, its cluster declared down).
PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, MISSING = (
    "pending", "running", "restarting", "succeeded", "failed", "missing")
PREEMPTED, STOPPED = "preempted", "stopped"
APPLICATION, BUDGET_SPENT = "application", "preemption_budget"


@dataclass(frozen=True)
class GangStatus:
    """One reading of a gang job: ``phase`` is one of the phases above; ``message`` says why a gang
    failed or stopped; ``standing`` is where a pending gang waits (its position in the queue)."""

    phase: str
    message: str = ""
    retries: int = 0  # gang restarts after a preemption so far
    cause: str = ""  # of a failure: APPLICATION (a worker failed) or BUDGET_SPENT (preempted too often)
    standing: QueueStanding | None = field(default=None, compare=False)

    @property
    def terminal(self) -> bool:
        return self.phase in (SUCCEEDED, FAILED, MISSING, PREEMPTED, STOPPED)

    def to_dict(self) -> dict:
        return {"phase": self.phase, "message": self.message, "retries": self.retries, "cause": self.cause}


@dataclass(frozen=True)
class GangHandle:
    """A submitted gang, as :meth:`GangBackend.submit` returns it for :meth:`GangBackend.poll`.

    ``created`` False: a gang of that name was already there and submit re-attached to it;
    ``admitted``: the gang held its GPUs already when submit returned.
    ``state`` is the backend's own: the local backend keeps the gang's worker processes there, so
    its handle is good only in the thread that submitted it (the workers die with it; see
    :attr:`GangBackend.supervised_by_task`); a Kubernetes handle is the job's name and holds nothing."""

    cluster: str
    name: str
    attempt: str
    created: bool = True
    admitted: bool = False
    submitted_at: float = 0.0
    state: Any = field(default=None, compare=False, repr=False)


class GangBackend(ABC):
    """Gang jobs on one cluster: :meth:`submit` a gang, :meth:`poll` its handle until its status is
    terminal, :meth:`cancel` or :meth:`stop` it, read the cluster's :meth:`load`. Each backend's blocking
    ``run`` is submit and poll in a loop, ending in the errors of :mod:`hybridflow.backends.errors`:
    ``GangNotAdmitted`` when the gang was not admitted in time, ``GangPreempted``, ``GangStopped``,
    ``GangFailed``."""

    cluster_name: str

    @abstractmethod
    def submit(self, job: GangJob, *, pool: str | None = None, queue: str | None = None) -> GangHandle:
        """Hand ``job`` to the cluster (on node pool ``pool``, in queue ``queue`` where the cluster names
        them), or re-attach to the gang of that name this run already has there. Returns at once: the
        gang waits for admission on the cluster, and :meth:`poll` says how it goes."""

    @abstractmethod
    def poll(self, handle: GangHandle) -> GangStatus:
        """Where the submitted gang is now: pending with its :class:`QueueStanding`, running,
        restarting, or terminal (succeeded; preempted or stopped with the reason; failed with the
        reason). Where the task supervises the gang (:attr:`supervised_by_task`), polling is what
        moves it on: it starts the workers once admitted and stops the others after a first failure."""

    @abstractmethod
    def run(self, job: GangJob, *, pool: str | None = None, queue: str | None = None, admission_timeout_s: float,
            log: Any = None, **waiting: Any) -> Any:
        """:meth:`submit` and :meth:`poll` until the gang ended, blocking: returns when it succeeded,
        raises ``GangNotAdmitted`` when it was not admitted within ``admission_timeout_s`` and the
        other errors of :mod:`hybridflow.backends.errors` when it did not succeed. ``waiting`` holds what
        a backend's own wait takes (its poll interval, the place an earlier try kept in the queue)."""

    @abstractmethod
    def status(self, name: str) -> GangStatus:
        """Gang ``name``'s phase now (``missing`` when there is none), with the restarts its
        scheduler made after preemptions where the scheduler restarts gangs itself."""

    @abstractmethod
    def load(self) -> ClusterLoad:
        """GPUs in use, queued, and held per team on the cluster, now (never raises: an unreadable
        cluster is :meth:`ClusterLoad.unknown`)."""

    def standing(self, name: str) -> QueueStanding:
        """Where gang ``name`` stands among the gangs waiting on the cluster now (position 0: it is not
        waiting, or the cluster could not be read): the position a waiting status is reported with."""
        return standing_in(self.load(), name)

    def usage(self) -> int:
        return self.load().used

    def queued(self) -> int:
        return self.load().queued

    def team_usage(self) -> dict[str, int]:
        return dict(self.load().teams)

    @abstractmethod
    def cancel(self, name: str) -> bool:
        """Stop the gang because its task was stopped (checkpoint first where it can); True if it ran."""

    @abstractmethod
    def stop(self, name: str, reason: str) -> bool:
        """Stop the gang for good with ``reason`` (it must not be relaunched); True if it ran."""

    @abstractmethod
    def find_gangs(self, labels: Mapping[str, str], *, not_labels: Mapping[str, str] | None = None) -> list[str]:
        """Names (sorted) of the gangs running on the cluster whose labels have every ``labels``
        value and none of the ``not_labels`` values (label keys without the ``hybridflow.io/`` prefix)."""

    @abstractmethod
    def remnants(self) -> list[GangRemnant]:
        """Every gang, and every part of a gang whose gang is gone, that this backend made on the
        cluster, found by the product's own labels or state files only. Read-only."""

    @abstractmethod
    def clear(self, remnant: GangRemnant, reason: str) -> None:
        """Release ``remnant`` (a gang is stopped for good with ``reason``, with what it holds); one
        already gone is not an error."""

    @abstractmethod
    def move(self, name: str, reason: str) -> bool:
        """Stop gang ``name`` after its checkpoint so that its task places the run elsewhere (making room
        for work that may run only on this cluster); True if it ran."""

    def make_room(self, name: str, log: Callable[[str], None] = print) -> list[str]:
        """If waiting gang ``name`` (work that may run only on this cluster) heads the queue and does
        not fit, :meth:`move` the newest movable gangs off until it does; the names moved. A backend
        whose queue does this itself when it admits (the local one) has nothing to do here."""
        return []

    def check_job(self, job: GangJob, *, pool: str | None = None, queue: str | None = None) -> None:
        """Refuse ``job`` before anything is started or deleted when this backend could not run it
        (on node pool ``pool``, in queue ``queue``), naming the field; nothing to check by default."""
        return None

    def gang_name(self, dag_id: str, run_id: str, task_id: str, *, readable: str) -> str:
        """The name of the gang a task runs here: the same for every try of the task (a retry or a
        cleared task finds its gang again), unique per run. ``readable`` (``train-<run key>``) is
        unique on a machine's own state."""
        return readable

    def wait_trigger(self, name: str, *, submitted_at: float, admitted: bool, queued_since: float,
                     admission_timeout_s: float, poll_s: float, max_wait_s: float) -> Any:
        """The trigger that waits, in Airflow's triggerer, for a submitted gang ``name`` for one
        admission window (and then for its end): it only reads the gang's status and yields one
        event. Only where the cluster's scheduler runs the gang (not :attr:`supervised_by_task`)."""
        raise NotImplementedError(f"{type(self).__name__} gangs are supervised by their task: there is nothing "
                                  "to wait for in the triggerer")

    @property
    def supervised_by_task(self) -> bool:
        """The gang's processes are launched and supervised by the train task itself (so it cannot
        wait for them in the triggerer), rather than submitted to a cluster scheduler."""
        return False

    @property
    def reads_private_storage(self) -> bool:
        """Its gangs run on machines that mount private storage: data is read where it lives and a
        checkpoint place of kind ``local`` is reachable from the task."""
        return False
