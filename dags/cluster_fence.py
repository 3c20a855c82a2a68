"""
### Declare a cluster down or up

The trigger form's way to do what `hybridflow cluster down <cluster> --reason ...` and
`hybridflow cluster up <cluster>` do. **down** fences the cluster: placement gives it no new runs
from that moment, its running gangs commit a final checkpoint and stop, and while a primary is down
the estate is in takeover (critical runs may use the disaster-recovery pool, normal runs wait,
batch runs are paused). **up** lifts the fence (failback); serving moves back only through a deploy.

Its `access_control` grants the trigger to the **DR operator** role (docs/dr-fencing.md, "Who may
declare a cluster down"). Who triggered the run is kept as who declared it. An unknown cluster, the disaster-recovery pool itself, an estate without one, an
empty reason or one over 500 characters fails the task, naming the Param, and changes nothing.
Declaring twice changes nothing the second time. Details: docs/dr-fencing.md.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, dag, get_current_context, task

from hybridflow.dr.fencing.task import DR_ACCESS_CONTROL, FENCE_PARAMS

default_args = {"owner": "ml-platform", "retries": 0, "retry_delay": timedelta(seconds=10)}


@dag(
    dag_id="cluster_fence",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["dr"],
    doc_md=__doc__,
    access_control=DR_ACCESS_CONTROL,
    params={name: Param(**spec) for name, spec in FENCE_PARAMS.items()},
)
def cluster_fence():
    @task(execution_timeout=timedelta(minutes=15))
    def fence(params=None) -> dict:
        from hybridflow.dr.fencing.task import fence_task

        run = get_current_context()["dag_run"]
        return fence_task(params, by=getattr(run, "triggering_user_name", None))

    fence()


cluster_fence()
