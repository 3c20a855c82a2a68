"""DR drills: a real minimum-scale takeover from the replicated data with the primary's storage gone,
its RTO/RPO figures, a missed target failing by step, failback leaving nothing on the DR side, and
bad input changing nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from hybridflow.config import load_estate
from hybridflow.dr.drills import drill as drills
from hybridflow.dr.drills.report import (
    DrillError,
    DrillMissed,
    Targets,
    history,
    judge,
    read_report,
    report_path,
)
from hybridflow.fencing import down_clusters, read_fence, state_path
from hybridflow.settings import REPO_ROOT, Settings

SHIPPED = REPO_ROOT / "config"


@pytest.fixture(autouse=True)
def ledger(tmp_path: Path, monkeypatch):
    """Each test's own ledger: a judged drill is recorded there."""
    from sqlalchemy import create_engine

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    engine = create_engine(url)
    yield engine
    engine.dispose()
RUN = "train-run-0007"
MODEL = "digits-mlp"


def _config(tmp_path: Path, bucket: str | None = "hf-dr-drill", **changes) -> Path:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    if bucket is not None:
        doc = yaml.safe_load((target / "clusters.yaml").read_text())
        doc["clusters"]["dr-west"] = {
            "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
            "dr": {"min_gpus": 1}, "prices": {"onprem": 0.5},
            "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 2}],
            "cache": {"conn_id": "hybridflow_dr_west", "bucket": bucket}, **changes,
        }
        (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return target


# -- the measuring and judging -------------------------------------------------------------------
def _report(**changes) -> dict:
    report = {"declared_ts": 1000.0, "primary_step": 60, "checkpoint_interval_steps": 10,
              "targets": Targets().to_dict(), "inference": {"healthy_ts": 1012.5},
              "training": {"resumed_step": 50, "stepping_ts": 1030.0}, "dataset": {"age_s": 3600.0}}
    report.update(changes)
    return report


def test_figures_are_measured_from_the_declaration_and_targets_met_pass() -> None:
    figures, missed = judge(_report())
    assert figures == {"inference_rto_s": 12.5, "training_rto_s": 30.0, "rpo_steps_lost": 10,
                       "rpo_dataset_age_s": 3600.0}
    assert missed == []


def test_each_missed_target_names_the_step_that_took_too_long() -> None:
    slow = _report(inference={"healthy_ts": 1075.0}, training={"resumed_step": 30, "stepping_ts": 1121.0},
                   targets={**Targets().to_dict(), "dataset_age_s": 600.0})
    _, missed = judge(slow)
    assert missed == [
        "inference: serving the replicated model on the DR cluster: took 75.0 s after the declaration, target "
        "inference_rto_s <= 60 s",
        "training: resuming from the replicated checkpoint on the DR cluster: took 121.0 s after the declaration, "
        "target training_rto_s <= 120 s",
        "replication of checkpoints: 30 training steps lost, target rpo_steps <= 10 (one checkpoint interval)",
        "replication of datasets: the newest DR dataset version is 3600 s old, target dataset_age_s <= 600"]
    _, never = judge(_report(training={"resumed_step": 50}))
    assert never == ["training: resuming from the replicated checkpoint on the DR cluster: never got there "
                     "(training_rto_s not measured; see the take_over task's log)"]


def test_a_missed_target_fails_the_judging_step_and_is_kept_in_the_report_and_the_ledger(tmp_path: Path,
                                                                                          ledger) -> None:
    settings = Settings(home=tmp_path / "home", config_dir=_config(tmp_path))
    estate = load_estate(settings.config_dir, use_cache=False)
    plan = drills.make_plan(estate, "d1", {"inference_rto_s": 5}, dr_spec=object())
    drills.update_report(settings.private_root, "d1", **_report(targets=plan.targets.to_dict()))
    with pytest.raises(DrillMissed, match=r"drill d1 missed its targets:\n  - inference: serving the replicated "
                                          r"model on the DR cluster: took 12.5 s after the declaration, target "
                                          r"inference_rto_s <= 5 s$"):
        drills.finish(plan, estate, settings)
    kept = read_report(settings.private_root, "d1")
    assert kept["verdict"] == "missed" and kept["figures"]["inference_rto_s"] == 12.5
    from hybridflow.dr.drills.ledger import drill_history

    assert drill_history(ledger) == [kept]
    assert [r["drill"] for r in history(settings.private_root)] == ["d1"]


def test_bad_input_is_refused_by_name_and_changes_nothing(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", config_dir=_config(tmp_path))
    estate = load_estate(settings.config_dir, use_cache=False)
    shipped = load_estate(SHIPPED, use_cache=False)
    with pytest.raises(DrillError, match=r"^dr_cluster: no cluster in clusters.yaml has role: dr"):
        drills.make_plan(shipped, "d", {})
    with pytest.raises(DrillError, match=r"^primary: cluster 'nowhere' is not in clusters.yaml"):
        drills.make_plan(estate, "d", {"primary": "nowhere"}, dr_spec=object())
    with pytest.raises(DrillError, match=r"^primary: cluster 'dr-west' is the disaster-recovery pool"):
        drills.make_plan(estate, "d", {"primary": "dr-west"}, dr_spec=object())
    with pytest.raises(DrillError, match=r"^primary: cloud-east has role elastic: a drill takes over from a primary; "
                                         r"name one with role primary \(onprem-a\)"):
        drills.make_plan(estate, "d", {"primary": "cloud-east"}, dr_spec=object())
    with pytest.raises(DrillError, match=r"^dr_cluster: 'onprem-a' has role primary, not dr"):
        drills.make_plan(estate, "d", {"dr_cluster": "onprem-a"}, dr_spec=object())
    with pytest.raises(DrillError, match=r"^inference_rto_s: 'soon' is not a number"):
        drills.make_plan(estate, "d", {"inference_rto_s": "soon"}, dr_spec=object())
    with pytest.raises(DrillError, match=r"^workers: 3: the DR cluster dr-west has 2 GPUs"):
        drills.make_plan(estate, "d", {"workers": 3}, dr_spec=object())
    k8s = load_estate(_config(tmp_path / "k8s", backend="kubernetes", conn_id="k8s_dr", scheduler="volcano",
                              image="reg.example/train:1", checkpoint_store="cache", checkpoint_replica="scratch",
                              scratch_claim="dr-scratch", scratch_dir="/scratch"), use_cache=False)
    # A kubernetes DR cluster is drilled too (tests/unit/test_dr_drill_k8s.py); its gang needs one node pool.
    assert drills.make_plan(k8s, "d", {}, dr_spec=object()).dr.backend == "kubernetes"
    # A primary down for a real outage is never drilled (a drill would fail it back).
    from hybridflow.fencing import declare_down

    declare_down("onprem-a", "power loss in dc-1", estate=estate, path=state_path(settings.state_dir))
    plan = drills.make_plan(estate, "d", {}, dr_spec=object())
    with pytest.raises(DrillError, match=r"^primary: onprem-a is declared down already \(power loss in dc-1"):
        drills.declare(plan, estate, settings)
    assert [e["event"] for e in read_fence(state_path(settings.state_dir))["history"]] == ["down"]
    assert not (settings.private_root / "drills").exists()


# -- one real drill ------------------------------------------------------------------------------
def _primary_with_replicas(settings: Settings, estate) -> None:
    """A critical run of the registered model trained for real on the primary, its model served, and
    the dataset version, the model and the run's newest checkpoint replicated to the DR store."""
    from tests.support.jobs import job_spec, seed_example

    from hybridflow.backends.local import GangJob, LocalGangBackend
    from hybridflow.bundle import ModelCard, write_bundle
    from hybridflow.dr.replication.replicate import replicate
    from hybridflow.dr.replication.scope import CriticalRun
    from hybridflow.placement.places import checkpoint_replica_spec, checkpoint_store_spec
    from hybridflow.storage.objectstore import LocalObjectStore
    from hybridflow.training.checkpoint import CheckpointStore
    from hybridflow.training.context import FINAL_MODEL_KEY

    seeded = seed_example(settings.private_root, MODEL)
    (settings.private_root / "runs" / RUN).mkdir(parents=True)
    shutil.copy(seeded.version_path, settings.private_root / "runs" / RUN / "dataset-version.json")
    primary = estate.clusters["onprem-a"]
    ckpt = Path(checkpoint_store_spec(RUN, primary, settings).root)
    spec = job_spec(seeded, ckpt, hparams={"steps": 40}, checkpoint_every_steps=10, keep=3, log_every_steps=10,
                    replica_root=Path(checkpoint_replica_spec(RUN, primary, settings).root), run_key=RUN)
    LocalGangBackend(settings.state_dir, "onprem-a", 4).run(GangJob(name=f"train-{RUN}", workers=1, spec=spec),
                                                            admission_timeout_s=30, log=lambda _: None)
    weights = LocalObjectStore(ckpt).get_bytes(FINAL_MODEL_KEY)
    bundle = write_bundle(settings.private_root / "runs" / RUN / "model", weights,
                          ModelCard(**seeded.model.card(), hyperparameters=seeded.model.defaults(), variant="fp32",
                                    version=RUN))
    edir = settings.state_dir / "serving" / "digits"
    (edir / "versions").mkdir(parents=True)
    (edir / "versions" / f"{RUN}.json").write_text(json.dumps({"version": RUN, "bundle": str(bundle), "model": MODEL}))
    (edir / "active.json").write_text(json.dumps({"version": RUN}))
    report = replicate(estate, settings, runs=[CriticalRun(RUN, "onprem-a", f"train-{RUN}")])
    assert report.all_problems == [] and {s.kind for s in report.sets} == {"dataset", "model", "checkpoint"}
    # The primary trains on after the last replication pass: one more checkpoint the DR side lacks.
    newest = CheckpointStore(LocalObjectStore(ckpt)).latest()
    CheckpointStore(LocalObjectStore(ckpt)).save(50, newest.shards, dict(newest.meta))


def test_a_drill_takes_over_from_the_replicated_data_with_the_primary_s_storage_gone_and_fails_back(
        tmp_path: Path, rclone_s3, monkeypatch) -> None:
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.storage.s3 import S3ObjectStore

    endpoint, access, secret, _data_dir = rclone_s3
    bucket = f"hf-drill-{os.getpid()}-{tmp_path.name[-12:]}".lower().replace("_", "-")
    S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", airflow_conn_uri(access, secret, endpoint))
    settings = Settings(home=tmp_path / "home", config_dir=_config(tmp_path, bucket))
    estate = load_estate(settings.config_dir, use_cache=False)
    _primary_with_replicas(settings, estate)

    plan = drills.make_plan(estate, "drill-1", {"extra_steps": 8})
    declared = drills.declare(plan, estate, settings, by="ops")
    assert declared["primary_step"] == 50 and declared["checkpoint_interval_steps"] == 10
    assert down_clusters(state_path(settings.state_dir))["onprem-a"]["reason"].startswith("dr drill drill-1")
    # The primary's storage is gone: its checkpoints, its scratch, the served bundle and the dataset.
    for gone in ("checkpoints", "runs", "datasets"):
        (settings.private_root / gone).rename(tmp_path / f"lost-{gone}")
    shutil.rmtree(settings.home / "scratch" / "onprem-a")

    taken = drills.take_over(plan, estate, settings)
    assert taken["status"] == "taken over", taken
    assert taken["inference"]["version"] == RUN and isinstance(taken["inference"]["prediction"], int)
    assert taken["training"]["resumed_step"] == 40 and taken["training"]["stepping_step"] > 40
    assert taken["training"]["checkpoint_place"].startswith(f"s3://{bucket}/drills/drill-1/")

    back = drills.fail_back(plan, estate, settings, by="ops")
    assert back["failback"]["dr_still_running"] == [] and "onprem-a" not in down_clusters(state_path(settings.state_dir))
    assert not Path(f"/proc/{taken['inference']['pid']}").exists()
    again = drills.fail_back(plan, estate, settings)  # cleared and run again: still up, nothing on DR
    assert again["failback"]["primary_up"]["changed"] is False

    done = drills.finish(plan, estate, settings)
    figures = done["figures"]
    assert done["verdict"] == "met" and done["missed"] == []
    assert 0 < figures["inference_rto_s"] <= 60 and 0 < figures["training_rto_s"] <= 120
    assert figures["rpo_steps_lost"] == 10 and figures["rpo_dataset_age_s"] is not None
    assert report_path(settings.private_root, "drill-1").is_file()
    # Nothing of the drill touched the replicated sets: the DR store still reconciles with no drift.
    from hybridflow.dr.replication.reconcile import reconcile
    from hybridflow.placement.places import cache_store_spec
    from hybridflow.storage.objectstore import open_store

    assert reconcile(open_store(cache_store_spec(estate.clusters["dr-west"]))).drift == []


def test_a_declaration_whose_drain_fails_is_failed_back_leaving_the_primary_up(tmp_path: Path, rclone_s3,
                                                                                monkeypatch) -> None:
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.dr.fencing.drain import DrainIncomplete
    from hybridflow.storage.s3 import S3ObjectStore

    endpoint, access, secret, _data_dir = rclone_s3
    bucket = f"hf-drill-{os.getpid()}-{tmp_path.name[-12:]}".lower().replace("_", "-")
    dr = S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret)
    dr.ensure_bucket()
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", airflow_conn_uri(access, secret, endpoint))
    settings = Settings(home=tmp_path / "home", config_dir=_config(tmp_path, bucket))
    estate = load_estate(settings.config_dir, use_cache=False)
    # The DR store holds the run's checkpoint, and a model manifest cut short; the gateway serves digits.
    dr.put_bytes(f"checkpoints/{RUN}/step-10/MANIFEST.json", b"{}")
    dr.put_bytes("models/digits/v1/MANIFEST.json", b'{"version": "v1", "objects": [')
    edir = settings.state_dir / "serving" / "digits"
    edir.mkdir(parents=True)
    (edir / "active.json").write_text(json.dumps({"version": "v1", "url": "http://127.0.0.1:9"}))

    plan = drills.make_plan(estate, "drill-3", {})
    with pytest.raises(DrainIncomplete, match=r"endpoint digits: JSONDecodeError"):
        drills.declare(plan, estate, settings, by="ops")
    fence = state_path(settings.state_dir)
    assert down_clusters(fence)["onprem-a"]["reason"].startswith("dr drill drill-3")
    # fail_back (it runs whatever happened before) lifts the drill's fence: the primary is not left down.
    back = drills.fail_back(plan, estate, settings, by="ops")
    assert back["failback"]["primary_up"]["changed"] and "onprem-a" not in down_clusters(fence)
    assert [e["event"] for e in read_fence(fence)["history"]] == ["down", "up"]
    with pytest.raises(DrillError, match=r"^declare_down: drill drill-3 did not declare onprem-a down "
                                         r"\(DrainIncomplete: onprem-a is declared down"):
        drills.finish(plan, estate, settings)


def test_the_dag_steps_fail_without_retry_naming_the_param_and_a_drill_never_declared_keeps_no_report(
        tmp_path: Path, monkeypatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.dr.drills.task import declare_task, fail_back_task, judge_task

    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(SHIPPED))
    with pytest.raises(AirflowFailException, match=r"^dr drill: dr_cluster: no cluster in clusters.yaml has role"):
        declare_task({}, "manual__1")
    settings = Settings(home=tmp_path / "home", config_dir=_config(tmp_path))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(settings.config_dir))
    with pytest.raises(AirflowFailException, match=r"^dr drill: clusters.dr-west.cache.conn_id: Airflow Connection "
                                                   r"hybridflow_dr_west does not exist; add Airflow Connection"):
        declare_task({}, "manual__1")
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", "aws://key:secret@?endpoint_url=http%3A%2F%2F127.0.0.1%3A9")
    # declare_down failed (say, the primary was down for real): fail_back touches nothing, judge keeps nothing.
    fail_back_task({}, "manual__1")
    with pytest.raises(AirflowFailException, match=r"^declare_down: drill manual__1 did not declare onprem-a down"):
        judge_task({}, "manual__1")
    assert read_fence(state_path(settings.state_dir))["history"] == []
    assert not (settings.private_root / "drills").exists()
