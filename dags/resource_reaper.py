"""
### Resource reaper: release what the product made and no run uses any more

Every hour (`reaper.schedule` in `config/pipeline.yaml`) each cluster and store is swept for what
the product created there, found by its own labels and state files only:

* Kubernetes gang jobs with their pods, gang pods whose job is gone, and gang credentials Secrets;
* local gangs (worker processes) and slot holdings;
* unfinished multipart uploads older than `reaper.multipart_max_age_h`, scratch folders of finished runs.

A thing is released only when the Airflow task it was made for has ended (its DAG run is gone,
succeeded or failed, or the task itself finished); a run that is queued, running, deferred or up for
retry is never touched, and a state that cannot be read keeps the thing. **Dry-run** by default
(`reaper.dry_run`, per cluster under `reaper.clusters`): it only lists what it would release.

Each release (or listing) is recorded in the ledger with the GPU-hours it stopped; the last sweep is
on *Browse → Resource reaper*. Safe to clear and re-run: releasing is idempotent and a sweep of the
same interval replaces its record. A place that cannot be swept fails the record step, naming it.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import CronDataIntervalTimetable, dag, get_current_context, task

from hybridflow.config import load_estate
from hybridflow.settings import get_settings

default_args = {"owner": "ml-platform", "retries": 1, "retry_delay": timedelta(minutes=5)}


@dag(
    dag_id="resource_reaper",
    schedule=CronDataIntervalTimetable(load_estate(get_settings().config_dir).pipeline.reaper.schedule,
                                       timezone="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["cost", "reaper"],
    doc_md=__doc__,
)
def resource_reaper():
    @task(execution_timeout=timedelta(minutes=30))
    def sweep() -> dict:
        from hybridflow.reaper.task import run_sweep

        return run_sweep(get_current_context())

    @task(retries=2)
    def record(body: dict) -> dict:
        from hybridflow.reaper.task import record

        return record(body)

    record(sweep())


resource_reaper()
