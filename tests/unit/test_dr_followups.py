"""Disaster recovery where it meets the rest of the platform: a DR cluster's store and replication
scope in clusters.yaml, admission and the train task with a cluster declared down, a gang waiting in
a fenced queue, and a placement held by the takeover waiting in its step."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes

from hybridflow.config import Cluster, Estate, load_estate
from hybridflow.dr.fencing.failback import declare_up
from hybridflow.errors import AdmissionError, ConfigError, PlacementError
from hybridflow.fencing import declare_down, state_path
from hybridflow.request import AdmittedRun
from hybridflow.settings import REPO_ROOT, get_settings

REASON = "power loss in dc-1"
CACHE = {"conn_id": "hybridflow_dr_west", "bucket": "hf-dr-west"}


def _dr(**changes) -> dict:
    cluster = {"location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
               "dr": {"min_gpus": 2}, "prices": {"onprem": 0.5}, "cache": dict(CACHE),
               "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 4}]}
    cluster.update(changes)
    return cluster


def _config(tmp_path: Path, dr: dict | None = None, *, kubernetes_primary: bool = False, **training) -> Path:
    config = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    doc = yaml.safe_load((config / "clusters.yaml").read_text())
    doc["clusters"]["dr-west"] = _dr() if dr is None else dr
    if kubernetes_primary:
        as_kubernetes(doc["clusters"]["onprem-a"], conn_id="k8s_dc1", scheduler="volcano")
    (config / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    if training:
        pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
        pipeline["training"].update(training)
        (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return config


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    """HYBRIDFLOW_HOME of the test: the fence file every reader finds is under it."""
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _estate(tmp_path: Path, monkeypatch, dr: dict | None = None, **kw) -> Estate:
    config = _config(tmp_path, dr, **kw)
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    return load_estate(config, use_cache=False)


def _down(estate: Estate, cluster: str = "onprem-a") -> None:
    declare_down(cluster, REASON, by="ops", estate=estate, path=state_path(get_settings().state_dir))


def _run(**params) -> AdmittedRun:
    return AdmittedRun(**{"model": "digits", "dataset": "digits", "project": "digits-ocr", "classification": "internal",
                          "team": "perception", "dataset_location": "private://datasets/digits", **params})


# -- clusters.yaml: the DR cluster's store and what it keeps ------------------------------------
def test_a_dr_cluster_without_a_store_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_estate(_config(tmp_path, {k: v for k, v in _dr().items() if k != "cache"}), use_cache=False)
    assert ("clusters.dr-west.cache: a dr cluster needs cache: {conn_id, bucket}, the object store its takeover "
            "reads") in str(err.value)


def test_replicate_names_critical_services_and_unknown_names_are_refused(tmp_path: Path, monkeypatch) -> None:
    from hybridflow.config.checks import _check_dr_replicate

    estate = _estate(tmp_path, monkeypatch, _dr(dr={"min_gpus": 2, "replicate": {"endpoints": ["digits"],
                                                                                 "datasets": ["breast-cancer"]}}))
    wanted = estate.clusters["dr-west"].dr.replicate
    assert (wanted.endpoints, wanted.datasets) == (["digits"], ["breast-cancer"])
    assert _dr_replicate_problems(estate, _check_dr_replicate, wanted.model_dump()) == []
    problems = _dr_replicate_problems(estate, _check_dr_replicate, {"endpoints": ["digits", "nope"],
                                                                     "datasets": ["gone"]})
    assert len(problems) == 2
    assert "clusters.dr-west.dr.replicate.datasets[0]: 'gone' is not in datasets.yaml; use one of: breast-cancer" \
        in problems[0]
    assert "clusters.dr-west.dr.replicate.endpoints[1]: 'nope' is no model's endpoint in models.yaml" in problems[1]
    with pytest.raises(ConfigError, match=r"clusters.dr-west.dr.replicate.datasets\[0\]: 'gone' is not in datasets"):
        load_estate(_config(tmp_path / "a", _dr(dr={"min_gpus": 2, "replicate": {"datasets": ["gone"]}})),
                    use_cache=False)
    with pytest.raises(ConfigError, match=r"clusters.dr-west.dr.replicate.services"):
        load_estate(_config(tmp_path / "b", _dr(dr={"min_gpus": 2, "replicate": {"services": ["x"]}})),
                    use_cache=False)


def _dr_replicate_problems(estate: Estate, check, replicate: dict) -> list[str]:
    cluster = Cluster.model_validate({**_dr(), "dr": {"min_gpus": 2, "replicate": replicate}})
    return check(Path("clusters.yaml"), SimpleNamespace(clusters={"dr-west": cluster}), estate.datasets, estate.models)


def test_the_replication_task_copies_what_dr_replicate_names(tmp_path: Path, home: Path, monkeypatch,
                                                             caplog) -> None:
    import hybridflow.dr.replication.readiness as readiness
    import hybridflow.dr.replication.replicate as replication
    from hybridflow.dr.replication.task import replication_task

    _estate(tmp_path, monkeypatch, _dr(dr={"min_gpus": 2, "replicate": {"endpoints": ["digits", "breast-cancer"],
                                                                         "datasets": ["breast-cancer"]}}))
    (home / "state" / "serving" / "digits").mkdir(parents=True)
    (home / "state" / "serving" / "digits" / "active.json").write_text("{}")
    asked: list[dict] = []

    def replicate(estate, settings, **kw):
        asked.append(kw)
        return replication.ReplicationReport(cluster=kw["cluster"], store="memory://")

    monkeypatch.setattr(replication, "replicate", replicate)
    monkeypatch.setattr(readiness, "check_readiness", lambda *a, **k: [])
    with caplog.at_level(logging.WARNING, logger="hybridflow.dr"):
        assert replication_task()["status"] == "replicated"
    # breast-cancer is named but not served yet: nothing of it to copy, said in the log.
    assert [(a["endpoints"], a["datasets"]) for a in asked] == [(["digits"], ["breast-cancer"])]
    assert "endpoint breast-cancer (dr.replicate.endpoints) is not served yet" in caplog.text
    _estate(tmp_path / "b", monkeypatch)  # nothing named: everything served, each endpoint's dataset
    replication_task()
    assert (asked[-1]["endpoints"], asked[-1]["datasets"]) == (None, None)


# -- admission on Kubernetes while the primary is down -----------------------------------------
def test_admission_does_not_refuse_a_critical_run_the_dr_pool_takes(tmp_path: Path, home: Path,
                                                                    monkeypatch) -> None:
    import hybridflow.conncheck as conncheck
    from hybridflow.placement.decide import eligible

    estate = _estate(tmp_path, monkeypatch, kubernetes_primary=True)
    probed: list[str] = []

    def unanswered(cluster, timeout_s):
        probed.append(cluster.name)
        return conncheck.ConnectionProblem(cluster.name, str(cluster.conn_id), "connection refused", "fix it")

    monkeypatch.setattr(conncheck, "probe", unanswered)
    run = _run(classification="restricted", priority="critical")  # private clusters only
    with pytest.raises(AdmissionError, match="no cluster this run may use can be reached"):
        conncheck.check_connections(run, estate)
    _down(estate)
    assert [c.name for c in eligible(run, estate)] == ["dr-west"]
    assert conncheck.check_connections(run, estate) == []
    assert probed == ["onprem-a"]  # the fenced primary is asked no more


# -- the train task and a cluster declared down -------------------------------------------------
def test_the_train_task_starts_no_gang_on_a_cluster_declared_down(tmp_path: Path, home: Path, monkeypatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.backends import gang_backend
    from hybridflow.operators.train import GangTrainOperator

    estate = _estate(tmp_path, monkeypatch)
    pool = gang_backend(estate.clusters["onprem-a"], estate, get_settings().state_dir).pool
    assert pool.try_acquire("busy", 4, os.getpid())
    assert not pool.try_acquire("train-r1", 2, os.getpid(), queue=True)  # its gang waits in the queue
    assert list(pool.waiting()) == ["train-r1"]
    _down(estate)
    op = GangTrainOperator(task_id="train", run={"run_key": "r1"}, placement={}, staged={})
    with pytest.raises(AirflowFailException) as err:
        op._train_on({}, get_settings(), estate, {"cluster": "onprem-a"}, {})
    assert pool.waiting() == {}  # and waits there no more
    msg = str(err.value)
    assert msg.startswith("not started: cluster onprem-a is declared down (at ")
    assert f"by ops: {REASON}) and takes no new gangs" in msg
    assert "Clear the choose_cluster task" in msg and "`hybridflow cluster up onprem-a`" in msg


def test_a_kubernetes_gang_deleted_by_the_fence_stops_the_task_without_a_retry(tmp_path: Path, home: Path,
                                                                               monkeypatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.backends.local import GangFailed
    from hybridflow.operators.train import GangTrainOperator
    from hybridflow.request import RunRequest

    estate = _estate(tmp_path, monkeypatch)
    op = GangTrainOperator(task_id="train", run={}, placement={}, staged={})
    ended: list[str] = []
    monkeypatch.setattr(op, "_end_attempt", lambda job, attempt, outcome: ended.append(outcome) or [])
    job = SimpleNamespace(admitted=SimpleNamespace(request=RunRequest(project="digits-ocr")),
                          cluster=estate.clusters["onprem-a"], ckpt_spec=SimpleNamespace(uri="file:///ckpt/r1"))
    failed = GangFailed("gang train-r1 failed: job deleted", rank=0, exit_code=143, log_tail="")
    with pytest.raises(GangFailed):  # up: an application failure, left to the task's retries
        op._end_attempt_on_error(job, {}, failed, estate)
    _down(estate)
    with pytest.raises(AirflowFailException) as err:
        op._end_attempt_on_error(job, {}, failed, estate)
    assert ended == ["failed", "stopped"]
    assert f"{REASON}) and takes no new gangs" in str(err.value)
    assert "The newest checkpoint is kept in file:///ckpt/r1: clear the train task to resume from it once the stop " \
           "no longer holds (the budget freeze lifted, or the cluster declared up again" in str(err.value)


# -- a gang waiting in a fenced local queue -----------------------------------------------------
def _first_event(trigger) -> dict:
    async def first():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(first())


@pytest.mark.parametrize(("elsewhere", "state"), [(None, "fenced"), ("cloud-east", "moved")])
def test_a_gang_waiting_in_a_fenced_queue_is_withdrawn_not_admitted(tmp_path: Path, home: Path, monkeypatch,
                                                                    elsewhere, state) -> None:
    """The trigger sees the fence and hands back to the task without admitting or withdrawing
    anything; the task asks placement, withdraws the gang's ticket and moves it, or fails naming the fence."""
    from airflow.sdk.exceptions import AirflowFailException

    import hybridflow.queueing as queueing
    import hybridflow.training.failover as failover
    from hybridflow.backends import gang_backend
    from hybridflow.backends.base import GangJob
    from hybridflow.operators.train import GangTrainOperator

    estate = _estate(tmp_path, monkeypatch)
    backend = gang_backend(estate.clusters["onprem-a"], estate, get_settings().state_dir)
    assert backend.pool.try_acquire("busy", 4, os.getpid())
    gang = GangJob(name="train-r1", workers=2, spec={}, labels={"priority": "normal", "team": "perception"})
    assert not backend.admit_step(gang)  # queued behind the busy gang
    _down(estate)
    backend.pool.release("busy")  # room now, but the cluster is fenced
    queued_since = time.time()
    trigger = queueing.QueueWaitTrigger(
        kind="slots", cluster="onprem-a", job={"name": "train-r1", "workers": 2, "priority": "normal",
                                               "team": "perception", "team_cap": None},
        run={"run_key": "r1"}, queued_since=queued_since, max_wait_s=3600, recheck_s=3600, poll_s=0.01)
    event = _first_event(trigger)
    assert event["status"] == "fenced"
    assert f"onprem-a, which is declared down ({REASON})" in event["message"]
    assert (backend.load().used, list(backend.pool.waiting())) == (0, ["train-r1"])  # the trigger changed nothing

    moved = ({"cluster": elsewhere}, {"source": {}}) if elsewhere else None
    monkeypatch.setattr(failover, "fail_over", lambda run, placement, cluster, reason, settings: moved)
    run = {**_run().to_xcom(), "run_key": "r1"}
    op = GangTrainOperator(task_id="train", run=run, placement={}, staged={})
    trained: list = []
    monkeypatch.setattr(op, "_train_with_failover", lambda *args: trained.append(args[3]["cluster"]) or {})
    kwargs = {"placement": {"cluster": "onprem-a"}, "staged": {}, "queued_since": queued_since}
    if elsewhere:
        op.resume_after_wait({}, event=event, **kwargs)
        assert trained == [elsewhere]
    else:
        with pytest.raises(AirflowFailException, match=r"^not started: cluster onprem-a is declared down"):
            op.resume_after_wait({}, event=event, **kwargs)
    load = backend.load()
    assert (load.used, load.queued) == (0, 0)  # neither admitted there nor still queueing
    assert queueing.read_standing(get_settings().private_root, "r1")["state"] == state


