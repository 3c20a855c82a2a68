"""Replication ahead of need into a DR cluster's store, and its daily reconciliation: incremental,
add-only, verified, a bad source never propagated, at least three versions kept, bad input refused.

The DR store and every source are folders (the object-store contract's local kind)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from tests.unit.test_local_backend import _in_thread, _wait_for, fake_worker  # noqa: F401 - fixture

from hybridflow.config import Estate, load_estate
from hybridflow.datasets import pin_version
from hybridflow.dr.replication.readiness import check_readiness
from hybridflow.dr.replication.reconcile import reconcile
from hybridflow.dr.replication.replicate import healthy_sources, replicate
from hybridflow.dr.replication.scope import CriticalRun, NoDrCluster, ReplicationError
from hybridflow.errors import ConfigError
from hybridflow.settings import REPO_ROOT, Settings
from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training.checkpoint import CheckpointStore

SHIPPED = REPO_ROOT / "config"
DATASET = "digits"  # a catalogue entry living at private://datasets/digits, classification internal
RUN = "train-run-0001"


def _dr_cluster(**changes) -> dict:
    cluster = {
        "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
        "dr": {"min_gpus": 2}, "prices": {"onprem": 0.5},
        "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 4}],
        "cache": {"conn_id": "hybridflow_dr_west", "bucket": "hf-dr-west"},
    }
    cluster.update(changes)
    return cluster


def _estate(tmp_path: Path, dr: dict | None = None, **others: dict) -> Estate:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target, dirs_exist_ok=True)
    doc = yaml.safe_load((target / "clusters.yaml").read_text())
    if dr is not None:
        doc["clusters"]["dr-west"] = dr
    doc["clusters"].update(others)
    (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_estate(target, use_cache=False)


class Home:
    """A platform home with a dataset, its validated versions, a served endpoint and a running run."""

    def __init__(self, tmp_path: Path) -> None:
        self.settings = Settings(home=tmp_path / "home", config_dir=tmp_path / "config")
        self.data = self.settings.private_root / "datasets" / DATASET
        self.data.mkdir(parents=True)
        self.pins = 0
        self.dr = LocalObjectStore(tmp_path / "dr-store")

    def write_data(self, rows: str) -> None:
        (self.data / "train.csv").write_text(f"a,label\n{rows}\n")
        (self.data / "test.csv").write_text("a,label\n9,1\n")

    def pin(self, dataset: str = DATASET, classification: str = "internal") -> str:
        """What validate_data pins: the SHA-256 of every file as it is now, in a new run's folder."""
        self.pins += 1
        digests = {p.name: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
                   for p in sorted(self.data.iterdir())}
        version = pin_version(dataset, classification, f"private://datasets/{dataset}", {"train": ["train.csv"]},
                              digests)
        # The first pin is the running critical run's: it trains on that version.
        run = RUN if self.pins == 1 else f"run-{self.pins:04d}"
        path = self.settings.private_root / "runs" / run / "dataset-version.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(version.to_json())
        os.utime(path, (1_000_000 + self.pins, 1_000_000 + self.pins))  # pins in the order made
        return version.version

    def serve(self, endpoint: str, version: str, weights: bytes) -> Path:
        bundle = self.settings.private_root / "runs" / version / "model"
        bundle.mkdir(parents=True)
        (bundle / "weights.pt").write_bytes(weights)
        (bundle / "model.json").write_text(json.dumps({"model": "digits-mlp", "version": version}))
        edir = self.settings.state_dir / "serving" / endpoint
        (edir / "versions").mkdir(parents=True, exist_ok=True)
        record = {"version": version, "bundle": str(bundle), "model": "digits-mlp", "started_at": version}
        (edir / "versions" / f"{version}.json").write_text(json.dumps(record))
        (edir / "active.json").write_text(json.dumps({"version": version}))
        return bundle

    def checkpoint(self, step: int, payload: bytes) -> Path:
        root = self.settings.private_root / "checkpoints" / RUN
        CheckpointStore(LocalObjectStore(root)).save(step, {"model.pt": payload})
        return root / f"step-{step:09d}" / "model.pt"

    def snapshot(self) -> dict[str, bytes]:
        return {i.key: self.dr.get_bytes(i.key) for i in self.dr.list("")}


