"""The resource_reaper DAG's two task units: sweep every place of the estate (judging owners by
Airflow's own states, through the task's Task SDK), then record the sweep in the ledger."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)


def sweep_key(context: Any) -> str:
    """The sweep's ledger key: the DAG run's data interval, else its run id (a manual run without one)."""
    start, end = context.get("data_interval_start"), context.get("data_interval_end")
    if start is not None and end is not None:
        return f"{start.astimezone(UTC).isoformat()}/{end.astimezone(UTC).isoformat()}"
    return str(context["run_id"])


def run_sweep(context: Any) -> dict:
    """Sweep the estate with the pipeline's ``reaper`` settings; the sweep as a dict for XCom."""
    from hybridflow.config import load_estate
    from hybridflow.reaper.finders import finders_for
    from hybridflow.reaper.serial import sweep_to_dict
    from hybridflow.reaper.states import AirflowStates
    from hybridflow.reaper.sweep import sweep
    from hybridflow.settings import get_settings

    settings = get_settings()
    estate = load_estate(settings.config_dir)
    config = estate.pipeline.reaper
    states = AirflowStates(context["ti"])
    done = sweep(finders_for(estate, settings, config, states), states, dry_run=config.dry_run_for,
                 now=datetime.now(UTC), clock=lambda: datetime.now(UTC), key=sweep_key(context))
    return sweep_to_dict(done)


def record(body: dict) -> dict:
    """Store the sweep in the ledger (a re-run of the same key replaces it); then fail, naming them,
    if some places could not be swept."""
    from hybridflow.reaper.records import record_sweep
    from hybridflow.reaper.serial import sweep_from_dict

    done = sweep_from_dict(body)
    record_sweep(done, key=done.key)
    counts = {"key": done.key, "released": sum(r.released for r in done.releases),
              "listed": sum(r.dry_run and not r.error for r in done.releases), "failed": sum(bool(r.error) for r in done.releases),
              "kept": done.kept, "gpu_hours_stopped": round(sum(r.gpu_hours for r in done.releases if r.released), 4),
              "other_instances": len(done.skipped)}
    log.info("recorded sweep %s", counts)
    if done.errors:  # not retried: the same sweep would be recorded again with the same errors
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException("could not sweep " + "; ".join(f"{place}: {why}" for place, why in
                                                             sorted(done.errors.items()))
                             + ". Fix the place (its Connection, its state folder) and clear the sweep task")
    return counts
