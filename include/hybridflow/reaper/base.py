"""What every finder of leftovers keeps to, and what a sweep hands around.

A :class:`Finder` lists the things of one kind that the product created in one place (a cluster or a
store), found by the product's own labels and state files only, never by anything else there, and
releases one of them (idempotent: a thing already gone is released). Each :class:`Leftover` names
the Airflow task it was made for (:class:`Owner`) when it has one; the sweep decides from Airflow's
states whether that owner is still alive and never releases what a live run may still use. Things
without an owner (a serving version, a multipart upload) carry the finder's own verdict in
``reason``. A gang carries the Airflow instance that made it (:func:`hybridflow.backends.base.instance_identity`):
one of another instance, or naming none, is found with ``skip`` set, and the sweep only reports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class Owner:
    """The Airflow task a thing was made for. ``task_id`` None: the whole DAG run (e.g. its scratch
    folder); ``try_number`` None: any try of the task."""

    dag_id: str
    run_id: str
    task_id: str | None = None
    try_number: int | None = None


@dataclass(frozen=True)
class Leftover:
    place: str  # the cluster or store it lives in, as named in config
    kind: str  # one of KINDS
    name: str  # unique within (place, kind)
    owner: Owner | None = None
    gpus: int = 0  # GPUs it holds now (0 for anything that holds none)
    since: datetime | None = None  # when it was made or started (aware UTC), if known
    reason: str = ""  # why it is a leftover, for things judged without an owner
    detail: dict = field(default_factory=dict, compare=False)  # what release() needs, e.g. a pid
    # Why this instance's sweep leaves it alone without judging it: another Airflow instance made it
    # (its run ids mean nothing in this instance's metadata database), or it names no instance.
    skip: str = ""


KINDS = (
    "gang-job",  # a Kubernetes gang job (Volcano Job or batch/v1 Job) and its pods
    "gang-pod",  # a gang pod whose job is gone
    "gang-secret",  # a gang's credentials Secret
    "local-gang",  # a local backend gang: its processes and slots
    "slot-holding",  # a local slot holding whose gang is gone
    "queue-ticket",  # a local gang's place in its cluster's queue (it holds no GPUs, but gangs behind it wait)
    "serving-version",  # a serving version that is neither stable nor canary
    "multipart-upload",  # an unfinished multipart upload older than the set age
    "scratch",  # a finished run's scratch folder
)


class Finder(ABC):
    """The leftovers of one or more kinds in one place."""

    place: str

    @abstractmethod
    def find(self, now: datetime) -> list[Leftover]:
        """Candidates: things the product made here, with owner or reason filled in. Read-only."""

    @abstractmethod
    def release(self, leftover: Leftover) -> None:
        """Delete or stop ``leftover``; a thing already gone is not an error."""


@dataclass(frozen=True)
class Release:
    """What a sweep did with one leftover: released it, or (dry-run) only listed it."""

    leftover: Leftover
    dry_run: bool
    released: bool  # False in dry-run, or when release() failed (``error`` says why)
    # GPU-hours the leftover had held since its owner ended (or since it was made, without an
    # owner): what releasing it stopped from growing. 0 for things that hold no GPUs.
    gpu_hours: float = 0.0
    error: str = ""


@dataclass
class Sweep:
    """One run of the reaper over every place. ``key`` names it for the ledger: the reaper DAG run's
    data interval (``<start>/<end>`` ISO UTC), so a cleared and re-run sweep of the same interval
    replaces its record instead of adding a second one ("" outside a DAG run)."""

    started: datetime
    finished: datetime | None = None
    releases: list[Release] = field(default_factory=list)
    kept: int = 0  # candidates kept because their owner is alive (or could not be judged)
    errors: dict[str, str] = field(default_factory=dict)  # place -> why it could not be swept
    key: str = ""
    # Found, but not this instance's to judge (``Leftover.skip`` says why): never released, never counted as kept.
    skipped: list[Leftover] = field(default_factory=list)
