"""Replication of served models when they serve on Kubernetes (``serving.kubernetes``, kind
``deployment`` or ``kserve``): the bundles deploy published on the models volume are copied to the
DR store, the version serving now (asked of the primary's API server) always among them, an API
server that does not answer only reported; and readiness names what a Kubernetes DR cluster lacks to
serve them in a takeover. Critical training running as gang jobs of a Kubernetes primary is found
through that cluster's API server, and its newest checkpoint copied from the cluster's bucket.

The models volume is a folder holding real bundles put there by ``publish_model``; the primary's API
is the Deployment fake of ``test_serving_k8s`` (kind deployment) or the simulator with KServe
attached, its revisions answered in-process (kind kserve); the training primary's API is the simulator
and its bucket the session's S3 endpoint. The DR store is a folder."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes
from tests.unit.test_dr_replication import _dr_cluster
from tests.unit.test_serving_k8s import _bundle
from urllib3.exceptions import MaxRetryError, NewConnectionError

from hybridflow.bundle import read_card
from hybridflow.config import Estate, load_estate
from hybridflow.dr.drills.replicas import fetch_bundle, model_manifests
from hybridflow.dr.replication.readiness import check_readiness
from hybridflow.dr.replication.replicate import replicate
from hybridflow.dr.replication.scope import ReplicationError, scope_of
from hybridflow.serving.k8s import publish_model
from hybridflow.serving.k8s_manifests import Release
from hybridflow.settings import REPO_ROOT, Settings
from hybridflow.storage.objectstore import LocalObjectStore

ENDPOINT = "digits"
NS = "serving"
IMAGE = "registry.local/hybridflow-serve:1"
KINDS = ["deployment", "kserve"]


def _estate(tmp_path: Path, kind: str, *, dr: dict | None = None, image: str = IMAGE) -> Estate:
    """The shipped estate with a private Kubernetes cluster serving ``digits`` from its inference pool
    (models volume at tmp/models-volume) and a DR cluster (default: a local one with a store)."""
    config = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config, dirs_exist_ok=True)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    dc = as_kubernetes(copy.deepcopy(clusters["clusters"]["onprem-a"]), conn_id="k8s_private", scheduler="volcano")
    dc["node_pools"].append({"name": "l4", "gpu_model": "L4", "gpu_memory_gib": 24, "gpus": 8,
                             "node_labels": {"hybridflow.io/pool": "inference"}})
    clusters["clusters"]["dc-k8s"] = dc
    clusters["clusters"]["dr-west"] = dr or _dr_cluster()
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["serving"]["kubernetes"] = {"cluster": "dc-k8s", "node_pool": "l4", "namespace": NS, "image": image,
                                         "models_claim": "private-models", "models_dir": str(tmp_path / "models-volume"),
                                         "replicas": 1, "kind": kind}
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return load_estate(config, use_cache=False)


class _Recording(LocalObjectStore):
    """The DR store, remembering the order in which keys were written."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.writes: list[str] = []

    def put_bytes(self, key, data, **kw):
        self.writes.append(key)
        return super().put_bytes(key, data, **kw)

    def put_if_absent(self, key, data):
        self.writes.append(key)
        return super().put_if_absent(key, data)

    def put_file(self, key, path, **kw):
        self.writes.append(key)
        return super().put_file(key, path, **kw)


