"""
### GPU budgets: act on each project's monthly spend

Runs after every nightly cost allocation (the `hybridflow://ledger/allocations` asset) and compares
each project's allocated spend for the month with `config/budgets.yaml`:

* at each `notify_at` share (80 % by default) the webhook Connection `hybridflow_budget_webhook`
  gets one notification per project and month, however often this runs;
* at 100 % the project is **frozen**: `admit` refuses its normal and batch runs (critical runs need the
  `budget_override` Param, kept in the run record) and its running interruptible gangs checkpoint and stop;
* a raised budget or a new month lifts the freeze.

Safe to clear and re-run: the state is upserted in the ledger and notifications are claimed once.
State and the latest allocation report: *Browse → GPU costs & budgets* in the UI.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Asset, Param, dag, get_current_context, task

from hybridflow.budgets import ALLOCATIONS_ASSET

default_args = {"owner": "ml-platform", "retries": 2, "retry_delay": timedelta(minutes=2)}


@dag(
    dag_id="gpu_budgets",
    # By name: a URI-built Asset loads every provider's URI handlers (boto3 among them) at parse time.
    schedule=[Asset.ref(name=ALLOCATIONS_ASSET)],
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["cost", "budgets"],
    doc_md=__doc__,
    params={
        "period": Param(
            "",
            type=["null", "string"],  # the trigger form counts "" in a non-nullable Param as missing
            pattern="^(|[0-9]{4}-(0[1-9]|1[0-2]))$",
            title="Month (YYYY-MM)",
            description="Evaluate this month; empty: the month of the day the nightly allocation just processed "
            "(or the current month for a manual run).",
        )
    },
)
def gpu_budgets():
    @task
    def evaluate_budgets(params=None) -> dict:
        from hybridflow.budgets import nightly

        context = get_current_context()
        period = (params or {}).get("period") or nightly.period_to_evaluate(
            context.get("triggering_asset_events"), context["dag_run"].run_after
        )
        return nightly.evaluate_budgets(period)

    evaluate_budgets()


gpu_budgets()
