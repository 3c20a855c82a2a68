"""The kserve deploy target over HTTP: the real kubernetes client, through the provider's hook and a
kubeconfig Connection, against the simulator's KServe controller (:mod:`tests.support.k8s_sim_kserve`),
whose revisions run the predictor's container command as model-server processes behind a loopback
splitter honouring canaryTrafficPercent. A good version goes 10 -> 50 -> 100 % and serves; a canary
failing at 50 % is rolled back to the previous revision with the reason; re-deploying the version
serving changes nothing; the InferenceService is valid against the KServe v0.20.0 CRD.

The load tests of the gate and the canary windows are the deploy's own (:mod:`hybridflow.serving.rollout`)
with one change: the requests come from threads in this process instead of a locust subprocess (whose
start and whole-second run times would make each test several times longer); the figures are summed
by :func:`hybridflow.serving.loadtest.summarise`, per answering version as locust's are."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pydantic
import pytest
import yaml
from tests.reference import REFERENCE
from tests.support import bundles
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_http import serve
from tests.support.k8s_sim import SimCluster, crd_validator
from tests.support.k8s_sim_kserve import CRD, attach
from tests.support.serving import INT_DIGITS, gate_metric

from hybridflow.config import KubernetesServing, ServingSettings
from hybridflow.config.pipeline import CanarySettings, GateSettings
from hybridflow.errors import ConfigError, DeploymentError
from hybridflow.serving import deploy_target, target_class, target_name
from hybridflow.serving.base import DeployRequest, roll
from hybridflow.serving.k8s_manifests import ENDPOINT_LABEL, VERSION_LABEL, InferencePool, Release
from hybridflow.serving.kserve import KServeTarget
from hybridflow.serving.kserve_manifests import SERVING_ANNOTATION, inference_service

NS = "serving"
POOL = dict(cluster="dc2-k8s", node_pool="h100", namespace=NS, image="registry.local/hybridflow-serve:1",
            models_claim="private-models", replicas=1, gpus_per_replica=1, ready_timeout_s=60)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A briefly trained digits model as bundles v1 (fp32) and v2 (int8), its held-out split and metric."""
    root = tmp_path_factory.mktemp("kserve-bundles")
    data = bundles.seed("digits-mlp", root / "data")
    module = bundles.train("digits-mlp", data)
    made = {v: bundles.make_bundle(root / v, "digits-mlp", module, variant=variant, version=v, signature=INT_DIGITS)
            for v, variant in (("v1", "fp32"), ("v2", "int8"))}
    return SimpleNamespace(bundles=made, smoke=lambda: data.xy("test", 120), metric=gate_metric("digits"))


def _fast_load_test(base_url, endpoint, rows, *, concurrency, duration_s, log=None, **_):
    """Contract B's load test from threads in this process: per answering version (body, else header)."""
    from hybridflow.serving.loadtest import summarise

    url = f"{base_url.rstrip('/')}/v1/models/{endpoint}:predict"
    entries: dict[str, dict] = {}
    lock, deadline = threading.Lock(), time.monotonic() + duration_s

    def user(offset: int) -> None:
        i = offset
        while time.monotonic() < deadline:
            body = json.dumps({"instances": [list(rows[i % len(rows)])]}).encode()
            req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
            start = time.time()
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    ok, version = True, json.loads(resp.read()).get("version") or resp.headers.get("X-Model-Version")
            except urllib.error.HTTPError as exc:
                ok, version = False, exc.headers.get("X-Model-Version")
            except OSError:
                ok, version = False, None
            end = time.time()
            with lock:
                e = entries.setdefault(version or "?", {"name": version or "?", "num_requests": 0, "num_failures": 0,
                                                        "response_times": {}, "start_time": start,
                                                        "last_request_timestamp": end})
                e["num_requests"] += 1
                e["num_failures"] += 0 if ok else 1
                ms = round((end - start) * 1000, 1)
                e["response_times"][ms] = e["response_times"].get(ms, 0) + 1
                e["start_time"], e["last_request_timestamp"] = min(e["start_time"], start), end
            i += concurrency

    threads = [threading.Thread(target=user, args=(n,)) for n in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=duration_s + 10)
    return summarise(list(entries.values()), duration_s)


