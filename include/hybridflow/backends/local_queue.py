"""How a gang gets its slots on a local cluster: a try to admit it, its ticket while its task
waits deferred, what a waiting gang's trigger may read (admissible now, or by stopping batch
gangs), and a critical gang stopping batch gangs in its way. Mixed into
:class:`~hybridflow.backends.local.LocalGangBackend` (``self.pool``, ``self.cancel``)."""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.backends.base import INSTANCE_KEY, GangJob, instance_identity
from hybridflow.backends.local_slots import _atomic_write_json, _read_json
from hybridflow.errors import GangError


def _check_job(job: GangJob) -> None:
    """The job's name and attempt name folders; a gang has at least one worker."""
    for label, value in (("job name", job.name), ("attempt", job.attempt)):
        if not value or "/" in value or value in (".", ".."):
            raise GangError(
                f"{label} {value!r} cannot name a folder; use letters, numbers, '-', '_' or '.'"
            )
    if job.workers < 1:
        raise GangError(f"gang {job.name!r} needs at least one worker, got {job.workers}")


class LocalQueue:
    """The admission half of the local backend."""

    def admit_step(self, job: GangJob, *, since: float | None = None, pid: int | None = None,
                   preempted: set[str] | None = None, log: Callable[[str], None] = print) -> bool:
        """One try to admit ``job``: take its slots, or leave its ticket (keeping its place from
        ``since``); a critical gang also stops batch gangs in its way."""
        self._note_owner(job)
        if self.pool.try_acquire(job.name, job.workers, pid, priority=job.priority, team=job.team,
                                 team_cap=job.team_cap, queue=True, since=since,
                                 team_outside=job.team_held_outside, private_only=job.private_only,
                                 movable=job.movable):
            return True
        if job.priority == "critical" and self.critical_preempts_batch and preempted is not None:
            preempted |= self._preempt_batch(job, preempted, log)
        if job.private_only and preempted is not None:
            preempted |= self._make_room(job, preempted, log)
        return False

    def keep_place(self, job: GangJob, *, since: float, keep_s: float) -> None:
        """The gang's ticket while its task waits deferred: its place from ``since``, kept ``keep_s``
        (the task keeps it again each admission window). Takes no slots."""
        self._note_owner(job)
        self.pool.keep_ticket(job.name, job.workers, since=since, keep_s=keep_s, priority=job.priority, team=job.team,
                              team_cap=job.team_cap, team_outside=job.team_held_outside,
                              private_only=job.private_only)

    def admission(self, job: GangJob) -> str | None:
        """What the waiting gang's task may do now, read without changing anything: ``now`` (its slots
        are free and nobody ranks ahead), ``preempt`` (a critical gang that fits once batch gangs
        stop: the task stops them), or None (it waits)."""
        if self.pool.admissible(job.name, job.workers, priority=job.priority, team=job.team, team_cap=job.team_cap,
                                team_outside=job.team_held_outside):
            return "now"
        if job.priority == "critical" and self.critical_preempts_batch and \
                self._batch_to_stop(job, self.pool.live_holdings()):
            return "preempt"
        if job.private_only and self._movable_to_move(job, self.pool.live_holdings()):
            return "preempt"
        return None

    def _note_owner(self, job: GangJob) -> None:
        owner = {**job.owner, INSTANCE_KEY: instance_identity()} if job.owner else None
        if owner and _read_json(self.owner_path(job.name)) != owner:
            _check_job(job)
            _atomic_write_json(self.owner_path(job.name), owner)

    def _make_room(self, job: GangJob, already: set[str], log: Callable[[str], None]) -> set[str]:
        """Move the newest movable gangs (interruptible, may run public) off this cluster until ``job``,
        which may run only on private clusters and waits first in the queue, fits: each checkpoints and
        its task places it on a public cluster."""
        holdings = self.pool.holdings()
        if any(name in holdings for name in already):
            return set()  # earlier ones are still checkpointing; their slots are on the way
        moved: set[str] = set()
        for name, slots in self._movable_to_move(job, holdings):
            reason = (f"making room on {self.cluster} for gang {job.name}, which may run only on private clusters "
                      "(placement.reservation)")
            log(f"gang {job.name}: moving gang {name} ({slots} slots) to make room; it checkpoints first")
            if self.move(name, reason):
                moved.add(name)
        return moved

    def _movable_to_move(self, job: GangJob, holdings: dict) -> list[tuple[str, int]]:
        """The newest movable gangs of ``holdings`` whose slots make room for ``job`` (name, slots): none
        unless ``job`` waits first in the queue and moving every movable gang would be enough."""
        waiting = self.pool.load().waiting
        if waiting and waiting[0][0] != job.name:
            return []  # room made now would go to the gang ahead of it
        return self._newest_until_fits(job, holdings, lambda h: bool(h.get("movable")))

    def _preempt_batch(self, job: GangJob, already: set[str], log: Callable[[str], None]) -> set[str]:
        """Stop the newest batch gangs until ``job`` fits: SIGTERM, so each checkpoints and exits as
        preempted (its train task relaunches it, and it queues behind this critical gang)."""
        holdings = self.pool.holdings()
        if any(name in holdings for name in already):
            return set()  # earlier victims are still shutting down; their slots are on the way
        victims: set[str] = set()
        for name, slots in self._batch_to_stop(job, holdings):
            log(f"gang {job.name} (critical): preempting batch gang {name} ({slots} slots); it checkpoints first")
            if self.cancel(name):
                victims.add(name)
        return victims

    def _batch_to_stop(self, job: GangJob, holdings: dict) -> list[tuple[str, int]]:
        """The newest batch gangs of ``holdings`` whose slots make room for ``job`` (name, slots); none
        when stopping every batch gang would not be enough."""
        return self._newest_until_fits(job, holdings, lambda h: h.get("priority") == "batch")

    def _newest_until_fits(self, job: GangJob, holdings: dict, may_go) -> list[tuple[str, int]]:
        """The newest holdings that ``may_go`` whose slots make room for ``job``, newest first; none when
        all of them would not be enough."""
        free = self.pool.capacity - sum(int(h["slots"]) for h in holdings.values())
        batch = sorted(((name, int(h["slots"]), float(h.get("since", 0))) for name, h in holdings.items()
                        if may_go(h) and name != job.name), key=lambda item: -item[2])
        if free >= job.workers or free + sum(slots for _, slots, _ in batch) < job.workers:
            return []
        chosen = []
        for name, slots, _ in batch:
            if free >= job.workers:
                break
            chosen.append((name, slots))
            free += slots
        return chosen

