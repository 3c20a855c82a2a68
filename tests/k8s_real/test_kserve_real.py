"""The KServe deploy target against the real KServe controller, installed (as on the plane) for
Standard mode without Knative Serving: an InferenceService asking for Serverless mode there is a
terminal error that KServe logs but never writes to its status, so the target checks the cluster
first and refuses at once, naming the missing API and the fixes, with nothing created or published."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from tests.k8s_real.conftest import real_cluster

from hybridflow.config import KubernetesServing, ServingSettings
from hybridflow.errors import DeploymentError
from hybridflow.serving import deploy_target
from hybridflow.serving.base import DeployRequest, roll


def test_a_kserve_deploy_to_a_cluster_without_knative_stops_at_once_and_changes_nothing(real, tmp_path):
    models = tmp_path / "models"
    serving = ServingSettings(kubernetes=KubernetesServing(
        cluster="k8s-real", node_pool="run", namespace=real.ns, image="registry.local/hybridflow-serve:1",
        models_claim="models", models_dir=str(models), replicas=1, gpus_per_replica=1, ready_timeout_s=60,
        kind="kserve"))
    estate = SimpleNamespace(pipeline=SimpleNamespace(serving=serving),
                             clusters={"k8s-real": real_cluster("volcano", real.ns, pool="run")})
    target = deploy_target(estate, "digits", state_dir=tmp_path / "state")
    started = time.monotonic()
    with pytest.raises(DeploymentError, match=r"cluster k8s-real serves no Knative Serving API "
                                              r"\(serving.knative.dev/v1\).*Serverless mode.*kind: deployment"):
        roll(target, DeployRequest("v1", bundle_dir=tmp_path / "bundle", smoke=lambda: ([], []), metric=None))
    assert time.monotonic() - started < 10  # not the 60 s ready timeout
    isvcs = real.custom().list_namespaced_custom_object("serving.kserve.io", "v1beta1", real.ns, "inferenceservices")
    assert isvcs["items"] == [] and not models.exists()
