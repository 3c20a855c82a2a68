"""
### DR replication: keep the disaster-recovery cluster ready to take over

Every hour, into the object store of each `role: dr` cluster of `config/clusters.yaml` (its
`cache` bucket), copies what a takeover needs: the newest validated versions of the datasets the
served models use, the model versions each endpoint serves and served before, and the newest
committed checkpoint of each running critical run. Every object is checked against its source's
manifest before it is copied (a missing or changed source object is reported and never copied),
read back after it, and the set's manifest is written last. Add-only: nothing on the DR side is
overwritten or deleted, so every version once replicated stays. It also checks that the DR
cluster's Connections exist and, on Kubernetes, that it names a training image.

Anything missing or bad fails the task naming each item and its fix, after everything else was
copied. With no DR cluster configured it logs that and succeeds. Safe to clear and re-run: a set
already replicated costs one existence check. Details: docs/disaster-recovery.md.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import dag, task

default_args = {"owner": "ml-platform", "retries": 1, "retry_delay": timedelta(minutes=5)}


@dag(
    dag_id="dr_replication",
    schedule="@hourly",
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["dr"],
    doc_md=__doc__,
)
def dr_replication():
    @task(execution_timeout=timedelta(minutes=50))
    def replicate() -> dict:
        from hybridflow.dr.replication.task import replication_task

        return replication_task()

    replicate()


RECONCILIATION_DOC = """
### DR reconciliation: every replicated object against its manifest

Every day, reads back every object the manifests in each DR cluster's store name and compares its
size and SHA-256 with the manifest. A missing or corrupted object is drift: it is copied again from
a source that still holds the recorded bytes (checked first), never repaired by deleting anything.
Drift with no healthy source fails the task, naming each object. Safe to clear and re-run.
"""


@dag(
    dag_id="dr_reconciliation",
    schedule="@daily",
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["dr"],
    doc_md=RECONCILIATION_DOC,
)
def dr_reconciliation():
    @task(execution_timeout=timedelta(hours=6))
    def reconcile() -> dict:
        from hybridflow.dr.replication.task import reconciliation_task

        return reconciliation_task()

    reconcile()


dr_replication()
dr_reconciliation()
