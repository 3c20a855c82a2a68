"""Inference cost in the ledger: the serving meter's samples (hybridflow.metering.serving) stored per
window, and a day's inference cost lines per project and model version for the nightly allocation.

A version deployed by the pipeline is the run's ``run_key``: its project and team come from the ledger's
run row (else from the run record in private storage), its model from the sample (else that record). A
version of no known run is costed to project ``unattributed``, never dropped. A window that crosses
midnight is shared between the two days by its overlap with each, so the lines of a day add up to
exactly what was metered in it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, delete, insert, select

from hybridflow.ledger.models import Run, ServingSampleRow

if TYPE_CHECKING:
    from hybridflow.metering.serving import ServingSample

UNATTRIBUTED = "unattributed"
UNKNOWN_MODEL = "(unknown)"
LINE_KEYS = ("day", "project", "team", "model", "endpoint", "version", "cluster", "unit", "unit_hours",
             "usd_per_unit_hour", "cost_usd")


def _naive(ts: datetime) -> datetime:
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo else ts


def store_serving_samples(samples: Iterable[ServingSample], *, cluster: str, window_start: datetime,
                          window_end: datetime, engine: Engine | None = None) -> int:
    """Replace ``cluster``'s samples of the window starting at ``window_start`` with ``samples``; returns
    how many were stored. Metering a window again gives the same rows, never twice as many."""
    from hybridflow.ledger.engine import default_engine

    engine = engine or default_engine()
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for s in samples:
        if s.cluster != cluster or s.window_start != window_start or s.window_end != window_end:
            raise ValueError(f"sample of {s.endpoint}/{s.version} is for {s.cluster} {s.window_start}..{s.window_end}, "
                             f"not the window stored ({cluster} {window_start}..{window_end})")
        rows[(s.endpoint, s.version)] = s.to_row()
    with engine.begin() as conn:
        conn.execute(delete(ServingSampleRow).where(ServingSampleRow.cluster == cluster,
                                                    ServingSampleRow.window_start == _naive(window_start)))
        if rows:
            conn.execute(insert(ServingSampleRow), list(rows.values()))
    return len(rows)


def _day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, datetime.min.time())
    return start, start + timedelta(days=1)


def day_samples(engine: Engine, day: date) -> list[tuple[Any, float]]:
    """The samples whose window overlaps ``day``, each with the share of its window inside the day."""
    start, end = _day_bounds(day)
    with engine.connect() as conn:
        rows = conn.execute(select(ServingSampleRow).where(ServingSampleRow.window_start < end,
                                                           ServingSampleRow.window_end > start)
                            .order_by(ServingSampleRow.window_start, ServingSampleRow.id)).all()
    out = []
    for r in rows:
        length = (r.window_end - r.window_start).total_seconds()
        inside = (min(r.window_end, end) - max(r.window_start, start)).total_seconds()
        out.append((r, 1.0 if length <= 0 else inside / length))
    return out


def metered_cost(engine: Engine, day: date) -> float:
    """What the serving meter recorded for ``day`` in USD: unit-hours x price over its samples."""
    return sum(r.unit_hours * share * r.usd_per_unit_hour for r, share in day_samples(engine, day))


def _records(private_root: Path | None, versions: set[str]) -> dict[str, dict]:
    """Run records in private storage of these versions (run keys), for runs the ledger lacks."""
    found: dict[str, dict] = {}
    for version in sorted(versions) if private_root is not None else ():
        for path in sorted(Path(private_root).glob(f"records/*/{version}.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict):
                found[version] = record
                break
    return found


def version_owners(engine: Engine, private_root: Path | None, versions: set[str]) -> dict[str, dict[str, Any]]:
    """Project, team and model of each version a pipeline deployed (its run key); project
    ``unattributed`` for a version of no known run."""
    with engine.connect() as conn:
        runs = {r.run_key: r for r in conn.execute(
            select(Run.run_key, Run.project, Run.team).where(Run.run_key.in_(sorted(versions)))).all()}
    records = _records(private_root, versions - set(runs))
    owners = {}
    for version in versions:
        record = records.get(version, {})
        run = runs.get(version)
        owners[version] = {"project": (run.project if run else record.get("project")) or UNATTRIBUTED,
                           "team": (run.team if run else record.get("team")) or "",
                           "model": record.get("model")}
    if runs:  # the model is not in the run row: read the records of the runs the ledger knows too
        for version, record in _records(private_root, set(runs)).items():
            owners[version]["model"] = record.get("model")
    return owners


def inference_lines(engine: Engine, day: date, private_root: Path | None = None) -> list[dict[str, Any]]:
    """The day's inference cost per project, model and version (and endpoint, cluster, unit)."""
    lines: dict[tuple, dict[str, Any]] = {}
    models: dict[tuple, str | None] = {}
    samples = day_samples(engine, day)
    owners = version_owners(engine, private_root, {r.version for r, _ in samples})
    for r, share in samples:
        key = (r.version, r.endpoint, r.cluster, r.unit)
        line = lines.setdefault(key, {"unit_hours": 0.0, "cost_usd": 0.0})
        line["unit_hours"] += r.unit_hours * share
        line["cost_usd"] += r.unit_hours * share * r.usd_per_unit_hour
        models[key] = models.get(key) or r.model
    out = []
    for (version, endpoint, cluster, unit), line in sorted(lines.items()):
        owner = owners[version]
        hours, cost = line["unit_hours"], line["cost_usd"]
        out.append({"day": day.isoformat(), "project": owner["project"], "team": owner["team"],
                    "model": models[(version, endpoint, cluster, unit)] or owner["model"] or UNKNOWN_MODEL,
                    "endpoint": endpoint, "version": version, "cluster": cluster, "unit": unit,
                    "unit_hours": hours, "usd_per_unit_hour": cost / hours if hours else 0.0, "cost_usd": cost})
    return sorted(out, key=lambda x: (x["project"], x["model"], x["version"], x["endpoint"], x["cluster"]))
