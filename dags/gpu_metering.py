"""
### GPU metering: GPU samples into the ledger, Xid/ECC findings to node health

Every few minutes (`metering.schedule` in `config/pipeline.yaml`) each cluster's GPUs are read from
the source configured for it under `metering.clusters`:

* **local** (the default for local clusters): the local backend's slots, published in
  dcgm-exporter's format by the local stand-in exporter (worker CPU/RSS as utilisation/memory);
* **exporters**: each node's dcgm-exporter `/metrics`;
* **prometheus**: range queries to a Prometheus that already scrapes dcgm-exporter.

URLs and credentials of exporters and Prometheus come from Airflow Connections (`conn_id`).
Samples are stored in the ledger keyed by cluster, node, GPU, MIG instance and time, and tied to
runs through their gang pods; per-node Xid codes, ECC errors and unanswered probes go to node
health. Each run covers its data interval and stamps direct readings with the interval's end, so a
cleared task stores the same samples again, not twice.

The same schedule samples what serves (`meter_serving`): every model version's server slots on this
machine, or the inference pool's replicas x GPUs on Kubernetes, per window, for the nightly inference
cost (a window metered again replaces its samples).
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import CronDataIntervalTimetable, dag, get_current_context, task

from hybridflow.config import load_estate
from hybridflow.settings import get_settings

default_args = {"owner": "ml-platform", "retries": 2, "retry_delay": timedelta(minutes=1)}


@dag(
    dag_id="gpu_metering",
    schedule=CronDataIntervalTimetable(load_estate(get_settings().config_dir).pipeline.metering.schedule,
                                       timezone="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args,
    tags=["cost", "metering"],
    doc_md=__doc__,
)
def gpu_metering():
    @task
    def clusters() -> list[str]:
        return sorted(load_estate(get_settings().config_dir).clusters)

    @task(execution_timeout=timedelta(minutes=4))
    def meter(cluster: str) -> dict:
        from datetime import UTC, datetime

        from hybridflow.metering.task import meter_cluster

        context = get_current_context()
        return meter_cluster(cluster, window_start=context["data_interval_start"],
                             window_end=context["data_interval_end"], now=datetime.now(UTC))

    @task(execution_timeout=timedelta(minutes=4))
    def meter_serving() -> dict:
        from datetime import UTC, datetime

        from hybridflow.metering.task import meter_serving_window

        context = get_current_context()
        return meter_serving_window(window_start=context["data_interval_start"],
                                    window_end=context["data_interval_end"], now=datetime.now(UTC))

    meter.expand(cluster=clusters())
    meter_serving()


gpu_metering()