@pytest.fixture
def home(tmp_path: Path) -> Home:
    h = Home(tmp_path)
    h.write_data("1,0\n2,1")
    return h


@pytest.fixture
def estate(tmp_path: Path) -> Estate:
    return _estate(tmp_path, _dr_cluster())


def _replicate(estate: Estate, home: Home, **kwargs):
    kwargs.setdefault("runs", [CriticalRun(RUN, "onprem-a", f"train-{RUN}")])
    return replicate(estate, home.settings, store=home.dr, **kwargs)


def test_a_second_pass_copies_nothing_and_the_dr_side_is_a_usable_copy(estate: Estate, home: Home) -> None:
    version = home.pin()
    home.serve("digits", "v1", b"weights-1")
    home.checkpoint(10, b"step-10")
    home.checkpoint(20, b"step-20")

    first = _replicate(estate, home)
    assert first.all_problems == []
    assert {(s.kind, s.name, s.version, s.status) for s in first.sets} == {
        ("dataset", DATASET, version, "copied"), ("model", "digits", "v1", "copied"),
        ("checkpoint", RUN, "20", "copied")}
    assert first.objects_copied == 5  # two data files, two bundle files, one shard
    before = home.snapshot()

    second = _replicate(estate, home)
    assert second.objects_copied == 0 and second.bytes_copied == 0
    assert {s.status for s in second.sets} == {"present"}
    assert home.snapshot() == before
    # A takeover reads what it needs: the newest checkpoint loads (verified) from the DR side.
    latest = CheckpointStore(LocalObjectStore(home.dr.root / "checkpoints" / RUN)).latest()
    assert latest is not None and latest.step == 20 and latest.shards["model.pt"] == b"step-20"
    assert reconcile(home.dr).drift == []


def test_the_dr_side_is_add_only(estate: Estate, home: Home) -> None:
    home.pin()
    bundle = home.serve("digits", "v1", b"weights-1")
    home.checkpoint(10, b"step-10")
    _replicate(estate, home)
    before = home.snapshot()

    # The source changes under an already replicated version, then loses everything.
    (bundle / "weights.pt").write_bytes(b"overwritten")
    _replicate(estate, home)
    assert home.snapshot() == before
    shutil.rmtree(home.data)
    shutil.rmtree(home.settings.private_root / "checkpoints")
    shutil.rmtree(bundle)
    _replicate(estate, home)
    assert home.snapshot() == before
    # A version already replicated is never rewritten: its DR copy stays what was first copied.
    assert home.dr.get_bytes("models/digits/v1/weights.pt") == b"weights-1"


def test_a_changed_or_missing_source_object_is_reported_and_not_propagated(estate: Estate, home: Home) -> None:
    home.pin()
    home.checkpoint(10, b"step-10")
    _replicate(estate, home)
    before = home.snapshot()

    # A new validated version, then its file changes before replication; the newest checkpoint's
    # shard is corrupted and a served bundle lost its weights.
    home.write_data("1,0\n2,1\n3,0")
    new = home.pin()
    (home.data / "train.csv").write_text("a,label\n1,0\n2,1\n3,1\n")
    home.checkpoint(20, b"step-20").write_bytes(b"bit rot!")
    bundle = home.serve("digits", "v2", b"weights-2")
    (bundle / "weights.pt").unlink()

    report = _replicate(estate, home)
    problems = {p.kind: p for p in report.all_problems}
    assert set(problems) == {"dataset", "checkpoint", "model"}
    assert "no longer matches its manifest" in problems["dataset"].what and "train.csv" in problems["dataset"].what
    assert "step-000000020" in problems["checkpoint"].key and "corrupt" in problems["checkpoint"].what
    assert problems["model"].key == "models/digits/v2/weights.pt" and "missing" in problems["model"].what
    statuses = {(s.kind, s.version): s.status for s in report.sets}
    assert statuses[("dataset", new)] == "incomplete" and statuses[("model", "v2")] == "incomplete"
    after = home.snapshot()
    # Nothing the DR side had changed, no manifest of a bad set appeared, no bad bytes were copied.
    assert all(after[k] == v for k, v in before.items())
    assert f"datasets/{DATASET}/versions/{new}.json" not in after
    assert "models/digits/v2/MANIFEST.json" not in after
    assert not any(k.startswith(f"checkpoints/{RUN}/step-000000020") for k in after)
    assert b"a,label\n1,0\n2,1\n3,1\n" not in after.values()


