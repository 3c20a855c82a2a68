"""Drills in the ledger: each drill's figures, targets and verdict as a row of ``dr_drill``
(migration 0006), its whole report beside them, and the history the DR drills page reads.

Recording a drill again (its judge step cleared and run again) replaces its row in one
transaction. Times are stored as naive UTC, like the ledger's other tables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from hybridflow.dr.drills.report import Targets
from hybridflow.ledger.models import DrillRow

_DRILLS = DrillRow.__table__


def _naive(iso: str | None) -> datetime | None:
    if not iso:
        return None
    ts = datetime.fromisoformat(iso)
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo else ts


def drill_row(report: Mapping[str, Any]) -> dict[str, Any]:
    figures = report.get("figures") or {}
    targets = {**Targets().to_dict(), **(report.get("targets") or {})}
    return {
        "drill": str(report["drill"]), "declared_at": _naive(report.get("declared_at")),
        "primary_cluster": report.get("primary"), "dr_cluster": report.get("dr_cluster"),
        "run_key": report.get("run_key"), "endpoint": (report.get("inference") or {}).get("endpoint"),
        "inference_rto_s": figures.get("inference_rto_s"), "training_rto_s": figures.get("training_rto_s"),
        "rpo_steps_lost": figures.get("rpo_steps_lost"), "rpo_dataset_age_s": figures.get("rpo_dataset_age_s"),
        "target_inference_rto_s": float(targets["inference_rto_s"]),
        "target_training_rto_s": float(targets["training_rto_s"]),
        "target_rpo_steps": targets.get("rpo_steps") or report.get("checkpoint_interval_steps"),
        "target_dataset_age_s": targets.get("dataset_age_s"), "verdict": str(report.get("verdict") or "missed"),
        "missed": json.dumps(report.get("missed") or []), "report": json.dumps(report, sort_keys=True),
        "recorded_at": datetime.now(UTC).replace(tzinfo=None),
    }


def record_drill(report: Mapping[str, Any], *, engine: Engine | None = None) -> None:
    """Store the judged drill, replacing an earlier recording of the same drill."""
    from hybridflow.ledger.engine import default_engine

    row = drill_row(report)
    engine = engine or default_engine()
    with engine.begin() as conn:
        conn.execute(delete(_DRILLS).where(_DRILLS.c.drill == row["drill"]))
        conn.execute(insert(_DRILLS).values(row))


def drill_history(engine: Engine | None = None, limit: int = 200) -> list[dict[str, Any]]:
    """Every recorded drill's report, newest declaration first."""
    from hybridflow.ledger.engine import default_engine

    engine = engine or default_engine()
    with engine.connect() as conn:
        rows = conn.execute(select(_DRILLS.c.report).order_by(_DRILLS.c.declared_at.desc()).limit(limit)).scalars()
        return [json.loads(r) for r in rows]
