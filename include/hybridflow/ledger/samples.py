"""GPU samples into the ledger: an upsert on the sample's key, so a cleared metering task stores nothing twice."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC
from typing import TYPE_CHECKING

from sqlalchemy import Engine, func

from hybridflow.ledger.models import GpuSampleRow

if TYPE_CHECKING:
    from hybridflow.metering.records import GpuSample

_KEY = ["cluster", "node", "gpu_uuid", "mig_key", "ts"]
_BATCH = 1000  # rows per statement: 22 parameters each, under SQLite's 32,766


def sample_row(sample: GpuSample, run_key: str | None) -> dict:
    row = sample.to_json()
    row["ts"] = sample.ts.astimezone(UTC).replace(tzinfo=None)
    row["mig_key"] = sample.mig_instance or ""
    row["run_key"] = run_key
    return row


def _insert(engine: Engine):
    name = engine.dialect.name
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise ValueError(f"ledger database {name!r} is not supported; use SQLite or PostgreSQL in HYBRIDFLOW_LEDGER_URL")
    return insert


def store_samples(samples: Iterable[GpuSample], owners: Mapping[tuple, str], *, engine: Engine | None = None) -> int:
    """Upsert ``samples`` (owners maps GpuSample.key() to run_key); returns the rows stored.

    A sample stored again replaces the earlier row with the same key; its run attribution is kept
    unless the new reading names a run.
    """
    from hybridflow.ledger.engine import default_engine

    engine = engine or default_engine()
    # The last reading of a key wins, also within one batch (PostgreSQL refuses duplicate keys in one upsert).
    rows = {s.key(): sample_row(s, owners.get(s.key())) for s in samples}
    if not rows:
        return 0
    insert = _insert(engine)
    values = list(rows.values())
    update_cols = [c.name for c in GpuSampleRow.__table__.columns if c.name not in (*_KEY, "id")]
    with engine.begin() as conn:
        for i in range(0, len(values), _BATCH):
            stmt = insert(GpuSampleRow.__table__).values(values[i : i + _BATCH])
            set_ = {c: stmt.excluded[c] for c in update_cols}
            # A re-read without attribution keeps the run the sample was attributed to before.
            set_["run_key"] = func.coalesce(stmt.excluded.run_key, GpuSampleRow.__table__.c.run_key)
            stmt = stmt.on_conflict_do_update(index_elements=_KEY, set_=set_)
            conn.execute(stmt)
    return len(values)
