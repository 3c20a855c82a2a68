"""Leftover gangs of one cluster, whatever backend runs them: what the cluster's
:class:`~hybridflow.backends.base.GangBackend` reports it made (:meth:`~GangBackend.remnants`:
gangs, and parts of gangs whose gang is gone), each judged by the owner it names
(:mod:`hybridflow.reaper.owners`), and released through the backend (:meth:`~GangBackend.clear`).

A remnant naming another Airflow instance than this one (:func:`hybridflow.backends.base.instance_identity`),
or none, is found with ``skip`` set and only reported, whatever its owner: another deployment's run
ids mean nothing in this one's metadata database. One naming no owner is kept, except a part whose
gang is gone (a Kubernetes pod: nothing will ever manage it again), which carries why.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hybridflow.backends.base import GangRemnant, instance_identity
from hybridflow.reaper.base import Finder, Leftover
from hybridflow.reaper.owners import not_ours, owner_from_record

STOP_REASON = "released by the resource reaper: the Airflow task it ran for has ended"


class GangFinder(Finder):
    """The gangs of one cluster's backend; ``instance``: the Airflow instance whose gangs it may
    release (default: this one's)."""

    def __init__(self, backend: Any, *, instance: str | None = None) -> None:
        self.backend = backend
        self.place = backend.cluster_name
        self.instance = instance

    def find(self, now: datetime) -> list[Leftover]:
        mine = self.instance or instance_identity()
        return [self._leftover(remnant, mine) for remnant in self.backend.remnants()]

    def _leftover(self, remnant: GangRemnant, mine: str) -> Leftover:
        owner = owner_from_record(remnant.owner)
        skip = not_ours(remnant.instance, mine, fix=remnant.handover.replace("{instance}", mine))
        return Leftover(self.place, remnant.kind, remnant.name, owner=owner, gpus=remnant.gpus, since=remnant.since,
                        reason="" if owner else remnant.reason, detail=remnant.detail,
                        skip=skip)

    def release(self, leftover: Leftover) -> None:
        self.backend.clear(GangRemnant(leftover.kind, leftover.name, detail=leftover.detail), STOP_REASON)
