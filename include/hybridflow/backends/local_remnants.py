"""What a local cluster holds of the product's gangs, from the local backend's own state files under
its state_dir only (``jobs/<gang>/running.json`` and ``owner.json``, ``slots/<cluster>.json``), never
from the machine's other processes: gangs with live workers, and slot holdings and queue tickets of
live holders (:meth:`LocalGangBackend.remnants`), and their release.

Reading writes nothing (not even the pool's reclaiming of dead holders). A gang is released with the
backend's :meth:`~hybridflow.backends.local.LocalGangBackend.stop` (SIGTERM: its workers checkpoint;
a launcher still alive then fails with GangStopped and does not relaunch it), a holding by giving
its slots back to the pool, a ticket (a gang waiting for admission: it holds no GPUs, but every gang
queued behind it waits for it) by withdrawing it from the queue.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.backends.base import INSTANCE_KEY, OWNER_KEYS, GangRemnant, instance_identity
from hybridflow.backends.local_slots import _read_json, entry_alive

if TYPE_CHECKING:
    from hybridflow.backends.local import LocalGangBackend


def remnants(backend: LocalGangBackend) -> list[GangRemnant]:
    gangs = _gangs(backend)
    state, running = _read_json(backend.pool.path) or {}, {r.name for r in gangs}
    return gangs + _holdings(backend, state, running) + _tickets(backend, state, running)


def clear(backend: LocalGangBackend, remnant: GangRemnant, reason: str) -> None:
    if remnant.kind == "local-gang":
        backend.stop(remnant.name, reason)
    elif remnant.kind == "slot-holding":
        backend.pool.release(remnant.name)
    elif remnant.kind == "queue-ticket":
        backend.pool.withdraw(remnant.name)
    else:
        raise ValueError(f"{remnant.kind} is not a local cluster's remnant")


def _gangs(backend: LocalGangBackend) -> list[GangRemnant]:
    out = []
    for path in sorted((backend.state_dir / "jobs").glob("*/running.json")):
        record = _read_json(path)
        if not record or record.get("cluster", backend.cluster) != backend.cluster:
            continue
        workers = backend._live_workers(record)
        if not workers:
            continue
        name = path.parent.name
        out.append(_remnant(backend, "local-gang", name, gpus=len(workers), since=_mtime(path),
                            detail={"attempt": record.get("attempt")}))
    return out


def _holdings(backend: LocalGangBackend, state: dict, running: set[str]) -> list[GangRemnant]:
    out = []
    for name, held in sorted((state.get("holdings") or {}).items()):
        if name in running:
            continue  # held by a gang listed above
        if not entry_alive(held):
            continue  # a dead holder: the pool reclaims it on its next use
        out.append(_remnant(backend, "slot-holding", name, gpus=int(held.get("slots", 0)), since=_since(held),
                            detail={"pid": held.get("pid")}))
    return out


def _tickets(backend: LocalGangBackend, state: dict, running: set[str]) -> list[GangRemnant]:
    out = []
    for name, ticket in sorted((state.get("waiting") or {}).items()):
        if name in running or name in (state.get("holdings") or {}):
            continue
        if not entry_alive(ticket):
            continue  # a dead waiter, or a deferred task's ticket that lapsed: the pool drops it
        out.append(_remnant(backend, "queue-ticket", name, since=_since(ticket),
                            detail={"slots": ticket.get("slots"), "pid": ticket.get("pid")}))
    return out


def _remnant(backend: LocalGangBackend, kind: str, name: str, **kw) -> GangRemnant:
    """With the owner and instance of the gang's owner.json. One without an owner there names this
    instance: the state_dir is this deployment's own, and the reaper keeps it as unjudged."""
    path = backend.owner_path(name)
    record = _read_json(path) or {}
    owner = {k: str(record[k]) for k in OWNER_KEYS if record.get(k) is not None}
    instance = record.get(INSTANCE_KEY) if owner else instance_identity()
    handover = f'add "{INSTANCE_KEY}": "{{instance}}" to {path} for this instance\'s reaper to judge it'
    return GangRemnant(kind, name, owner=owner, instance=instance, handover=handover, **kw)


def _since(entry: dict) -> datetime | None:
    return datetime.fromtimestamp(float(entry["since"]), UTC) if entry.get("since") else None


def _mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except OSError:
        return None
