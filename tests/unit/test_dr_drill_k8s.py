"""DR drills on a Kubernetes DR cluster: the resumed run is a gang job of the DR cluster (simulated,
its pods real worker processes) training from the DR store, measured from the declaration;
fail_back finds the gang by the drill's name and deletes it, also one a dead task left running;
what cannot work is refused by name before anything changes."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from tests.support.dr_drill_k8s import KUBERNETES_DR, POOL, SERVING_NS, dr_simulator, serve_on_kubernetes
from tests.unit.test_dr_drill import RUN, _config, _primary_with_replicas, ledger  # noqa: F401 - ledger: a fixture

from hybridflow.backends import gang_backend
from hybridflow.config import load_estate
from hybridflow.dr.drills import drill as drills
from hybridflow.dr.drills.report import DrillError, read_report
from hybridflow.dr.drills.takeover import gang_name, start_training
from hybridflow.fencing import down_clusters, state_path
from hybridflow.settings import Settings

NS = "hybridflow"


def _settings(tmp_path: Path, bucket: str, **changes) -> Settings:
    config = _config(tmp_path, bucket, **{**KUBERNETES_DR, **changes})
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(kubernetes_poll_s=0.2, preemption_grace_s=10)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return Settings(home=tmp_path / "home", config_dir=config)


@pytest.fixture(scope="module")
def primary(tmp_path_factory, rclone_s3):
    """A critical run trained on the local primary onprem-a, its model served and everything
    replicated to dr-west's store (an S3 bucket); shared by this module's drills, each of which
    fails the primary back."""
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.storage.s3 import S3ObjectStore

    base = tmp_path_factory.mktemp("drill-k8s")
    endpoint, access, secret, _data_dir = rclone_s3
    bucket = f"hf-drill-k8s-{os.getpid()}-{base.name[-12:]}".lower().replace("_", "-")
    S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    conn = airflow_conn_uri(access, secret, endpoint)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", conn)
        mp.setenv("HYBRIDFLOW_LEDGER_URL", f"sqlite:///{base / 'ledger.db'}")
        settings = _settings(base, bucket)
        _primary_with_replicas(settings, load_estate(settings.config_dir, use_cache=False))
    return SimpleNamespace(base=base, bucket=bucket, settings=settings, conn=conn)


@pytest.fixture(autouse=True)
def _primary_up_afterwards(request):
    """A drill that failed half-way leaves the shared primary declared down: lift that fence, so the
    next drill of the module is not refused for it."""
    yield
    if "primary" not in request.fixturenames:
        return
    from hybridflow.dr.fencing.failback import declare_up

    settings = request.getfixturevalue("primary").settings
    path = state_path(settings.state_dir)
    if "onprem-a" in down_clusters(path):
        declare_up("onprem-a", by="test cleanup", estate=load_estate(settings.config_dir, use_cache=False), path=path)


def _until(condition, cluster, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not there in time; pods:\n{cluster.kubelet.logs()}"
        cluster.step()
        time.sleep(0.05)


def _judged(plan, estate, settings, training: dict) -> None:
    done = drills.finish(plan, estate, settings)
    figures = done["figures"]
    assert done["verdict"] == "met" and done["missed"] == [], done
    assert 0 < figures["inference_rto_s"] <= 60 and 0 < figures["training_rto_s"] <= 120
    assert figures["training_rto_s"] == pytest.approx(training["stepping_ts"] - done["declared_ts"], abs=0.01)
    assert figures["rpo_steps_lost"] == 10 and figures["rpo_dataset_age_s"] is not None


def test_a_drill_on_a_kubernetes_dr_cluster_resumes_training_there_and_fail_back_deletes_its_gang(
        primary, tmp_path: Path, monkeypatch) -> None:
    """serving.target local: the endpoint is served by the model server on this machine; the run
    resumes as a Volcano gang job of dr-west."""
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", primary.conn)
    settings = primary.settings
    estate = load_estate(settings.config_dir, use_cache=False)
    with dr_simulator(monkeypatch, tmp_path) as dr:
        plan = drills.make_plan(estate, "drill-k8s", {"extra_steps": 8})
        name = gang_name("drill-k8s", gang_backend(plan.dr, estate, settings.state_dir))
        drills.declare(plan, estate, settings, by="ops")

        taken = drills.take_over(plan, estate, settings)
        assert taken["status"] == "taken over", taken
        training = taken["training"]
        assert (training["cluster"], training["backend"], training["node_pool"], training["queue"]) == (
            "dr-west", "kubernetes", "a100", "perception")
        assert training["resumed_step"] == 40 and training["stepping_step"] > 40
        assert training["checkpoint_place"].startswith(f"s3://{primary.bucket}/drills/drill-k8s/")
        # The gang was a Volcano job of the DR cluster, its pods ran the worker, and the drill deleted it.
        assert f"create vcjob {name}" in dr.sim.calls and f"delete vcjob {name}" in dr.sim.calls
        assert [p for p in dr.kubelet.started if p.startswith(name)] and (NS, name) not in dr.sim.vcjobs
        # Ended by the drill's delete, or, on a loaded machine, by finishing its few steps just before.
        outcome = training["gang_outcome"]
        assert "error" in outcome or "phase='succeeded'" in outcome["result"], outcome
        # Nothing of the drill was launched by this machine's local backend (the primary's included).
        assert sorted(p.name for p in (settings.state_dir / "jobs").iterdir()) == [f"train-{RUN}"]
        assert taken["inference"]["version"] == RUN and taken["inference"]["pid"]  # the model server here
        assert not Path(f"/proc/{taken['inference']['pid']}").exists()

        # A retried take_over whose task died with its gang running: fail_back deletes it by name.
        gang, _ = start_training(estate, settings, plan.dr, plan.dr_spec, RUN, "drill-k8s", "t-dead")
        _until(lambda: any(p["phase"] == "Running" for p in dr.sim.pods_of(("vcjob", NS, name))), dr)
        again = drills.make_plan(estate, "drill-k8s", {"extra_steps": 8})  # a fresh task: found by name only
        back = drills.fail_back(again, estate, settings, by="ops")
        assert back["failback"]["stopped_gang"] is True and back["failback"]["dr_still_running"] == []
        assert (NS, name) not in dr.sim.vcjobs and (NS, f"{name}-env") not in dr.sim.secrets
        dr.step()  # the kubelet sees the pods gone: every worker of the gang is sent SIGTERM
        assert not dr.kubelet.procs
        gang.thread.join(30)
        assert not gang.thread.is_alive() and "onprem-a" not in down_clusters(state_path(settings.state_dir))
    _judged(plan, estate, settings, training)


def test_with_models_on_kserve_the_drill_serves_on_the_dr_clusters_inference_pool(
        primary, tmp_path: Path, monkeypatch) -> None:
    """serving.target kserve: the endpoint is an InferenceService of dr-west's dr.serving pool,
    healthy once it answered a prediction, removed by the drill; the gang keeps off that pool."""
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", primary.conn)
    config = serve_on_kubernetes(primary.settings.config_dir, tmp_path)
    settings = Settings(home=primary.settings.home, config_dir=config)
    estate = load_estate(config, use_cache=False)
    with dr_simulator(monkeypatch, tmp_path, kserve_models=tmp_path / "dr-models") as dr:
        plan = drills.make_plan(estate, "drill-kserve", {"extra_steps": 8, "primary": "onprem-a"})
        drills.declare(plan, estate, settings, by="ops")
        taken = drills.take_over(plan, estate, settings)
        assert taken["status"] == "taken over", taken
        served = taken["inference"]
        assert (served["cluster"], served["namespace"], served["kind"], served["check"]) == (
            "dr-west", SERVING_NS, "kserve", "prediction")
        assert served["version"] == RUN and isinstance(served["prediction"], int) and served["served_by"] == "drill"
        assert served["stopped"] is True and "pid" not in served
        with pytest.raises(Exception, match="not found"):  # removed from the DR pool by the drill
            dr.kserve.get(SERVING_NS, "digits")
        assert taken["training"]["node_pool"] == "a100"  # not the inference pool
        back = drills.fail_back(plan, estate, settings, by="ops")
        assert back["failback"]["stopped_dr_serving"] is False and back["failback"]["dr_still_running"] == []
    _judged(plan, estate, settings, taken["training"])


def test_a_kubernetes_dr_cluster_is_refused_by_name_where_a_drill_cannot_run_there(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """No node pool holds the gang (refused by make_plan), or the team's queue is missing on the DR
    cluster (refused before the gang is submitted)."""
    settings = _settings(tmp_path, "hf-unused", node_pools=[POOL, {**POOL, "name": "a100-b"}])
    estate = load_estate(settings.config_dir, use_cache=False)
    with pytest.raises(DrillError, match=r"^workers: 3: a gang runs on one node pool and the largest of the DR "
                                         r"cluster dr-west \(a100\) has 2 GPUs; use 1..2$"):
        drills.make_plan(estate, "d", {"workers": 3}, dr_spec=object())
    with dr_simulator(monkeypatch, tmp_path, queues=("search",)) as dr:
        from hybridflow.backends import gang_backend
        from hybridflow.dr.drills.takeover import _kubernetes_launch

        backend = gang_backend(estate.clusters["dr-west"], estate, settings.state_dir)
        with pytest.raises(DrillError, match=r"^dr_cluster: dr-west has no volcano Queue 'perception' \(team "
                                             r"perception's queue, teams.perception.queue\); create it"):
            _kubernetes_launch(estate, estate.clusters["dr-west"], backend, estate.models.get("digits-mlp"), 1, 60)
        assert not [c for c in dr.sim.calls if c.startswith("create")]
    assert not read_report(settings.private_root, "d")
