"""Bytes each project moves, one ledger row per transfer and UTC day: datasets staged into a cloud
cache, sets replicated into a DR store, versions served out. A transfer is named by its ``key``
(derived from what moved, never from the try that moved it), and a key already recorded is kept as
it is, so a re-run task never counts the same bytes twice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime

from sqlalchemy import Engine, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hybridflow.ledger.models import TransferRow

KINDS = ("staging", "replication", "serving")


@dataclass(frozen=True)
class Transfer:
    key: str
    day: date
    project: str
    kind: str
    cluster: str
    bytes: int
    run_key: str | None = None
    dataset: str | None = None
    version: str | None = None


def record_transfer(engine: Engine, transfer: Transfer, *, at: datetime | None = None) -> bool:
    """Record ``transfer`` unless its key is recorded already; True when this call recorded it."""
    if transfer.kind not in KINDS:
        raise ValueError(f"transfer kind {transfer.kind!r}; use one of {', '.join(KINDS)}")
    if transfer.bytes < 0:
        raise ValueError(f"transfer {transfer.key}: {transfer.bytes} bytes; a count of bytes is >= 0")
    at = (at or datetime.now(UTC)).astimezone(UTC).replace(tzinfo=None)
    row = TransferRow(key=transfer.key, day=transfer.day.isoformat(), project=transfer.project, kind=transfer.kind,
                      cluster=transfer.cluster, bytes=int(transfer.bytes), run_key=transfer.run_key,
                      dataset=transfer.dataset, version=transfer.version, recorded_at=at)
    try:
        with Session(engine) as session, session.begin():
            if session.get(TransferRow, transfer.key) is not None:
                return False
            session.add(row)
    except IntegrityError:  # recorded by a concurrent try between the look and the insert
        return False
    return True


def transferred_bytes(engine: Engine, *, since: date, until: date, project: str | None = None,
                      kinds: tuple[str, ...] = KINDS) -> dict[str, int]:
    """Bytes per project recorded on the days in [since, until]."""
    query = (select(TransferRow.project, func.coalesce(func.sum(TransferRow.bytes), 0))
             .where(TransferRow.day >= since.isoformat(), TransferRow.day <= until.isoformat(),
                    TransferRow.kind.in_(kinds))
             .group_by(TransferRow.project))
    if project is not None:
        query = query.where(TransferRow.project == project)
    with engine.connect() as conn:
        return {p: int(b) for p, b in conn.execute(query)}


def transfers_in(engine: Engine, since: date, until: date, kinds: tuple[str, ...] = KINDS) -> list[Transfer]:
    """Every transfer of ``kinds`` recorded on the days in [since, until]."""
    with Session(engine) as session:
        rows = session.scalars(
            select(TransferRow).where(TransferRow.day >= since.isoformat(), TransferRow.day <= until.isoformat(),
                                      TransferRow.kind.in_(kinds)).order_by(TransferRow.key)
        ).all()
        return [Transfer(key=r.key, day=date.fromisoformat(r.day), project=r.project, kind=r.kind,
                         cluster=r.cluster, bytes=int(r.bytes), run_key=r.run_key, dataset=r.dataset, version=r.version)
                for r in rows]