class Primary:
    """The primary's serving side: bundles published on its models volume, and its API server,
    which says what serves now (the Deployment fake, or the simulator with KServe)."""

    def __init__(self, tmp_path: Path, kind: str, monkeypatch) -> None:
        monkeypatch.setenv("AIRFLOW_CONN_K8S_PRIVATE", "kubernetes://")
        self.kind, self.tmp = kind, tmp_path
        self.estate = _estate(tmp_path, kind)
        self.settings = Settings(home=tmp_path / "home", config_dir=tmp_path / "config")
        self.models = tmp_path / "models-volume"
        self.dr = _Recording(tmp_path / "dr-store")
        self.published = 0
        self.ctrl = None
        self.refused: list = []  # the timeout of each call refused while unreachable (deployment)
        if kind == "deployment":
            from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
            from tests.unit.test_serving_k8s import _Store

            self.api = _Store()
            monkeypatch.setattr(KubernetesHook, "apps_v1_client", property(lambda hook: self.api))
            monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda hook: self.api))
        else:
            from tests.support.k8s_sim import SimCluster, install_clusters
            from tests.support.k8s_sim_kserve import attach

            self.api = SimCluster({})
            self.ctrl = attach(self.api, self.models, tmp_path / "revisions", processes=False)
            install_clusters(monkeypatch, {"k8s_private": self.api})

    def publish(self, version: str, variant: str = "int8") -> Path:
        """What deploy's prepare does: the bundle onto the models volume (publish times one second apart)."""
        source = _bundle(self.tmp / "bundles" / f"{version}-{variant}", variant, version)
        target = publish_model(source, self.models, ENDPOINT, Release(version, variant, IMAGE))
        self.published += 1
        os.utime(target / "model.json", (1_000_000 + self.published, 1_000_000 + self.published))
        return target

    def _target(self):
        from hybridflow.serving import deploy_target

        return deploy_target(self.estate, ENDPOINT, state_dir=self.settings.state_dir)

    def serve(self, version: str, variant: str = "int8") -> None:
        """``version`` serves all traffic: the stable Deployment, or a new InferenceService."""
        release = Release(version, variant, IMAGE)
        target = self._target()
        if self.kind == "deployment":
            target.rollout.deploy(release)
            return
        from hybridflow.serving.kserve_manifests import inference_service

        target.api.create(inference_service(target.pool, release, serving_version=version))

    def canary(self, version: str, serving: str, variant: str = "int8") -> None:
        """``version`` takes 10 % next to ``serving``: a canary Deployment, or a canary revision."""
        release = Release(version, variant, IMAGE)
        target = self._target()
        if self.kind == "deployment":
            target.rollout.canary(release, percent=10)
            return
        from hybridflow.serving.kserve_manifests import inference_service

        target.api.patch(inference_service(target.pool, release, canary_percent=10, serving_version=serving))

    def unreachable(self, down: bool = True) -> None:
        """The primary's API server refuses connections (or answers again)."""
        if self.kind == "kserve":
            self.api.unreachable = down
            return
        if not down:
            del self.api.read_namespaced_deployment
            return

        def refuse(*_a, **kw):
            self.refused.append(kw.get("_request_timeout"))
            raise MaxRetryError(None, "/apis/apps/v1", NewConnectionError(None, "[Errno 111] Connection refused"))

        self.api.read_namespaced_deployment = refuse

    def timeouts(self) -> list:
        """The timeout of each call to the API server (the Deployment fake: of those it refused)."""
        return self.refused if self.kind == "deployment" else [t for _, t in self.api.requests]

    def replicate(self, **kwargs):
        kwargs.setdefault("runs", [])
        kwargs.setdefault("datasets", [])
        return replicate(self.estate, self.settings, store=self.dr, **kwargs)

    def snapshot(self) -> dict[str, bytes]:
        return {i.key: self.dr.get_bytes(i.key) for i in self.dr.list("")}

    def close(self) -> None:
        if self.ctrl is not None:
            self.ctrl.close()


@pytest.fixture(params=KINDS)
def primary(request, tmp_path, monkeypatch):
    p = Primary(tmp_path, request.param, monkeypatch)
    try:
        yield p
    finally:
        p.close()


def _models(report) -> list[str]:
    return sorted(s.version for s in report.sets if s.kind == "model")


def test_served_and_older_versions_are_replicated_verified_manifest_last_then_nothing_twice(primary, tmp_path):
    for v in ("v1", "v2", "v3", "v4"):
        primary.publish(v)
    primary.serve("v4")

    first = primary.replicate(keep=3)
    assert first.all_problems == []
    assert {(s.name, s.version, s.status) for s in first.sets} == {
        (ENDPOINT, "v4", "copied"), (ENDPOINT, "v3", "copied"), (ENDPOINT, "v2", "copied")}
    manifests = {m["version"]: m for m in model_manifests(primary.dr, ENDPOINT)}
    assert set(manifests) == {"v2", "v3", "v4"} and {m["model"] for m in manifests.values()} == {"digits-mlp"}
    for version, manifest in manifests.items():
        # Every object is written before the manifest that names it.
        last = max(primary.dr.writes.index(o["key"]) for o in manifest["objects"])
        assert primary.dr.writes.index(manifest["_key"]) > last
        # The DR copy is the published bundle, byte for byte, and loads as that version.
        fetched = tmp_path / "fetched" / version
        fetch_bundle(primary.dr, manifest, fetched)
        published = primary.models / ENDPOINT / version / "int8"
        assert {p.name: p.read_bytes() for p in fetched.iterdir()} == \
            {p.name: p.read_bytes() for p in published.iterdir()}
        assert read_card(fetched).version == version
    before = primary.snapshot()

    second = primary.replicate(keep=3)
    assert second.objects_copied == 0 and second.bytes_copied == 0
    assert {s.status for s in second.sets} == {"present"}
    assert primary.snapshot() == before

    # The endpoint's model, read from the published card, brings its dataset into scope.
    dr = primary.estate.clusters["dr-west"]
    assert scope_of(primary.estate, primary.settings, dr, runs=[]).datasets == \
        [primary.estate.models.get("digits-mlp").dataset]
    with pytest.raises(ReplicationError, match=r"^endpoints: nope not served here \(served: digits\)"):
        primary.replicate(endpoints=["nope"])