def test_at_least_three_versions_of_each_line_are_kept(estate: Estate, home: Home) -> None:
    versions = []
    for n in range(4):
        home.write_data("\n".join(f"{i},{i % 2}" for i in range(n + 2)))
        versions.append(home.pin())
        home.serve("digits", f"v{n}", f"weights-{n}".encode())
        _replicate(estate, home, runs=[])
    kept = {i.key for i in home.dr.list("datasets/") if "/versions/" in i.key}
    assert kept == {f"datasets/{DATASET}/versions/{v}.json" for v in versions}
    assert {i.key for i in home.dr.list("models/") if i.key.endswith("MANIFEST.json")} == {
        f"models/digits/v{n}/MANIFEST.json" for n in range(4)}
    assert reconcile(home.dr).drift == []
    with pytest.raises(ReplicationError, match=r"^keep: 2: the DR side keeps at least 3"):
        _replicate(estate, home, keep=2)


def test_reconciliation_repairs_drift_by_copying_and_never_from_a_bad_source(estate: Estate, home: Home) -> None:
    home.pin()
    home.serve("digits", "v1", b"weights-1")
    home.checkpoint(10, b"step-10")
    _replicate(estate, home)
    blob = next(i.key for i in home.dr.list(f"datasets/{DATASET}/blobs/")
                if home.dr.get_bytes(i.key).startswith(b"a,label\n1,0"))
    weights = "models/digits/v1/weights.pt"
    shard = f"checkpoints/{RUN}/step-000000010/model.pt"
    home.dr.put_bytes(blob, b"damaged")
    home.dr.delete(weights)
    home.dr.put_bytes(shard, b"damaged too")
    # The checkpoint's source is damaged as well: it cannot be the repair's source.
    home.checkpoint(10, b"step-10")
    (home.settings.private_root / "checkpoints" / RUN / "step-000000010" / "model.pt").write_bytes(b"bad source")

    report = reconcile(home.dr, healthy_sources(estate, home.settings, runs=[CriticalRun(RUN, "onprem-a", "g")]))
    assert {(p.key, p.what.split(":")[0]) for p in report.drift} == {
        (blob, "corrupted"), (weights, "missing"), (shard, "corrupted")}
    assert sorted(report.repaired) == sorted([blob, weights])
    assert [p.key for p in report.unrepaired] == [shard]
    assert "no healthy source" in report.unrepaired[0].what
    assert home.dr.get_bytes(weights) == b"weights-1"
    assert home.dr.get_bytes(shard) == b"damaged too"  # left for an operator, never replaced by bad bytes
    again = reconcile(home.dr)
    assert [p.key for p in again.drift] == [shard]


def test_bad_input_is_refused_by_name_and_changes_nothing(tmp_path: Path, home: Home) -> None:
    home.pin()
    shipped = load_estate(SHIPPED, use_cache=False)
    with pytest.raises(NoDrCluster, match=r"^cluster: no cluster in clusters.yaml has role: dr"):
        replicate(shipped, home.settings, store=home.dr)
    estate = _estate(tmp_path, _dr_cluster())
    with pytest.raises(ReplicationError, match=r"^cluster: 'nowhere' is not in clusters.yaml; dr clusters: dr-west"):
        _replicate(estate, home, cluster="nowhere")
    with pytest.raises(ReplicationError, match=r"^cluster: 'onprem-a' has role primary, not dr"):
        _replicate(estate, home, cluster="onprem-a")
    with pytest.raises(ReplicationError, match=r"^datasets: nope not in datasets.yaml"):
        _replicate(estate, home, datasets=["nope"])
    with pytest.raises(ReplicationError, match=r"^endpoints: nope not served here"):
        _replicate(estate, home, endpoints=["nope"])
    with pytest.raises(ConfigError, match=r"clusters.dr-west.cache: a dr cluster needs cache"):
        _estate(tmp_path / "b", {k: v for k, v in _dr_cluster().items() if k != "cache"})
    assert list(home.dr.list("")) == []


