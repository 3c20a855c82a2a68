"""
### DR drill: a minimum-scale takeover, measured, then failback

Quarterly (or from the trigger form), proves the disaster-recovery cluster can take over:

1. **declare_down** notes the primary's newest checkpoint, then declares the primary down (fenced:
   no new placements, its gangs checkpointed and stopped), with a reason naming the drill;
2. **take_over** on the DR cluster, from the DR store only: serves the critical endpoint from its
   replicated model until it answers a prediction, and resumes the critical run from its replicated
   checkpoint until it commits a step beyond it; then stops both;
3. **fail_back** (runs whatever happened before) stops anything of the drill still on the DR side
   and declares the primary up;
4. **judge** measures RTO (declared -> inference healthy, declared -> training stepping) and RPO
   (training steps lost, age of the newest replicated dataset version) and fails, naming each step
   that missed its target.

The report is kept in private storage (`drills/<run>.json`) and shown on the *DR drills* page.
A primary already down for a real outage is refused. Every step is safe to clear and re-run. Its
`access_control` grants the trigger to the **DR operator** role, as for `cluster_fence`.
Details: docs/disaster-recovery.md.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, dag, get_current_context, task

from hybridflow.dr.drills.task import DRILL_PARAMS
from hybridflow.dr.fencing.task import DR_ACCESS_CONTROL

default_args = {"owner": "ml-platform", "retries": 0, "retry_delay": timedelta(seconds=30)}


def _run() -> tuple[str, str | None]:
    run = get_current_context()["dag_run"]
    return run.run_id, getattr(run, "triggering_user_name", None)


@dag(
    dag_id="dr_drill",
    schedule="0 6 1 1,4,7,10 *",  # quarterly: 06:00 on the first day of each quarter
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["dr"],
    doc_md=__doc__,
    access_control=DR_ACCESS_CONTROL,
    params={name: Param(**spec) for name, spec in DRILL_PARAMS.items()},
)
def dr_drill():
    @task(execution_timeout=timedelta(minutes=15))
    def declare_down(params=None) -> dict:
        from hybridflow.dr.drills.task import declare_task

        run_id, by = _run()
        return {"drill": declare_task(params, run_id, by=by)["drill"]}

    @task(execution_timeout=timedelta(minutes=30))
    def take_over(params=None) -> dict:
        from hybridflow.dr.drills.task import take_over_task

        report = take_over_task(params, _run()[0])
        return {"drill": report["drill"], "status": report.get("status")}

    @task(execution_timeout=timedelta(minutes=15), trigger_rule="all_done")
    def fail_back(params=None) -> dict:
        from hybridflow.dr.drills.task import fail_back_task

        run_id, by = _run()
        return {"drill": fail_back_task(params, run_id, by=by)["drill"]}

    @task(execution_timeout=timedelta(minutes=5), trigger_rule="all_done")
    def judge(params=None) -> dict:
        from hybridflow.dr.drills.task import judge_task

        report = judge_task(params, _run()[0])
        return {"drill": report["drill"], "figures": report["figures"], "verdict": report["verdict"]}

    declare_down() >> take_over() >> fail_back() >> judge()


dr_drill()
