"""Serving on Kubernetes: Deployment + Service + canary manifests are valid Kubernetes objects, the
Service sends traffic to both tracks, and deploy -> canary -> promote / rollback leaves the right
objects behind (applied through KubernetesHook's clients, re-runnable)."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from kubernetes.client.exceptions import ApiException

from hybridflow.config import NodePool
from hybridflow.errors import DeploymentError
from hybridflow.serving.k8s import (
    ENDPOINT_LABEL,
    TRACK_LABEL,
    InferencePool,
    InferenceRollout,
    Release,
    canary_deployment,
    canary_replicas,
    publish_model,
    roll_out,
    service,
    stable_deployment,
)

K8S = "1.33"
POOL = InferencePool(endpoint="digits", namespace="serving", models_claim="private-models", replicas=4,
                     pool=NodePool(name="l4", gpu_model="L4", gpu_memory_gib=24, gpus=8,
                                   node_labels={"hybridflow.io/pool": "inference"}))
V1, V2 = Release("v1", "int8", "ghcr.io/example/serve:1"), Release("v2", "fp16", "ghcr.io/example/serve:2")


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_manifests_are_valid_and_the_service_reaches_both_tracks():
    stable, canary, svc = stable_deployment(POOL, V1), canary_deployment(POOL, V2, 20), service(POOL)
    for obj in (stable, canary, svc):
        kubernetes_validate.validate(obj, K8S, strict=True)
    for dep in (stable, canary):
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert _matches(dep["spec"]["selector"]["matchLabels"], pod_labels)
        assert _matches(svc["spec"]["selector"], pod_labels)
    # The two Deployments never claim each other's pods.
    assert not _matches(stable["spec"]["selector"]["matchLabels"], canary["spec"]["template"]["metadata"]["labels"])
    pod = stable["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"hybridflow.io/pool": "inference"}
    command = pod["containers"][0]["command"]
    assert "/models/v1/int8.pt" in command
    # In a pod the server must listen on the pod IP, where the Service and the probes reach it.
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert stable["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_canary_share_follows_its_replicas():
    assert canary_replicas(POOL, 20) == 1 and canary_replicas(POOL, 50) == 4 and canary_replicas(POOL, 1) == 1
    for bad in (0, 51, 100):
        with pytest.raises(DeploymentError, match="canary_percent"):
            canary_replicas(POOL, bad)


@pytest.mark.parametrize(("change", "field"), [
    ({"version": "v 2"}, "version"), ({"variant": "int4"}, "variant"), ({"image": ""}, "image"),
])
def test_bad_releases_are_refused_naming_the_field(change, field):
    with pytest.raises(DeploymentError, match=f"^{field}:"):
        stable_deployment(POOL, Release(**{**V1.__dict__, **change}))


def test_bad_pool_is_refused():
    import dataclasses

    with pytest.raises(DeploymentError, match="^replicas:"):
        service(dataclasses.replace(POOL, replicas=0))
    with pytest.raises(DeploymentError, match="^endpoint:"):
        service(dataclasses.replace(POOL, endpoint="Digits_Model"))


class _Store:
    """AppsV1Api / CoreV1Api calls the rollout makes, over a dict of objects."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}
        self.generation: dict[tuple[str, str], int] = {}
        self.broken: set[str] = set()

    def _create(self, kind, namespace, body):
        key = (kind, body["metadata"]["name"])
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        self.objects[key] = copy.deepcopy(body)

        self.generation[(kind, body["metadata"]["name"])] = 1

    def _patch(self, kind, name, body):
        if (kind, name) not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        self.objects[(kind, name)] = copy.deepcopy(body)
        self.generation[(kind, name)] = self.generation.get((kind, name), 0) + 1

    def read_namespaced_deployment(self, name, namespace, **kw):
        """As the Deployment controller reports it: pods of a version in ``broken`` never get ready."""
        from tests.unit.k8s_sim import to_model

        if ("Deployment", name) not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        body = copy.deepcopy(self.objects[("Deployment", name)])
        gen, want = self.generation[("Deployment", name)], body["spec"]["replicas"]
        ok = body["metadata"]["labels"]["hybridflow.io/version"] not in self.broken
        body["metadata"]["generation"] = gen
        body["status"] = {"observedGeneration": gen, "replicas": want, "updatedReplicas": want,
                          "readyReplicas": want if ok else 0}
        return to_model(body, "V1Deployment")

    def create_namespaced_deployment(self, namespace, body, **kw):
        self._create("Deployment", namespace, body)

    def patch_namespaced_deployment(self, name, namespace, body, **kw):
        self._patch("Deployment", name, body)

    def delete_namespaced_deployment(self, name, namespace, **kw):
        if self.objects.pop(("Deployment", name), None) is None:
            raise ApiException(status=404, reason="NotFound")

    def create_namespaced_service(self, namespace, body, **kw):
        self._create("Service", namespace, body)

    def patch_namespaced_service(self, name, namespace, body, **kw):
        self._patch("Service", name, body)


@pytest.fixture
def rollout(monkeypatch):
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    store = _Store()
    monkeypatch.setattr(KubernetesHook, "apps_v1_client", property(lambda self: store))
    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda self: store))
    return InferenceRollout(KubernetesHook(conn_id="k8s_private"), POOL), store