def test_restricted_data_is_never_replicated_to_a_public_dr_store(tmp_path: Path, home: Home) -> None:
    public = _dr_cluster(location="public", region="us-east-1", jurisdiction="us", prices={"on_demand": 1.0},
                         dr={"min_gpus": 2, "public_reason": "the only other region we have"})
    estate = _estate(tmp_path, public)
    home.pin()
    home.pin("breast-cancer", "restricted")
    report = _replicate(estate, home, datasets=["breast-cancer"], runs=[])
    assert report.sets == []
    [problem] = report.all_problems
    assert problem.name == "breast-cancer" and "restricted" in problem.what and "not replicated" in problem.what
    assert list(home.dr.list("")) == []


def test_missing_connections_and_image_are_named_with_their_fix(tmp_path: Path) -> None:
    k8s = _dr_cluster(backend="kubernetes", conn_id="k8s_dr_west", scheduler="volcano", image="reg.example/train:1",
                      checkpoint_store="cache", checkpoint_replica="scratch", scratch_claim="dr-scratch",
                      scratch_dir="/scratch")
    estate = _estate(tmp_path, k8s)

    def lookup(conn_id: str) -> None:
        raise type("AirflowNotFoundException", (Exception,), {})(conn_id)

    missing = {m.field: m for m in check_readiness(estate.clusters["dr-west"], estate, lookup=lookup)}
    assert set(missing) == {"clusters.dr-west.cache.conn_id", "clusters.dr-west.conn_id"}
    store = missing["clusters.dr-west.cache.conn_id"]
    assert "hybridflow_dr_west does not exist" in store.what
    assert "airflow connections add hybridflow_dr_west --conn-type aws" in store.fix
    assert "kube_config" in missing["clusters.dr-west.conn_id"].fix
    assert check_readiness(estate.clusters["dr-west"], estate, lookup=lambda _id: None) == []
    # A primary on Kubernetes running another training image: a takeover would run other code.
    primary = {k: v for k, v in k8s.items() if k != "dr"} | {"role": "primary", "image": "reg.example/train:2",
                                                               "conn_id": "k8s_main"}
    estate = _estate(tmp_path / "b", k8s, **{"k8s-main": primary})
    [image] = check_readiness(estate.clusters["dr-west"], estate, lookup=lambda _id: None)
    assert image.field == "clusters.dr-west.image" and "reg.example/train:2" in image.what


def test_the_tasks_succeed_without_side_effects_when_no_dr_cluster_is_configured(tmp_path: Path,
                                                                                monkeypatch) -> None:
    from hybridflow.dr.replication.task import reconciliation_task, replication_task

    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(SHIPPED))
    assert replication_task(lookup=lambda _id: None)["status"] == "no dr cluster"
    assert reconciliation_task()["status"] == "no dr cluster"
    assert not (tmp_path / "home").exists()


