"""Turning a cluster of the shipped config into a valid kubernetes cluster, for tests."""

from __future__ import annotations


def as_kubernetes(cluster: dict, *, conn_id: str, scheduler: str, **extra) -> dict:
    """Update ``cluster`` (a clusters.yaml entry) in place with what backend kubernetes needs: an
    image, the cluster's bucket, and checkpoint places its pods can reach."""
    cluster.update({
        "backend": "kubernetes", "conn_id": conn_id, "scheduler": scheduler,
        "image": "registry.local/hybridflow-train:1",
        "cache": cluster.get("cache") or {"conn_id": f"{conn_id}_store", "bucket": "hf-cluster-store"},
        "checkpoint_store": "cache", "checkpoint_replica": "scratch", "scratch_dir": "/scratch",
        "scratch_claim": "scratch", **extra,
    })
    return cluster


def private_h100_cluster(scheduler: str):
    """``dc2-k8s``: a private kubernetes cluster (Connection ``k8s_dc2``) with one 8-GPU H100 pool."""
    from hybridflow.config import Cluster

    cluster = Cluster.model_validate({
        "location": "private", "region": "dc-2", "backend": "kubernetes", "conn_id": "k8s_dc2",
        "scheduler": scheduler,
        "node_pools": [{"name": "h100", "gpu_model": "H100-80GB", "gpu_memory_gib": 80, "gpus": 8,
                        "node_labels": {"hybridflow.io/pool": "h100"}}],
        "prices": {"onprem": 1.1},
    })
    cluster._name = "dc2-k8s"
    return cluster


def kubeconfig(server: str, token: str, *, context: str = "dc2") -> dict:
    """A kubeconfig (as the kube_config extra holds it) for ``server`` with a bearer-token user."""
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": context, "cluster": {"server": server}}],
        "users": [{"name": f"{context}-user", "user": {"token": token}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": f"{context}-user"}}],
    }


def kubernetes_connection(kube_config: dict | str) -> str:
    """The value of ``AIRFLOW_CONN_<ID>`` for a kubernetes Connection holding ``kube_config``."""
    import json

    return json.dumps({"conn_type": "kubernetes", "extra": {"kube_config": kube_config}})
