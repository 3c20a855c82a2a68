"""Leftovers of a local cluster: gangs (worker processes) and slot holdings, found from the local
backend's own state files under the settings' state_dir only (``jobs/<gang>/running.json`` and
``owner.json``, ``slots/<cluster>.json``), never from the machine's other processes.

Finding reads those files and writes nothing (not even the pool's reclaiming of dead holders).
A gang is released with the backend's :meth:`~hybridflow.backends.local.LocalGangBackend.stop`
(SIGTERM: its workers checkpoint; a launcher still alive then fails with GangStopped and does not
relaunch it), a holding by giving its slots back to the pool.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from hybridflow.backends.local import LocalGangBackend, _read_json, pid_alive
from hybridflow.reaper.base import Finder, Leftover
from hybridflow.reaper.owners import owner_from_record

STOP_REASON = "released by the resource reaper: the Airflow task it ran for has ended"


class LocalGangFinder(Finder):
    """Gangs with live workers and slot holdings of live holders, on one local cluster."""

    def __init__(self, backend: LocalGangBackend) -> None:
        self.backend = backend
        self.place = backend.cluster

    def find(self, now: datetime) -> list[Leftover]:
        gangs = self._gangs()
        return gangs + self._holdings({lo.name for lo in gangs})

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
            out.append(Leftover(self.place, "local-gang", name, owner=self._owner(name), gpus=len(workers),
                                since=_mtime(path), detail={"attempt": record.get("attempt")}))
        return out

    def _holdings(self, running: set[str]) -> list[Leftover]:
        state = _read_json(self.backend.pool.path) or {}
        now = time.time()
        out = []
        for name, held in sorted((state.get("holdings") or {}).items()):
            if name in running or float(held.get("lease_until", now)) < now:
                continue  # held by a gang listed above, or a lapsed lease the pool drops by itself
            if not pid_alive(int(held.get("pid", 0)), held.get("pid_start")):
                continue  # a dead holder: the pool reclaims it on its next use
            since = datetime.fromtimestamp(float(held["since"]), UTC) if held.get("since") else None
            out.append(Leftover(self.place, "slot-holding", name, owner=self._owner(name),
                                gpus=int(held.get("slots", 0)), since=since, detail={"pid": held.get("pid")}))
        return out

    def _owner(self, name: str):
        return owner_from_record(_read_json(self.backend.owner_path(name)))

    def release(self, leftover: Leftover) -> None:
        if leftover.kind == "local-gang":
            self.backend.stop(leftover.name, STOP_REASON)
        elif leftover.kind == "slot-holding":
            self.backend.pool.release(leftover.name)
        else:
            raise ValueError(f"{leftover.kind} is not a local cluster's leftover")


def _mtime(path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except OSError:
        return None
