"""Leftovers of a local cluster: gangs (worker processes), slot holdings and queue tickets, found from the local
backend's own state files under the settings' state_dir only (``jobs/<gang>/running.json`` and
``owner.json``, ``slots/<cluster>.json``), never from the machine's other processes.

Finding reads those files and writes nothing (not even the pool's reclaiming of dead holders).
A gang is released with the backend's :meth:`~hybridflow.backends.local.LocalGangBackend.stop`
(SIGTERM: its workers checkpoint; a launcher still alive then fails with GangStopped and does not
relaunch it), a holding by giving its slots back to the pool, a ticket (a gang waiting for admission:
it holds no GPUs, but every gang queued behind it waits for it) by withdrawing it from the queue.
"""

from __future__ import annotations

from datetime import UTC, datetime

from hybridflow.backends.base import INSTANCE_KEY, instance_identity
from hybridflow.backends.local import LocalGangBackend, _read_json, entry_alive
from hybridflow.reaper.base import Finder, Leftover
from hybridflow.reaper.owners import not_ours, owner_from_record

STOP_REASON = "released by the resource reaper: the Airflow task it ran for has ended"


class LocalGangFinder(Finder):
    """Gangs with live workers, and slot holdings and queue tickets of live holders, on one local
    cluster. One whose owner.json names another Airflow instance than ``instance`` (default: this
    one's, :func:`~hybridflow.backends.base.instance_identity`), or none, is found with ``skip`` set."""

    def __init__(self, backend: LocalGangBackend, *, instance: str | None = None) -> None:
        self.backend = backend
        self.place = backend.cluster
        self.instance = instance

    def find(self, now: datetime) -> list[Leftover]:
        self._mine = self.instance or instance_identity()
        gangs = self._gangs()
        state, running = _read_json(self.backend.pool.path) or {}, {lo.name for lo in gangs}
        return gangs + self._holdings(state, running) + self._tickets(state, running)

    def _gangs(self) -> list[Leftover]:
        out = []
        for path in sorted((self.backend.state_dir / "jobs").glob("*/running.json")):
            record = _read_json(path)
            if not record or record.get("cluster", self.place) != self.place:
                continue
            workers = self.backend._live_workers(record)
            if not workers:
                continue
            name = path.parent.name
            out.append(Leftover(self.place, "local-gang", name, gpus=len(workers), **self._whose(name),
                                since=_mtime(path), detail={"attempt": record.get("attempt")}))
        return out

    def _holdings(self, state: dict, running: set[str]) -> list[Leftover]:
        out = []
        for name, held in sorted((state.get("holdings") or {}).items()):
            if name in running:
                continue  # held by a gang listed above
            if not entry_alive(held):
                continue  # a dead holder: the pool reclaims it on its next use
            since = datetime.fromtimestamp(float(held["since"]), UTC) if held.get("since") else None
            out.append(Leftover(self.place, "slot-holding", name, **self._whose(name),
                                gpus=int(held.get("slots", 0)), since=since, detail={"pid": held.get("pid")}))
        return out

    def _tickets(self, state: dict, running: set[str]) -> list[Leftover]:
        out = []
        for name, ticket in sorted((state.get("waiting") or {}).items()):
            if name in running or name in (state.get("holdings") or {}):
                continue
            if not entry_alive(ticket):
                continue  # a dead waiter, or a deferred task's ticket that lapsed: the pool drops it
            since = datetime.fromtimestamp(float(ticket["since"]), UTC) if ticket.get("since") else None
            out.append(Leftover(self.place, "queue-ticket", name, **self._whose(name), since=since,
                                detail={"slots": ticket.get("slots"), "pid": ticket.get("pid")}))
        return out

    def _whose(self, name: str) -> dict:
        """The gang's owner, and why this instance leaves it alone ('' when it is this instance's, or
        names no owner at all: kept as unjudged)."""
        path = self.backend.owner_path(name)
        record = _read_json(path)
        owner = owner_from_record(record)
        if owner is None:
            return {"owner": None}
        fix = f'add "{INSTANCE_KEY}": "{self._mine}" to {path} for this instance\'s reaper to judge it'
        return {"owner": owner, "skip": not_ours(record.get(INSTANCE_KEY), self._mine, fix=fix)}

    def release(self, leftover: Leftover) -> None:
        if leftover.kind == "local-gang":
            self.backend.stop(leftover.name, STOP_REASON)
        elif leftover.kind == "slot-holding":
            self.backend.pool.release(leftover.name)
        elif leftover.kind == "queue-ticket":
            self.backend.pool.withdraw(leftover.name)
        else:
            raise ValueError(f"{leftover.kind} is not a local cluster's leftover")


def _mtime(path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except OSError:
        return None
