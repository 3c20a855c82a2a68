"""The serving reaper on a real control plane with the real KServe controller: KServe's own
Deployment for an InferenceService (Standard, i.e. raw Deployment, mode) carries the endpoint's
labels and no track; the reaper must never touch it, while a Deployment of the product's that no
track routes to is released."""

from __future__ import annotations

from datetime import UTC, datetime

from tests.k8s_real.conftest import CONN_ID, until

from hybridflow.hooks.kubernetes import kubernetes_hook
from hybridflow.reaper.serving import KubernetesServingFinder


def _deployment(ns: str, name: str, labels: dict) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name, **labels}},
                                  "spec": {"containers": [{"name": "server", "image": "registry.local/serve:1"}]}}}}


def test_kserve_s_own_deployment_is_never_reaped_and_an_unrouted_one_of_ours_is(real):
    from kubernetes import client

    endpoint = {"hybridflow.io/endpoint": "digits"}
    real.custom().create_namespaced_custom_object("serving.kserve.io", "v1beta1", real.ns, "inferenceservices", {
        "apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
        "metadata": {"name": "digits", "namespace": real.ns, "labels": {**endpoint, "hybridflow.io/version": "v2"},
                     "annotations": {"serving.kserve.io/deploymentMode": "Standard"}},
        "spec": {"predictor": {"minReplicas": 1, "maxReplicas": 1, "containers": [
            {"name": "kserve-container", "image": "registry.local/serve:1"}]}}})
    apps = client.AppsV1Api(real.api)
    kserve_own = until(lambda: [d for d in apps.list_namespaced_deployment(real.ns).items
                                if d.metadata.owner_references], 60, "KServe to create the predictor's Deployment")
    [predictor] = kserve_own
    assert predictor.metadata.labels["hybridflow.io/endpoint"] == "digits"  # what made the old reaper delete it
    assert "hybridflow.io/track" not in predictor.metadata.labels
    apps.create_namespaced_deployment(real.ns, _deployment(real.ns, "digits-blue", {
        **endpoint, "hybridflow.io/version": "v1", "hybridflow.io/track": "blue"}))

    finder = KubernetesServingFinder("k8s-real", kubernetes_hook(CONN_ID), real.ns, timeout_s=10)
    found = finder.find(datetime.now(UTC))
    assert [lo.name for lo in found] == ["deployment/digits-blue"]
    for leftover in found:
        finder.release(leftover)
    left = {d.metadata.name for d in apps.list_namespaced_deployment(real.ns).items
            if d.metadata.deletion_timestamp is None}
    assert left == {predictor.metadata.name}
