"""
### GPU cost allocation, nightly

For the day before (the run's data interval; backfill with `airflow backfill create --dag-id
gpu_cost_nightly --from-date ... --to-date ...`, or trigger with the `day` Param) this allocates every
training attempt's GPU-hours and cost to its project, team, cluster, GPU model and pricing class, with
utilisation-weighted effective GPU-hours, waste flags, GPU-hours lost to preemption and the idle cost of
owned capacity billed to the teams whose guaranteed share it was. Inference is costed too: the serving
meter's samples (model server slots, serving replicas x GPUs) become inference cost per project and
model version.

First, run records in private storage that the ledger does not hold yet (written before it, or while
it was unreachable) are ingested (`hybridflow ledger sync` does the same by hand).

Last, each project's bytes held in the cloud caches and DR stores and moved this month are counted
against its `storage_gib` and `transfer_gib_per_month` quotas (projects.yaml) and priced (the
`quota_usage` table; notifications at 80 % and 100 %; docs/costs.md).

Output: the `allocation`, `idle_allocation` and `inference_allocation` tables of the ledger, CSV/Parquet
files (`inference.csv/.parquet` among them) and an HTML report
under `private/reports/allocation/<day>/` (*Browse → GPU costs & budgets*). Each run emits the
`hybridflow://ledger/allocations` asset with extra `{"day": ...}`, which triggers `gpu_budgets`.

Safe to clear and re-run: a day's rows are replaced in one transaction, with identical results.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from airflow.sdk import Asset, Param, dag, get_current_context, task

from hybridflow.budgets import ALLOCATIONS_ASSET

log = logging.getLogger(__name__)
default_args = {"owner": "ml-platform", "retries": 2, "retry_delay": timedelta(minutes=5)}
# Named as budgets schedule on it; an "x-" URI scheme is left alone, so no provider URI handler (boto3
# among them) is loaded at parse time.
allocations = Asset(name=ALLOCATIONS_ASSET, uri="x-" + ALLOCATIONS_ASSET)


@dag(
    dag_id="gpu_cost_nightly",
    schedule="@daily",
    start_date=datetime(2026, 1, 1),
    catchup=False,  # backfills run on request (airflow backfill create)
    max_active_runs=1,
    default_args=default_args,
    tags=["cost", "ledger"],
    doc_md=__doc__,
    params={
        # null too: the trigger form counts "" in a non-nullable Param as missing and will not submit.
        "day": Param("", type=["null", "string"], pattern="^(|[0-9]{4}-[0-9]{2}-[0-9]{2})$", title="Day (YYYY-MM-DD)",
                     description="Allocate this UTC day; empty: the run's data interval (the day before the run)."),
    },
)
def gpu_cost_nightly():
    @task
    def sync_records() -> dict:
        """Run records the ledger missed (written before it, or while it was unreachable) go in first."""
        from hybridflow.ledger.sync import sync_run_records
        from hybridflow.settings import get_settings

        result = sync_run_records(get_settings().private_root)
        if result.errors:  # the good ones are in; the bad ones are named in the log and the XCom
            log.warning("run records not ingested: %s", result.errors)
        return result.to_json()

    @task(outlets=[allocations])
    def allocate(params=None) -> dict:
        from hybridflow.ledger.nightly import allocate_for_run

        context = get_current_context()
        summary = allocate_for_run((params or {}).get("day"), context.get("data_interval_start"),
                                   context.get("logical_date"), context["dag_run"].run_after)
        context["outlet_events"][allocations].extra = {"day": summary["day"]}
        return summary

    @task
    def count_quota_usage(params=None) -> dict:
        """Each project's bytes held and moved against its storage and transfer quotas, priced."""
        from hybridflow.budgets.quota_nightly import quota_usage_for_run

        context = get_current_context()
        return quota_usage_for_run((params or {}).get("day"), context.get("data_interval_start"),
                                   context.get("logical_date"), context["dag_run"].run_after)

    sync_records() >> allocate() >> count_quota_usage()


gpu_cost_nightly()
