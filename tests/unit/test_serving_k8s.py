"""Serving on Kubernetes: Deployment + Service + canary manifests are valid Kubernetes objects named
after the endpoint, the Service sends traffic to both tracks, the pods' server command serves the bundle
publish_model put on the models volume, and deploy -> canary -> promote / rollback leaves the right
objects behind (applied through KubernetesHook's clients, re-runnable)."""

from __future__ import annotations

import copy
import json
import os
import threading
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
from kubernetes.client.exceptions import ApiException

from hybridflow.config import NodePool
from hybridflow.errors import DeploymentError
from hybridflow.serving.k8s import InferenceRollout, publish_model, roll_out
from hybridflow.serving.k8s_manifests import (
    ENDPOINT_LABEL,
    MODELS_MOUNT,
    TRACK_LABEL,
    InferencePool,
    Release,
    canary_deployment,
    canary_replicas,
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
    container = pod["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "hybridflow.serving.server"]
    assert command[command.index("--bundle") + 1] == "/models/digits/v1/int8"
    assert command[command.index("--endpoint") + 1] == "digits" and command[command.index("--version") + 1] == "v1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert canary["spec"]["template"]["spec"]["containers"][0]["command"][command.index("--bundle") + 1] == \
        "/models/digits/v2/fp16"
    # In a pod the server must listen on the pod IP, where the Service and the probes reach it.
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert stable["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert (stable["metadata"]["name"], canary["metadata"]["name"], svc["metadata"]["name"]) == \
        ("digits", "digits-canary", "digits")


def test_names_follow_the_endpoint():
    import dataclasses

    pool = dataclasses.replace(POOL, endpoint="breast-cancer")
    assert stable_deployment(pool, V1)["metadata"]["name"] == "breast-cancer"
    assert canary_deployment(pool, V2, 10)["metadata"]["name"] == "breast-cancer-canary"
    assert service(pool)["spec"]["selector"] == {ENDPOINT_LABEL: "breast-cancer"}
    command = stable_deployment(pool, V1)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "/models/breast-cancer/v1/int8" in command and "breast-cancer" in command


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
        from tests.support.k8s_sim import to_model

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


def _bundle(folder: Path, variant: str = "int8", version: str = "v1") -> Path:
    """A digits bundle (untrained weights are enough to load and serve)."""
    from tests.support.bundles import card

    from hybridflow import bundle

    c = card("digits-mlp", variant=variant, version=version)
    module = bundle.convert(bundle.build_module(c), variant)
    return bundle.write_bundle(folder, bundle.serialise_state(module), c)


def _tree(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_published_bundle_is_written_once_and_atomically(tmp_path):
    source = _bundle(tmp_path / "bundle")
    models = tmp_path / "models"
    target = publish_model(source, models, "digits", V1)
    assert target == models / "digits" / "v1" / "int8"
    assert {n: b for n, (_, b) in _tree(target).items()} == {p.name: p.read_bytes() for p in source.iterdir()}
    before = _tree(target)
    assert publish_model(source, models, "digits", V1) == target and _tree(target) == before  # same bytes: untouched
    # Different bytes for the same release (e.g. a retrained retry) replace the folder as a whole.
    _bundle(source, version="v1-retrained")
    publish_model(source, models, "digits", V1)
    assert json.loads((target / "model.json").read_text())["version"] == "v1-retrained"
    assert sorted(os.listdir(target.parent)) == ["int8"]  # no temporary or stale folders left


@pytest.mark.parametrize(("change", "match"), [
    ({"release": Release("v1", "fp16", "ghcr.io/example/serve:1")}, "^variant: the bundle .* is int8"),
    ({"endpoint": "Digits_Model"}, "^endpoint:"),
    ({"release": Release("v 1", "int8", "ghcr.io/example/serve:1")}, "^version:"),
    ({"source": "missing"}, "not a model bundle"),
])
def test_publish_refuses_what_pods_could_not_serve(tmp_path, change, match):
    source = _bundle(tmp_path / "bundle")
    args = {"source": source, "endpoint": "digits", "release": V1, **change}
    if args["source"] == "missing":
        args["source"] = tmp_path / "missing"
    with pytest.raises(DeploymentError, match=match):
        publish_model(args["source"], tmp_path / "models", args["endpoint"], args["release"])
    assert not (tmp_path / "models").exists()


def test_the_pods_command_serves_the_published_bundle(tmp_path):
    """The Deployment's server arguments, with the mount read as the folder publish_model wrote to,
    start the model server on the published bundle and answer under the endpoint's path."""
    from hybridflow.serving.server import build_server

    models = tmp_path / "models"
    publish_model(_bundle(tmp_path / "bundle"), models, "digits", V1)
    command = stable_deployment(POOL, V1)["spec"]["template"]["spec"]["containers"][0]["command"]
    args = dict(zip(command[3::2], command[4::2], strict=True))
    assert set(args) == {"--bundle", "--endpoint", "--version", "--port", "--host"}
    bundle_dir = models / Path(args["--bundle"]).relative_to(MODELS_MOUNT)
    server = build_server(bundle_dir, args["--endpoint"], args["--version"], 0, "127.0.0.1")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with urllib.request.urlopen(f"{base}/healthz", timeout=10) as resp:
            health = json.loads(resp.read())
        assert (health["endpoint"], health["version"], health["variant"]) == ("digits", "v1", "int8")
        req = urllib.request.Request(f"{base}/v1/models/digits:predict", method="POST",
                                     data=json.dumps({"instances": [[0] * 64]}).encode())
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["version"] == "v1" and len(body["predictions"]) == 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _k8s_serving_estate(tmp_path, monkeypatch):
    import shutil

    import yaml
    from tests.support.k8s_config import as_kubernetes
    from tests.support.train_task import seed_examples

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
    seed_examples(tmp_path / "home")


def test_deploy_step_rolls_the_compressed_model_out_on_the_kubernetes_pool(tmp_path, monkeypatch, rollout):
    from hybridflow import pipeline
    from hybridflow.records import build_record
    from hybridflow.runs import RunIdentity

    _, store = rollout
    _k8s_serving_estate(tmp_path, monkeypatch)
    identity = RunIdentity("hybrid_training", "manual__serve-1", 1)
    run = pipeline.admit({}, identity)
    version = run["run_key"]
    compressed = {"bundle": str(_bundle(tmp_path / "int8", "int8", version)), "selected": "int8"}
    result = pipeline.deploy(run, compressed)
    assert result["strategy"] == "first" and result["version"] == version
    assert _versions(store) == {"digits": version}  # the model's endpoint names the Deployment
    dep = store.objects[("Deployment", "digits")]
    assert dep["metadata"]["namespace"] == "serving"
    command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"/models/digits/{version}/int8" in " ".join(command)
    published = tmp_path / "models-volume" / "digits" / version / "int8"
    assert _tree(published).keys() == _tree(Path(compressed["bundle"])).keys()
    rec = build_record(pipeline._admitted(run), identity, {"deploy": result})
    assert rec["endpoint"] == "http://digits.serving.svc:8080/v1/models/digits" and rec["model_version"] == version
    # Cleared and run again: the version already serves, nothing changes.
    assert pipeline.deploy(run, compressed)["strategy"] == "unchanged"


def test_the_table_picks_the_kubernetes_target_for_an_estate_with_an_inference_pool(tmp_path, monkeypatch, rollout):
    from hybridflow.config import load_estate
    from hybridflow.serving import deploy_target
    from hybridflow.serving.base import DeployRequest, roll
    from hybridflow.serving.k8s import KubernetesTarget

    _, store = rollout
    _k8s_serving_estate(tmp_path, monkeypatch)
    target = deploy_target(load_estate(tmp_path / "config", use_cache=False), "digits", state_dir=tmp_path / "state")
    assert isinstance(target, KubernetesTarget)
    done = roll(target, DeployRequest("v1", _bundle(tmp_path / "int8", "int8", "v1"), variant="int8"))
    assert done == {"strategy": "first", "version": "v1", "previous": None, "cluster": "dc-k8s", "namespace": "serving",
                    "endpoint_url": "http://digits.serving.svc:8080/v1/models/digits"}
    assert _versions(store) == {"digits": "v1"}
    assert (tmp_path / "models-volume" / "digits" / "v1" / "int8" / "model.json").is_file()  # published first