# -- a placement the takeover holds waits in its step --------------------------------------------
def test_a_held_placement_waits_in_its_step_up_to_the_limit(tmp_path: Path, home: Path, monkeypatch) -> None:
    from airflow.sdk.exceptions import AirflowRescheduleException

    from hybridflow import pipeline
    from hybridflow.queueing import read_standing

    estate = _estate(tmp_path, monkeypatch, gang_admission_timeout_s=60, max_queue_wait_s=600)
    settings = get_settings()
    run = {**_run(priority="normal").to_xcom(), "run_key": "r1"}
    _down(estate)
    with pytest.raises(AirflowRescheduleException) as again:
        pipeline.choose_cluster(run, settings)
    note = read_standing(settings.private_root, "r1")
    assert (note["state"], note["cluster"]) == ("held: waiting", "onprem-a")
    assert "it waits for failback (`hybridflow cluster up onprem-a`)" in note["held"]
    waited = again.value.reschedule_date.timestamp() - note["held_since_s"]
    assert 59 <= waited <= 61  # tried again after training.gang_admission_timeout_s
    # Past training.max_queue_wait_s the step fails, naming the limit; cleared, it waits afresh.
    path = settings.private_root / "runs" / "r1" / "queue.json"
    path.write_text(json.dumps({**note, "held_since_s": note["held_since_s"] - 600}))
    with pytest.raises(PlacementError, match=r"^held 6\d\d s, training.max_queue_wait_s is 600"):
        pipeline.choose_cluster(run, settings)
    assert not path.exists()
    with pytest.raises(AirflowRescheduleException):
        pipeline.choose_cluster(run, settings)
    declare_up("onprem-a", estate=estate, path=state_path(settings.state_dir))
    assert pipeline.choose_cluster(run, settings)["cluster"] == "onprem-a"
    assert not path.exists()  # the hold's note leaves the run's page
