"""Run records written to private storage, brought into the ledger again: records from before the
ledger existed, or whose record step could not reach it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine, select

from hybridflow.ledger.models import Run
from hybridflow.ledger.runs import RunRecordError, _when, ingest_run_record


@dataclass
class SyncResult:
    ingested: list[str] = field(default_factory=list)
    # The ledger holds a later note of the run (its train task re-ran after this record): kept.
    kept_newer: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # record file -> why it was not taken

    def to_json(self) -> dict:
        return {"ingested": len(self.ingested), "kept_newer": self.kept_newer, "errors": self.errors}


def sync_run_records(private_root: Path, *, engine: Engine | None = None, project: str | None = None) -> SyncResult:
    """Ingest every run record under ``private_root``/records (or one project's).

    Safe to repeat: a record already in the ledger is stored again unchanged. A bad record is
    reported with its file and skipped; the others are still ingested.
    """
    from hybridflow.ledger.engine import default_engine

    engine = engine or default_engine()
    base = Path(private_root) / "records"
    result = SyncResult()
    for path in sorted(base.glob(f"{project}/*.json" if project else "*/*.json")):
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict):
                raise RunRecordError("not a JSON object")
            if _ledger_is_newer(engine, record):
                result.kept_newer.append(record["run_key"])
                continue
            ingest_run_record(record, engine=engine)
            result.ingested.append(record["run_key"])
        except (OSError, ValueError, RunRecordError) as exc:  # JSONDecodeError is a ValueError
            result.errors[str(path)] = f"{exc}; fix or remove the file, then sync again"
    return result


def _ledger_is_newer(engine: Engine, record: dict) -> bool:
    key = record.get("run_key")
    recorded = _when(record.get("recorded_at"), f"run record {key}: recorded_at")
    if not key or recorded is None:
        return False
    with engine.connect() as conn:
        held = conn.execute(select(Run.recorded_at).where(Run.run_key == key)).scalar_one_or_none()
    return held is not None and held > recorded