def test_a_pass_finds_the_running_critical_training_by_itself(estate: Estate, home: Home, fake_worker) -> None:  # noqa: F811
    from hybridflow.backends import gang_backend
    from hybridflow.backends.base import GangJob
    from hybridflow.training.attempts import start_attempt

    home.pin()
    home.checkpoint(10, b"step-10")
    other = "train-run-normal"
    CheckpointStore(LocalObjectStore(home.settings.private_root / "checkpoints" / other)).save(5, {"m.pt": b"x"})
    backend = gang_backend(estate.clusters["onprem-a"], estate, home.settings.state_dir)
    gangs = {RUN: "critical", other: "normal"}
    threads = []
    for run, priority in gangs.items():
        start_attempt(home.settings.private_root / "runs" / run / "train-attempts.json", 1, "try-1", 1, "onprem-a",
                      gang=f"train-{run}")
        job = GangJob(name=f"train-{run}", workers=1, spec={}, env=fake_worker(30), labels={"priority": priority})
        threads.append(_in_thread(lambda job=job: backend.run(job, admission_timeout_s=10, log=lambda _: None)))
    try:
        assert _wait_for(lambda: len(backend.running_gangs()) == 2)
        report = replicate(estate, home.settings, store=home.dr)
    finally:
        for run in gangs:
            backend.cancel(f"train-{run}")
        for thread, _ in threads:
            thread.join(10)
    assert report.all_problems == []
    assert {(s.kind, s.name) for s in report.sets} == {("checkpoint", RUN), ("dataset", DATASET)}
    assert home.dr.exists(f"checkpoints/{RUN}/step-000000010/MANIFEST.json")
    assert not any(i.key.startswith(f"checkpoints/{other}") for i in home.dr.list("checkpoints/"))


def test_the_dag_tasks_replicate_into_the_dr_cluster_s_s3_store_through_its_connection(
        tmp_path: Path, home: Home, rclone_s3, monkeypatch) -> None:
    """The embedded default's shape: the DR store is an S3 endpoint reached through an Airflow Connection."""
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.dr.replication.task import DrNotReady, reconciliation_task, replication_task
    from hybridflow.storage.s3 import S3ObjectStore

    endpoint, access, secret, data_dir = rclone_s3
    bucket = f"hf-dr-{os.getpid()}-{tmp_path.name[-12:]}".lower().replace("_", "-")
    _estate(tmp_path, _dr_cluster(cache={"conn_id": "hybridflow_dr_west", "bucket": bucket}))
    S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", airflow_conn_uri(access, secret, endpoint))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home.settings.home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(home.settings.config_dir))
    home.pin()
    home.serve("digits", "v1", b"weights-1")

    first = replication_task()["clusters"][0]
    assert first["cluster"] == "dr-west" and first["problems"] == [] and first["readiness"] == []
    assert {(s["kind"], s["status"]) for s in first["sets"]} == {("dataset", "copied"), ("model", "copied")}
    landed = {p.relative_to(data_dir / bucket).as_posix() for p in (data_dir / bucket).rglob("*") if p.is_file()}
    assert "models/digits/v1/weights.pt" in landed and len(landed) == first["objects_copied"] + 2  # + 2 manifests
    assert replication_task()["clusters"][0]["objects_copied"] == 0
    assert reconciliation_task()["clusters"][0]["drift"] == []

    # A new served version whose weights went missing: the task fails naming it, after the rest was copied.
    bundle = home.serve("digits", "v2", b"weights-2")
    (bundle / "weights.pt").unlink()
    home.write_data("5,1")
    home.pin()
    with pytest.raises(DrNotReady, match=r"dr-west: model digits: models/digits/v2/weights.pt: missing at the source"):
        replication_task()
    after = {p.relative_to(data_dir / bucket).as_posix() for p in (data_dir / bucket).rglob("*") if p.is_file()}
    assert "models/digits/v2/MANIFEST.json" not in after
    assert len([k for k in after if "/versions/" in k]) == 2  # the new dataset version went over


def test_objects_bigger_than_one_read_are_checked_in_ranges(estate: Estate, home: Home, monkeypatch) -> None:
    import hybridflow.dr.replication.replicas as replicas

    monkeypatch.setattr(replicas, "CHUNK", 5)  # every object here spans several reads
    home.pin()
    home.serve("digits", "v1", b"weights-1")
    assert _replicate(estate, home, runs=[]).all_problems == []
    blobs = [i.key for i in home.dr.list(f"datasets/{DATASET}/blobs/")]
    assert sorted(home.dr.get_bytes(k) for k in blobs) == sorted(p.read_bytes() for p in home.data.iterdir())
    home.dr.put_bytes(blobs[0], home.dr.get_bytes(blobs[0])[:-1] + b"?")  # same size, last byte changed
    assert [(p.key, p.what.split(":")[0]) for p in reconcile(home.dr).drift] == [(blobs[0], "corrupted")]
