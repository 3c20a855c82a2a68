"""How a gang job ends badly, whatever its backend: the train task decides what each one means
(fail over or wait, relaunch, stop for good, or let Airflow retry)."""

from __future__ import annotations

from typing import Any

from hybridflow.errors import GangError


class GangWorkerExit(GangError):
    """A worker of an admitted gang exited non-zero: which rank, its exit code and its log tail."""

    def __init__(self, message: str, *, rank: int, exit_code: int, log_tail: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.log_tail = log_tail


class GangNotAdmitted(GangError):
    """The gang's slots did not all come free within the admission timeout; nothing was started."""

    def __init__(self, message: str, *, cluster: str, over_team_cap: bool = False, queued_since: float | None = None,
                 standing: Any = None, moved: str | None = None) -> None:
        super().__init__(message)
        self.cluster = cluster
        # Why the gang was moved off the cluster after checkpointing (making room), when that is what
        # ended it there: the task places it elsewhere as for a gang not admitted in time.
        self.moved = moved
        # Held back by its team's gpu_cap, which spans clusters: another cluster would not help.
        self.over_team_cap = over_team_cap
        self.queued_since = queued_since  # epoch seconds the gang first queued
        self.standing = standing  # its QueueStanding when it gave up waiting here, if known


class GangPreempted(GangWorkerExit):
    """A worker stopped on SIGTERM after checkpointing (exit 75): rerun the gang to resume."""


class GangMoved(GangPreempted):
    """The gang was stopped after checkpointing to make room for work that may run only on its
    cluster (:meth:`LocalGangBackend.move`): its task places the run again elsewhere, where it
    resumes from that checkpoint. ``reason`` says for what."""

    def __init__(self, message: str, *, reason: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.reason = reason


class GangFailed(GangWorkerExit):
    """A worker failed (any other non-zero exit); the whole gang was stopped."""


class PreemptionBudgetSpent(GangFailed):
    """The gang was preempted more often than ``training.preemption_retries`` allows (a scheduler
    that restarts gangs itself counts the restarts): not retried, like a relaunch budget spent."""


class GangStopped(GangWorkerExit):
    """The gang was stopped on purpose with :meth:`LocalGangBackend.stop` (e.g. its project's budget
    is spent): the workers checkpointed, and it must not be relaunched. ``reason`` says why."""

    def __init__(self, message: str, *, reason: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.reason = reason