def test_the_version_serving_now_and_its_canary_are_replicated_however_old(primary):
    for v in ("v1", "v2", "v3", "v4", "v5"):
        primary.publish(v)
    primary.serve("v1")

    report = primary.replicate(keep=3)
    assert report.all_problems == []
    assert _models(report) == ["v1", "v4", "v5"]  # v1 serves; then the newest published

    primary.canary("v2", serving="v1")
    report = primary.replicate(keep=3)
    assert _models(report) == ["v1", "v2", "v5"]
    assert {s.version: s.status for s in report.sets} == {"v1": "present", "v2": "copied", "v5": "present"}


def test_an_unreachable_primary_api_still_replicates_the_models_volume_and_says_so(primary):
    for v in ("v1", "v2", "v3", "v4"):
        primary.publish(v)
    primary.serve("v1")
    primary.unreachable()

    report = primary.replicate(keep=3)
    assert _models(report) == ["v2", "v3", "v4"]  # by publish time alone
    assert {s.status for s in report.sets} == {"copied"}
    [problem] = report.all_problems
    assert (problem.kind, problem.name, problem.key) == ("model", ENDPOINT, "serving cluster dc-k8s")
    assert "cannot tell which version serves now" in problem.what and "MaxRetryError" in problem.what
    assert report.to_dict()["problems"] == [problem.to_dict()]
    # Every call was bounded: a primary that does not answer at all cannot hold the pass.
    assert primary.timeouts() and all(t for t in primary.timeouts())

    # Answering again: the next pass adds the version that serves.
    primary.unreachable(False)
    again = primary.replicate(keep=3)
    assert again.all_problems == []
    assert {s.version: s.status for s in again.sets} == {"v1": "copied", "v4": "present", "v3": "present"}


def test_a_served_version_missing_from_the_models_volume_is_reported(primary):
    for v in ("v1", "v2", "v3"):
        primary.publish(v)
    primary.serve("v3")
    shutil.rmtree(primary.models / ENDPOINT / "v3")  # removed from the volume by hand while it serves

    report = primary.replicate(keep=3)
    assert _models(report) == ["v1", "v2"]
    [problem] = report.all_problems
    assert problem.name == ENDPOINT and "version v3 serves, but it is not on the models volume" in problem.what


def _k8s_dr(**serving) -> dict:
    cluster = _dr_cluster(backend="kubernetes", conn_id="k8s_dr_west", scheduler="volcano",
                          image="registry.local/hybridflow-train:1", checkpoint_store="cache",
                          checkpoint_replica="scratch", scratch_claim="dr-scratch", scratch_dir="/scratch")
    if serving:
        cluster["dr"]["serving"] = serving
    return cluster


