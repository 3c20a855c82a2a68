"""A DR drill whose DR cluster is the real control plane: the critical run trained on the local
primary resumes there as a Volcano gang job (admitted by Volcano's scheduler, its PodGroup and pods
the real controllers', its code run by the node agent) reading the replicated dataset and checkpoint
from the DR store; the drill is judged from its declaration, and fail_back deletes the gang by the
drill's name, also one a dead task left running, and lifts the fence."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from tests.k8s_real.conftest import CONN_ID, until
from tests.unit.test_dr_drill import RUN, _config, _primary_with_replicas, ledger  # noqa: F401 - ledger: a fixture

from hybridflow.backends import gang_backend
from hybridflow.config import load_estate
from hybridflow.dr.drills import drill as drills
from hybridflow.dr.drills.takeover import gang_name, start_training
from hybridflow.fencing import down_clusters, state_path
from hybridflow.settings import Settings

POOL = {"name": "run", "gpu_model": "H100-80GB", "gpu_memory_gib": 80, "gpus": 8,
        "node_labels": {"hybridflow.io/pool": "run"}}  # the node the agent runs


def _scratch_claim(real, tmp_path: Path) -> str:
    """The DR cluster's scratch claim as its admins would make it: a PersistentVolumeClaim bound to a
    hostPath PersistentVolume (the agent mounts no volume; what the pods write stays on this machine).
    A real scheduler places no pod whose claim is missing or unbound."""
    pv = f"{real.ns}-scratch"
    real.core().create_persistent_volume({
        "metadata": {"name": pv}, "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
            "hostPath": {"path": str(tmp_path / "scratch")}, "persistentVolumeReclaimPolicy": "Retain",
            "claimRef": {"namespace": real.ns, "name": "dr-scratch"}}})
    real.core().create_namespaced_persistent_volume_claim(real.ns, {
        "metadata": {"name": "dr-scratch"}, "spec": {
            "accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
            "resources": {"requests": {"storage": "1Gi"}}}})
    until(lambda: real.core().read_namespaced_persistent_volume_claim("dr-scratch", real.ns).status.phase == "Bound",
          30, "the controller manager to bind the scratch claim")
    return pv


def _dr_on_the_plane(tmp_path: Path, bucket: str, ns: str) -> Settings:
    config = _config(tmp_path, bucket, backend="kubernetes", conn_id=CONN_ID, scheduler="volcano", namespace=ns,
                     image="registry.local/hybridflow-train:1", checkpoint_store="cache", node_pools=[POOL],
                     # the node agent mounts no volume: the scratch volume's path is this machine's
                     checkpoint_replica="scratch", scratch_claim="dr-scratch", scratch_dir=str(tmp_path / "scratch"))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(kubernetes_poll_s=0.5, preemption_grace_s=10)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return Settings(home=tmp_path / "home", config_dir=config)


def test_a_drill_resumes_the_run_as_a_volcano_gang_on_the_dr_cluster_and_fail_back_deletes_it(
        real, agent, rclone_s3, tmp_path, monkeypatch):
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.storage.s3 import S3ObjectStore

    endpoint, access, secret, _data = rclone_s3
    bucket = f"hf-drill-real-{os.getpid()}-{real.ns}".lower()
    S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_DR_WEST", airflow_conn_uri(access, secret, endpoint))
    real.volcano_queue("perception")  # the queue of the model's project's team
    pv = _scratch_claim(real, tmp_path)
    try:
        _drill(real, agent, tmp_path, bucket)
    finally:
        real.core().delete_persistent_volume(pv)


def _drill(real, agent, tmp_path: Path, bucket: str) -> None:
    settings = _dr_on_the_plane(tmp_path, bucket, real.ns)
    estate = load_estate(settings.config_dir, use_cache=False)
    _primary_with_replicas(settings, estate)

    plan = drills.make_plan(estate, "drill-real", {"extra_steps": 8})
    name = gang_name("drill-real", gang_backend(plan.dr, estate, settings.state_dir))
    seen = len(agent.exits)
    drills.declare(plan, estate, settings, by="ops")
    taken = drills.take_over(plan, estate, settings)
    assert taken["status"] == "taken over", taken
    training = taken["training"]
    assert (training["cluster"], training["backend"], training["node_pool"], training["queue"]) == (
        "dr-west", "kubernetes", "run", "perception")
    assert training["resumed_step"] == 40 and training["stepping_step"] > 40
    assert training["checkpoint_place"].startswith(f"s3://{bucket}/drills/drill-real/")
    # The gang's pod ran on the agent's node, and the drill deleted the Volcano job once it was stepping.
    until(lambda: [pod for pod, _code in agent.exits[seen:] if pod.startswith(name)], 60,
          "the gang's pod to end on the agent's node")
    until(lambda: not real.custom().list_namespaced_custom_object(
        "batch.volcano.sh", "v1alpha1", real.ns, "jobs")["items"], 60, "the drill's gang job to be deleted")
    assert sorted(p.name for p in (settings.state_dir / "jobs").iterdir()) == [f"train-{RUN}"]  # nothing local

    # A retried take_over whose task died with its gang running: fail_back deletes it by name.
    gang, _ = start_training(estate, settings, plan.dr, plan.dr_spec, RUN, "drill-real", "t-dead")
    until(lambda: [p for p in real.pods(name) if p.status.phase == "Running"], 120, "the dead task's gang to run")
    again = drills.make_plan(estate, "drill-real", {"extra_steps": 8})  # a fresh task: found by name only
    back = drills.fail_back(again, estate, settings, by="ops")
    assert back["failback"]["stopped_gang"] is True and back["failback"]["dr_still_running"] == []
    until(lambda: not real.core().list_namespaced_pod(real.ns).items, 60, "the gang's pods to be gone")
    gang.thread.join(60)
    assert not gang.thread.is_alive() and "onprem-a" not in down_clusters(state_path(settings.state_dir))

    done = drills.finish(plan, estate, settings)
    assert done["verdict"] == "met" and done["missed"] == [], done
    figures = done["figures"]
    assert 0 < figures["training_rto_s"] <= 180
    assert figures["training_rto_s"] == pytest.approx(training["stepping_ts"] - done["declared_ts"], abs=0.01)