@pytest.fixture
def cluster(request, tmp_path, monkeypatch):
    """The simulator with KServe, served over HTTP behind Connection k8s_dc2; the estate's serving
    settings with ``kind: kserve``, short gate runs and canary windows. Revisions are ready 0.2 s after
    their server listens; their containers run in-process unless the test asks for processes
    (``indirect`` parameter True: the model server itself, in its own environment)."""
    import hybridflow.serving.rollout as rollout

    monkeypatch.setattr(rollout, "load_test", _fast_load_test)
    models = tmp_path / "models"
    sim = SimCluster({})
    ctrl = attach(sim, models, tmp_path / "revisions", ready_delay_s=0.2, processes=getattr(request, "param", False))
    serving = ServingSettings(
        kubernetes=KubernetesServing(**POOL, models_dir=str(models), kind="kserve"),
        gate=GateSettings(p99_ms=3000, min_rps=2, max_p99_regression=20, concurrency=2, duration_s=0.4),
        canary=CanarySettings(steps=[10, 50, 100], window_s=0.5, concurrency=2))
    estate = SimpleNamespace(pipeline=SimpleNamespace(serving=serving), clusters={"dc2-k8s": private_h100_cluster("volcano")})
    try:
        with serve(monkeypatch, sim) as server:
            yield SimpleNamespace(sim=sim, ctrl=ctrl, server=server, estate=estate, state=tmp_path / "state",
                                  models=models)
    finally:
        ctrl.close()


def _deploy(cluster, digits, version: str) -> dict:
    target = deploy_target(cluster.estate, "digits", state_dir=cluster.state)
    assert isinstance(target, KServeTarget)
    target.poll_s = 0.05
    return roll(target, DeployRequest(version, bundle_dir=digits.bundles[version], smoke=digits.smoke,
                                      metric=digits.metric))


def _isvc(cluster) -> dict:
    with cluster.server.lock:
        return cluster.ctrl.get(NS, "digits")


def _splits(cluster) -> list[dict[str, int]]:
    """Each traffic split the InferenceService went through: {version: percent} of the revisions taking some."""
    return [{version: percent for version, percent in split if percent}
            for event, split in cluster.ctrl.history if event == "traffic"]


