"""The Kubernetes client of a cluster: the cncf.kubernetes provider's ``KubernetesHook`` for the
cluster's Connection (``clusters.<name>.conn_id``: a kubeconfig, in-cluster, or a token), which the
gang backend, its trigger, the serving targets, the reaper, metering and DR all call through."""

from __future__ import annotations

from typing import Any


def kubernetes_hook(conn_id: str) -> Any:
    """The provider's hook for a cluster's Connection (imported late: DAG files stay light)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(conn_id=conn_id)