def _versions(store) -> dict[str, str]:
    return {name: obj["metadata"]["labels"]["hybridflow.io/version"]
            for (kind, name), obj in store.objects.items() if kind == "Deployment"}


def test_canary_then_promote(rollout):
    ro, store = rollout
    ro.deploy(V1)
    ro.deploy(V1)  # re-run: replaced, not AlreadyExists
    ro.canary(V2, percent=20)
    assert _versions(store) == {"digits": "v1", "digits-canary": "v2"}
    assert store.objects[("Deployment", "digits-canary")]["spec"]["template"]["metadata"]["labels"][TRACK_LABEL] == \
        "canary"
    ro.promote(V2)
    assert _versions(store) == {"digits": "v2"}
    assert store.objects[("Service", "digits")]["spec"]["selector"] == {ENDPOINT_LABEL: "digits"}


def test_canary_then_rollback_keeps_stable(rollout):
    ro, store = rollout
    ro.deploy(V1)
    ro.canary(V2, percent=10)
    assert ro.rollback() is True
    assert _versions(store) == {"digits": "v1"}
    assert ro.rollback() is False  # nothing left to roll back: no error


def _roll(ro, release):
    return roll_out(ro, release, canary_percent=25, timeout_s=3, poll_s=1, sleep=lambda s: None,
                    clock=iter(range(10**6)).__next__)


def test_roll_out_first_release_then_canary_promote_then_unchanged(rollout):
    ro, store = rollout
    assert _roll(ro, V1)["strategy"] == "first" and _versions(store) == {"digits": "v1"}
    done = _roll(ro, V2)
    assert (done["strategy"], done["previous"]) == ("canary", "v1") and _versions(store) == {"digits": "v2"}
    assert _roll(ro, V2)["strategy"] == "unchanged" and _versions(store) == {"digits": "v2"}


def test_canary_that_never_gets_ready_is_rolled_back(rollout):
    ro, store = rollout
    _roll(ro, V1)
    store.broken.add("v2")  # e.g. its pods cannot load the model: the readiness probe fails
    with pytest.raises(DeploymentError, match="canary v2 did not become ready within 3 s: rolled back, v1 still"):
        _roll(ro, V2)
    assert _versions(store) == {"digits": "v1"}


def test_published_model_is_written_once_and_atomically(tmp_path):
    artefact = tmp_path / "model-int8.pt"
    artefact.write_bytes(b"weights" * 1000)
    target = publish_model(artefact, tmp_path / "models", V1)
    assert target == tmp_path / "models" / "v1" / "int8.pt" and target.read_bytes() == artefact.read_bytes()
    mtime = target.stat().st_mtime_ns
    assert publish_model(artefact, tmp_path / "models", V1).stat().st_mtime_ns == mtime  # same bytes: untouched
    assert not list((tmp_path / "models" / "v1").glob(".*.part"))


def _k8s_serving_estate(tmp_path, monkeypatch):
    import shutil

    import yaml
    from tests.unit.k8s_config import as_kubernetes

    from hybridflow.datasets import seed_digits
    from hybridflow.settings import REPO_ROOT

    config = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    dc = as_kubernetes(copy.deepcopy(clusters["clusters"]["onprem-a"]), conn_id="k8s_private", scheduler="volcano")
    dc["node_pools"].append({"name": "l4", "gpu_model": "L4", "gpu_memory_gib": 24, "gpus": 8,
                             "node_labels": {"hybridflow.io/pool": "inference"}})
    clusters["clusters"]["dc-k8s"] = dc
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["serving"]["kubernetes"] = {"cluster": "dc-k8s", "node_pool": "l4", "namespace": "serving",
                                         "image": "registry.local/hybridflow-serve:1", "models_claim": "private-models",
                                         "models_dir": str(tmp_path / "models-volume"), "replicas": 4,
                                         "ready_timeout_s": 5}
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    monkeypatch.setenv("AIRFLOW_CONN_K8S_PRIVATE", "kubernetes://")
    seed_digits(tmp_path / "home" / "private")


def test_deploy_step_rolls_the_compressed_model_out_on_the_kubernetes_pool(tmp_path, monkeypatch, rollout):
    from hybridflow import pipeline
    from hybridflow.records import build_record
    from hybridflow.runs import RunIdentity

    _, store = rollout
    _k8s_serving_estate(tmp_path, monkeypatch)
    identity = RunIdentity("hybrid_training", "manual__serve-1", 1)
    run = pipeline.admit({}, identity)
    artefact = tmp_path / "int8.pt"
    artefact.write_bytes(b"quantised" * 100)
    result = pipeline.deploy(run, {"artifact": str(artefact), "selected": "int8"})
    version = run["run_key"]
    assert result["strategy"] == "first" and result["version"] == version
    assert _versions(store) == {"digits": version}
    dep = store.objects[("Deployment", "digits")]
    assert dep["metadata"]["namespace"] == "serving"
    assert f"/models/{version}/int8.pt" in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert (tmp_path / "models-volume" / version / "int8.pt").read_bytes() == artefact.read_bytes()
    rec = build_record(pipeline._admitted(run), identity, {"deploy": result})
    assert rec["endpoint"] == "http://digits.serving.svc:8080" and rec["model_version"] == version
    # Cleared and run again: the version already serves, nothing changes.
    assert pipeline.deploy(run, {"artifact": str(artefact), "selected": "int8"})["strategy"] == "unchanged"