def _answers(url: str, n: int = 20) -> set[str]:
    versions = set()
    for _ in range(n):
        req = urllib.request.Request(f"{url}/v1/models/digits:predict", method="POST",
                                     data=json.dumps({"instances": [[0] * 64]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            versions.add(json.loads(resp.read())["version"])
    return versions


@pytest.mark.parametrize("cluster", [True], indirect=True)
def test_the_predictor_container_runs_the_model_server_behind_the_inference_service(cluster, digits):
    """The one test whose revision runs the container command itself: the model server, in its own
    environment, with the serving.server flags, on the bundle published on the models volume."""
    first = _deploy(cluster, digits, "v1")
    assert (first["status"], first["target"], first["previous_version"], first["canary"]) == \
        ("deployed", "kserve", None, [])
    assert first["smoke_metric"]["value"] >= first["smoke_metric"]["gate"] and first["gate"]["passed"]
    assert first["gate"]["new"]["requests"] > 0 and first["gate"]["new"]["failures"] == 0
    isvc = _isvc(cluster)
    assert _answers(isvc["status"]["url"]) == {"v1"}
    (revision,) = cluster.ctrl.revisions[(NS, "digits")]
    command = revision.container.proc.args
    assert command[1:3] == ["-m", "hybridflow.serving.server"] and "--max-batch-size" in command
    assert command[command.index("--bundle") + 1] == str(cluster.models / "digits" / "v1" / "fp32")


def test_a_good_version_goes_10_50_100_and_serves(cluster, digits):
    first = _deploy(cluster, digits, "v1")
    assert (first["status"], first["previous_version"]) == ("deployed", None)
    out = _deploy(cluster, digits, "v2")
    assert (out["status"], out["version"], out["previous_version"], out["variant"]) == \
        ("deployed", "v2", "v1", "int8")
    assert [step["percent"] for step in out["canary"]] == [10, 50, 100]
    assert all(step["passed"] for step in out["canary"]), out["canary"]
    # The gate measured the new revision and the serving one side by side, before any traffic moved.
    assert out["gate"]["passed"] and out["gate"]["serving"]["requests"] > 0 and out["gate"]["new"]["requests"] > 0
    # While split, both versions answered the window's traffic; after promotion, v2 alone.
    assert out["canary"][0]["canary"]["requests"] > 0 and out["canary"][0]["stable"]["requests"] > 0
    assert out["canary"][2]["stable"] is None or out["canary"][2]["stable"] == out["canary"][1]["stable"]
    splits = _splits(cluster)
    assert {"v2": 10, "v1": 90} in splits and {"v2": 50, "v1": 50} in splits and splits[-1] == {"v2": 100}
    isvc = _isvc(cluster)
    predictor = isvc["status"]["components"]["predictor"]
    assert "canaryTrafficPercent" not in isvc["spec"]["predictor"]
    assert isvc["metadata"]["annotations"][SERVING_ANNOTATION] == "v2"
    assert isvc["metadata"]["labels"] == {ENDPOINT_LABEL: "digits", VERSION_LABEL: "v2"}
    assert [t["percent"] for t in predictor["traffic"]] == [100]
    assert predictor["traffic"][0]["revisionName"] == predictor["latestReadyRevision"] == out["revision"]
    assert _answers(isvc["status"]["url"]) == {"v2"}


def test_a_canary_failing_at_50_percent_is_rolled_back_to_the_previous_revision(cluster, digits):
    _deploy(cluster, digits, "v1")
    before = _isvc(cluster)["status"]["components"]["predictor"]["latestRolledoutRevision"]
    cluster.ctrl.faults["v2"] = 50  # v2's revision fails its requests once it takes half the traffic
    with pytest.raises(DeploymentError, match=r"canary at 50 %.*error rate.*rolled back, v1 serves all traffic") \
            as failed:
        _deploy(cluster, digits, "v2")
    outcome = failed.value.outcome
    assert outcome["status"] == "rolled_back"
    assert [(s["percent"], s["passed"]) for s in outcome["canary"]] == [(10, True), (50, False)]
    assert outcome["rolled_back"]["step"] == "canary at 50 %" and outcome["rolled_back"]["serving"] == "v1"
    assert "error rate" in outcome["rolled_back"]["reason"]
    isvc = _isvc(cluster)
    predictor = isvc["status"]["components"]["predictor"]
    # The previous spec runs again, with all traffic; v2 took none after the failed step.
    assert isvc["spec"]["predictor"]["labels"][VERSION_LABEL] == "v1"
    assert "canaryTrafficPercent" not in isvc["spec"]["predictor"]
    assert isvc["metadata"]["annotations"][SERVING_ANNOTATION] == "v1"
    assert [t["percent"] for t in predictor["traffic"]] == [100] and predictor["latestRolledoutRevision"] != before
    splits = _splits(cluster)
    assert splits[splits.index({"v2": 50, "v1": 50}) + 1] == {"v1": 100}  # straight back to v1
    assert _answers(isvc["status"]["url"]) == {"v1"}


def test_a_version_failing_the_check_after_promotion_gets_the_previous_spec_back(cluster, digits):
    _deploy(cluster, digits, "v1")
    cluster.ctrl.faults["v2"] = 100  # fine while it shares the traffic, failing once it has it all
    with pytest.raises(DeploymentError, match=r"check after promotion.*rolled back, v1 serves all traffic") as failed:
        _deploy(cluster, digits, "v2")
    outcome = failed.value.outcome
    assert [(s["percent"], s["passed"]) for s in outcome["canary"]] == [(10, True), (50, True), (100, False)]
    assert (outcome["rolled_back"]["step"], outcome["rolled_back"]["serving"]) == ("check after promotion", "v1")
    # v2 held all traffic until the restored v1 revision was ready, then v1 took it all again.
    splits = _splits(cluster)
    assert splits[-2:] == [{"v2": 100}, {"v1": 100}]
    isvc = _isvc(cluster)
    assert isvc["metadata"]["annotations"][SERVING_ANNOTATION] == "v1"
    assert isvc["spec"]["predictor"]["labels"][VERSION_LABEL] == "v1"
    assert _answers(isvc["status"]["url"]) == {"v1"}


def test_redeploying_the_version_serving_changes_nothing(cluster, digits):
    _deploy(cluster, digits, "v1")
    before = _isvc(cluster)
    writes = len(cluster.sim.requests)
    again = _deploy(cluster, digits, "v1")
    assert (again["status"], again["version"], again["previous_version"]) == ("kept", "v1", "v1")
    after = _isvc(cluster)
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["status"]["components"] == before["status"]["components"]
    # Reads only: the InferenceService, and whether the cluster serves Knative (checked before anything).
    assert {call for call, _ in cluster.sim.requests[writes:]} == {"get_namespaced_custom_object",
                                                                   "list_namespaced_custom_object"}


POOL_OBJ = InferencePool(endpoint="digits", namespace=NS, models_claim="private-models", replicas=3,
                         gpus_per_replica=1, pool=private_h100_cluster("volcano").pool("h100"))


def test_the_inference_service_validates_against_the_kserve_crd():
    validator = crd_validator(*CRD)
    validator.validate(yaml.safe_load((REFERENCE / "kserve/examples/rollout-canary.yaml").read_text()))
    flags = ["--max-batch-size", "32", "--request-timeout-s", "10"]
    isvc = inference_service(POOL_OBJ, Release("v3", "fp16", "registry.local/serve:2"), flags, canary_percent=10,
                             serving_version="v2")
    validator.validate(isvc)
    assert (isvc["apiVersion"], isvc["kind"], isvc["metadata"]["name"]) == \
        ("serving.kserve.io/v1beta1", "InferenceService", "digits")
    pred = isvc["spec"]["predictor"]
    container = pred["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "hybridflow.serving.server"] and command[-4:] == flags
    assert command[command.index("--bundle") + 1] == "/models/digits/v3/fp16"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert (pred["canaryTrafficPercent"], pred["minReplicas"], pred["maxReplicas"]) == (10, 3, 3)
    assert pred["nodeSelector"] == {"hybridflow.io/pool": "h100"}
    assert pred["labels"] == isvc["metadata"]["labels"] == {ENDPOINT_LABEL: "digits", VERSION_LABEL: "v3"}
    # The CRD's schema refuses what the API server would: a share sent as a string.
    pred["canaryTrafficPercent"] = "10"
    with pytest.raises(Exception, match="is not of type 'integer'"):
        validator.validate(isvc)


def test_the_kind_chooses_the_target_and_an_unknown_kind_is_refused_by_name():
    assert target_name(ServingSettings(kubernetes=KubernetesServing(**POOL, models_dir="/m", kind="kserve"))) == \
        "kserve"
    assert target_name(ServingSettings(kubernetes=KubernetesServing(**POOL, models_dir="/m"))) == "kubernetes"
    assert target_class("kserve") is KServeTarget
    with pytest.raises(pydantic.ValidationError, match=r"kind\n.*'deployment' or 'kserve'"):
        KubernetesServing(**POOL, models_dir="/m", kind="knative")
    estate = SimpleNamespace(pipeline=SimpleNamespace(serving=ServingSettings()), clusters={})
    with pytest.raises(ConfigError, match=r"^serving.target: 'kserve' needs serving.kubernetes"):
        deploy_target(estate, "digits", state_dir=None, name="kserve")


def test_a_cluster_without_knative_is_refused_before_anything_changes(tmp_path, monkeypatch, digits):
    """KServe installed for Standard mode only: a Serverless InferenceService would never get a revision
    (KServe logs a terminal error, the status stays Unknown), so the deploy stops at once, naming the
    missing API and both fixes, with nothing published or created."""
    models = tmp_path / "models"
    sim = SimCluster({})
    ctrl = attach(sim, models, tmp_path / "revisions", processes=False, knative=False)
    serving = ServingSettings(kubernetes=KubernetesServing(**POOL, models_dir=str(models), kind="kserve"))
    estate = SimpleNamespace(pipeline=SimpleNamespace(serving=serving), clusters={"dc2-k8s": private_h100_cluster("volcano")})
    try:
        with serve(monkeypatch, sim):
            target = deploy_target(estate, "digits", state_dir=tmp_path / "state")
            started = time.monotonic()
            with pytest.raises(DeploymentError, match=r"cluster dc2-k8s serves no Knative Serving API "
                                                      r"\(serving.knative.dev/v1\).*kind: deployment"):
                roll(target, DeployRequest("v1", bundle_dir=digits.bundles["v1"], smoke=digits.smoke,
                                           metric=digits.metric))
            assert time.monotonic() - started < 10
    finally:
        ctrl.close()
    assert ctrl.objects == {} and not models.exists()
