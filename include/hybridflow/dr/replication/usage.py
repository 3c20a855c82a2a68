"""The bytes a replication pass copied, in the ledger's ``transfer`` table for the projects' transfer
quotas: per set, its project from the run records (a dataset version: the projects whose runs
validated it, sharing its bytes evenly; a model version: the run that deployed it; a checkpoint: its
run), ``unattributed`` where none is found."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import date
from typing import Any

UNATTRIBUTED = "unattributed"


def projects_of(kind: str, name: str, version: str, records: Iterable[Mapping[str, Any]]) -> list[str]:
    found = set()
    for rec in records:
        if kind == "dataset" and rec.get("dataset") == name and rec.get("dataset_version") == version:
            found.add(rec.get("project"))
        elif (kind == "model" and rec.get("run_key") == version) or (kind == "checkpoint" and rec.get("run_key") == name):
            found.add(rec.get("project"))
    return sorted(p for p in found if p) or [UNATTRIBUTED]


def record_replicated(report, private_root, day: date, *, engine=None) -> int:
    """Record what ``report`` (a ReplicationReport) copied; returns the rows recorded. Keyed by the DR
    cluster, the set and how the pass ended, so a re-run pass (which copies nothing new) adds nothing,
    while a set finished after an incomplete pass counts the rest."""
    from hybridflow.ledger.engine import default_engine
    from hybridflow.ledger.transfers import Transfer, record_transfer
    from hybridflow.records import read_records

    copied = [s for s in report.sets if s.bytes_copied > 0]
    if not copied:
        return 0
    engine = engine or default_engine()
    records = read_records(private_root)
    recorded = 0
    for s in copied:
        projects = projects_of(s.kind, s.name, s.version, records)
        share, rest = divmod(s.bytes_copied, len(projects))
        for i, project in enumerate(projects):
            recorded += record_transfer(engine, Transfer(
                key=f"replication/{report.cluster}/{s.kind}/{s.name}/{s.version}/{s.status}/{project}", day=day,
                project=project, kind="replication", cluster=report.cluster, bytes=share + (rest if i == 0 else 0),
                run_key=s.version if s.kind == "model" else (s.name if s.kind == "checkpoint" else None),
                dataset=s.name if s.kind == "dataset" else None, version=s.version,
            ))
    return recorded
