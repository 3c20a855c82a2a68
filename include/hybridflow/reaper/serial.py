"""A :class:`Sweep` as a small JSON-able dict and back: what the sweep task hands the record task
through XCom (names, owners and numbers; never a finder's ``detail``, which may hold anything)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hybridflow.reaper.base import Leftover, Owner, Release, Sweep


def _time(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts else None


def _parse(ts: str | None) -> datetime | None:
    return datetime.fromisoformat(ts) if ts else None


def sweep_to_dict(sweep: Sweep) -> dict[str, Any]:
    return {
        "key": sweep.key, "started": _time(sweep.started), "finished": _time(sweep.finished),
        "kept": sweep.kept, "errors": dict(sweep.errors),
        "releases": [_release_to_dict(r) for r in sweep.releases],
        "skipped": [{"place": lo.place, "kind": lo.kind, "name": lo.name, "skip": lo.skip} for lo in sweep.skipped],
    }


def _release_to_dict(r: Release) -> dict[str, Any]:
    lo = r.leftover
    owner = None if lo.owner is None else {"dag_id": lo.owner.dag_id, "run_id": lo.owner.run_id,
                                           "task_id": lo.owner.task_id, "try_number": lo.owner.try_number}
    return {"place": lo.place, "kind": lo.kind, "name": lo.name, "owner": owner, "gpus": lo.gpus,
            "since": _time(lo.since), "reason": lo.reason, "dry_run": r.dry_run, "released": r.released,
            "gpu_hours": r.gpu_hours, "error": r.error}


def sweep_from_dict(body: dict[str, Any]) -> Sweep:
    releases = []
    for r in body.get("releases") or []:
        owner = Owner(**r["owner"]) if r.get("owner") else None
        leftover = Leftover(r["place"], r["kind"], r["name"], owner=owner, gpus=int(r.get("gpus") or 0),
                            since=_parse(r.get("since")), reason=r.get("reason") or "")
        releases.append(Release(leftover, dry_run=bool(r["dry_run"]), released=bool(r["released"]),
                                gpu_hours=float(r.get("gpu_hours") or 0.0), error=r.get("error") or ""))
    skipped = [Leftover(s["place"], s["kind"], s["name"], skip=s["skip"]) for s in body.get("skipped") or []]
    return Sweep(started=_parse(body["started"]), finished=_parse(body.get("finished")), releases=releases,
                 kept=int(body.get("kept") or 0), errors=dict(body.get("errors") or {}), key=body.get("key") or "",
                 skipped=skipped)