@pytest.mark.parametrize("kind", KINDS)
def test_readiness_names_a_missing_dr_serving_and_a_floating_serving_image(tmp_path: Path, kind: str) -> None:
    estate = _estate(tmp_path / "a", kind, dr=_k8s_dr())
    [missing] = check_readiness(estate.clusters["dr-west"], estate, lookup=lambda _id: None)
    assert missing.field == "clusters.dr-west.dr.serving"
    assert f"serving.target {'kubernetes' if kind == 'deployment' else kind}" in missing.what
    assert all(key in missing.fix for key in ("node_pool", "models_claim", "models_dir"))

    pool = {"node_pool": "a100", "models_claim": "dr-models", "models_dir": "/mnt/dr-models"}
    estate = _estate(tmp_path / "b", kind, dr=_k8s_dr(**pool))
    assert check_readiness(estate.clusters["dr-west"], estate, lookup=lambda _id: None) == []

    for image in ("registry.local/hybridflow-serve", "registry.local:5000/hybridflow-serve:latest"):
        estate = _estate(tmp_path / image.replace("/", "_"), kind, dr=_k8s_dr(**pool), image=image)
        [floating] = check_readiness(estate.clusters["dr-west"], estate, lookup=lambda _id: None)
        assert floating.field == "serving.kubernetes.image" and image in floating.what
    pinned = "registry.local:5000/hybridflow-serve@sha256:" + "a" * 64
    estate = _estate(tmp_path / "d", kind, dr=_k8s_dr(**pool), image=pinned)
    assert check_readiness(estate.clusters["dr-west"], estate, lookup=lambda _id: None) == []


def test_a_local_dr_cluster_needs_no_inference_pool(tmp_path: Path) -> None:
    estate = _estate(tmp_path, "kserve")  # dr-west has backend local: it serves through the model gateway
    assert check_readiness(estate.clusters["dr-west"], estate, lookup=lambda _id: None) == []


def test_a_version_in_several_variants_is_replicated_as_it_serves(primary, tmp_path):
    primary.publish("v1", "fp32")
    primary.publish("v1", "int8")  # published after fp32
    primary.serve("v1", "fp32")

    report = primary.replicate(keep=3)
    assert report.all_problems == [] and _models(report) == ["v1"]
    [manifest] = model_manifests(primary.dr, ENDPOINT)
    fetch_bundle(primary.dr, manifest, tmp_path / "fetched")
    # KServe records the variant it serves; the Deployment target does not, so the newest publish goes.
    assert read_card(tmp_path / "fetched").variant == ("fp32" if primary.kind == "kserve" else "int8")


def test_configured_endpoints_are_the_ones_published_on_the_models_volume(primary):
    from hybridflow.dr.replication.task import configured_scope

    primary.publish("v1")
    doc = yaml.safe_load((primary.tmp / "config" / "clusters.yaml").read_text())
    doc["clusters"]["dr-west"]["dr"]["replicate"] = {"endpoints": ["digits", "breast-cancer"]}
    (primary.tmp / "config" / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    estate = load_estate(primary.tmp / "config", use_cache=False)
    # breast-cancer was never deployed: nothing of it to copy, left out rather than refused.
    assert configured_scope(estate.clusters["dr-west"], primary.settings, estate=estate) == (["digits"], None)


def test_a_kserve_target_without_its_inference_pool_is_refused_by_field(tmp_path: Path) -> None:
    config = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config, dirs_exist_ok=True)
    doc = yaml.safe_load((config / "clusters.yaml").read_text())
    doc["clusters"]["dr-west"] = _dr_cluster()
    (config / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["serving"]["target"] = "kserve"
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    estate = load_estate(config, use_cache=False)
    store = LocalObjectStore(tmp_path / "dr-store")
    with pytest.raises(ReplicationError, match=r"^serving.kubernetes: not set, but serving.target is kserve"):
        replicate(estate, Settings(home=tmp_path / "home", config_dir=config), store=store, runs=[])
    assert list(store.list("")) == []


def _k8s_training_estate(tmp_path: Path, monkeypatch, bucket: str) -> Estate:
    """The shipped estate with onprem-a on Kubernetes (Connection k8s_dc1, Volcano), its checkpoints
    in its cache bucket ``bucket``, and dr-west a local DR cluster."""
    from tests.unit.test_dr_replication import _estate as dr_estate

    shipped = yaml.safe_load((REPO_ROOT / "config" / "clusters.yaml").read_text())["clusters"]["onprem-a"]
    primary = as_kubernetes(shipped, conn_id="k8s_dc1", scheduler="volcano",
                            cache={"conn_id": "k8s_dc1_store", "bucket": bucket})
    monkeypatch.setenv("AIRFLOW_CONN_K8S_DC1", "kubernetes://")
    return dr_estate(tmp_path, _dr_cluster(), **{"onprem-a": primary})


def test_a_pass_finds_critical_training_running_on_a_kubernetes_cluster(tmp_path: Path, monkeypatch,
                                                                         rclone_s3) -> None:
    from tests.support.k8s_sim import SimCluster, install_clusters
    from tests.unit.test_dr_replication import DATASET, RUN, Home

    from hybridflow.backends import gang_backend
    from hybridflow.backends.base import GangJob
    from hybridflow.backends.k8s.manifests import gang_job_name
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.dr.replication.layout import checkpoint_prefix
    from hybridflow.placement.places import checkpoint_store_spec
    from hybridflow.storage.objectstore import open_store
    from hybridflow.storage.s3 import S3ObjectStore
    from hybridflow.training.attempts import ATTEMPTS_FILE, start_attempt
    from hybridflow.training.checkpoint import CheckpointStore

    endpoint, access, secret, _data = rclone_s3
    bucket = f"hf-dr-k8s-{os.getpid()}-{tmp_path.name[-12:]}".lower().replace("_", "-")
    S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    monkeypatch.setenv("AIRFLOW_CONN_K8S_DC1_STORE", airflow_conn_uri(access, secret, endpoint))
    estate = _k8s_training_estate(tmp_path, monkeypatch, bucket)
    sim = SimCluster({})
    install_clusters(monkeypatch, {"k8s_dc1": sim})
    home = Home(tmp_path)
    home.write_data("1,0\n2,1")
    home.pin()  # the critical run's dataset version
    home.serve(ENDPOINT, "v1", b"weights-1")

    # Both runs train on onprem-a as Volcano gang jobs, each with checkpoints committed in its cache bucket.
    onprem = estate.clusters["onprem-a"]
    backend = gang_backend(onprem, estate, home.settings.state_dir)
    normal = "train-run-normal"
    steps = {RUN: (10, 20), normal: (5, 30)}
    for run, priority in ((RUN, "critical"), (normal, "normal")):
        gang = gang_job_name("train_model", run, "train", onprem.name, readable=f"train-{run}")
        job = GangJob(name=gang, workers=2, spec={"run_key": run}, labels={"project": "digits-ocr",
                                                                         "team": "perception", "priority": priority})
        backend.submit_spec(backend.gang_spec(job, pool="a100", queue=estate.queue_of("perception")))
        start_attempt(home.settings.private_root / "runs" / run / ATTEMPTS_FILE, 1, "try-1", 2, onprem.name,
                      gang=gang)
        place = CheckpointStore(open_store(checkpoint_store_spec(run, onprem, home.settings)))
        for step in steps[run]:
            place.save(step, {"model.pt": f"{run}-{step}".encode()})
    sim.run(2)
    assert len(backend.find_gangs({})) == 2  # both gangs unfinished on the cluster

    report = replicate(estate, home.settings, store=home.dr)
    assert report.all_problems == []
    assert {(s.kind, s.name, s.version, s.status) for s in report.sets if s.kind == "checkpoint"} == {
        ("checkpoint", RUN, "20", "copied")}
    assert {s.kind for s in report.sets} == {"checkpoint", "dataset", "model"}
    # The DR copy is the newest checkpoint, whole: it loads back from the DR store, every shard verified.
    copied = CheckpointStore(LocalObjectStore(home.dr.root / checkpoint_prefix(RUN)))
    assert copied.committed_steps() == [20] and copied.load(20).shards == {"model.pt": f"{RUN}-20".encode()}
    assert not any(i.key.startswith(f"checkpoints/{normal}") for i in home.dr.list("checkpoints/"))

    # The primary's API server does not answer: the cluster is reported by name and no checkpoint goes
    # (not even the critical run's newer one); what lives elsewhere is still replicated.
    CheckpointStore(open_store(checkpoint_store_spec(RUN, onprem, home.settings))).save(30, {"model.pt": b"30"})
    home.write_data("1,0\n2,1\n3,0")
    version = home.pin()
    home.serve(ENDPOINT, "v2", b"weights-2")
    sim.unreachable = True
    down = replicate(estate, home.settings, store=home.dr)
    [problem] = down.all_problems
    assert (problem.kind, problem.name) == ("cluster", "onprem-a")  # the cluster at fault, not the DR one
    assert "cannot list its critical gangs" in problem.what
    assert "MaxRetryError" in problem.what and sim.requests and all(t for _, t in sim.requests)  # every call bounded
    assert not any(s.kind == "checkpoint" for s in down.sets)
    assert {(s.kind, s.name, s.version, s.status) for s in down.sets if s.status == "copied"} == {
        ("dataset", DATASET, version, "copied"), ("model", ENDPOINT, "v2", "copied")}
    assert copied.committed_steps() == [20]
