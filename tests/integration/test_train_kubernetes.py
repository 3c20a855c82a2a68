"""The train task on a Kubernetes cluster: the real gang (DDP workers) runs as the pods of a
Volcano or Kueue job in the cluster simulator, whose kubelet starts each Running pod's container
command as a process; staged data and checkpoints go through the cluster's S3 bucket (rclone on
loopback) and its scratch volume."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from tests.support.k8s_config import as_kubernetes
from tests.support.k8s_http import serve
from tests.support.k8s_kubelet import Kubelet
from tests.support.k8s_sim import SimCluster
from tests.support.train_task import seed_examples, train_task

from hybridflow.devenv.rclone import airflow_conn_uri
from hybridflow.settings import REPO_ROOT
from hybridflow.storage.s3 import S3ObjectStore

pytestmark = pytest.mark.s3
CLUSTER = "k8s-dc2"


@pytest.fixture
def estate(tmp_path, monkeypatch, rclone_s3, request):
    """Shipped config plus k8s-dc2, a cheaper private Kubernetes cluster (2 nodes x 2 A100)."""
    scheduler, deferrable = request.param
    endpoint, access, secret, _ = rclone_s3
    bucket = f"hf-dc2-{uuid.uuid4().hex[:8]}"
    S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    dc2 = json.loads(json.dumps(clusters["clusters"]["onprem-a"]))
    dc2["prices"]["onprem"] = 0.80
    dc2["node_pools"][0]["node_labels"] = {"hybridflow.io/pool": "a100"}
    as_kubernetes(dc2, conn_id="k8s_dc2", scheduler=scheduler, cache={"conn_id": "k8s_dc2_store", "bucket": bucket})
    dc2["scratch_dir"] = str(tmp_path / "scratch-volume")
    clusters["clusters"][CLUSTER] = dc2
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(gang_admission_timeout_s=2, preemption_grace_s=10, kubernetes_poll_s=0.2,
                                kubernetes_deferrable=deferrable)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    monkeypatch.setenv("AIRFLOW_CONN_K8S_DC2_STORE", airflow_conn_uri(access, secret, endpoint))
    seed_examples(home)
    sim = SimCluster({f"gpu-{i}": {"gpus": 2, "labels": {"hybridflow.io/pool": "a100"}} for i in (1, 2)})
    # The teams' queues, as the cluster's admins create them (placement rules out a cluster without one).
    if scheduler == "volcano":
        for queue in ("perception", "search"):
            sim.add_volcano_queue(queue)
    else:
        sim.add_kueue_queues("teams", 4, ["hybridflow/perception", "hybridflow/search"], preemption="LowerPriority")
    kubelet = Kubelet(sim, tmp_path)
    sim.on_read = kubelet.step  # each poll of the job lets the cluster and its pods move on
    # The cluster's API over HTTP: the train task reaches it through Connection k8s_dc2 (a kubeconfig),
    # the provider's KubernetesHook and the kubernetes client, as it reaches a real cluster.
    with serve(monkeypatch, sim, "k8s_dc2") as server:
        try:
            yield SimpleNamespace(home=home, sim=sim, kubelet=kubelet, scheduler=scheduler, bucket=bucket,
                                  deferrals=0, deferrable=deferrable, server=server,
                                  store=S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access,
                                                      secret_key=secret),
                                  scratch=Path(dc2["scratch_dir"]))
        finally:
            kubelet.stop()


def _train_task(name: str, try_number: int = 1, **params):
    return train_task(name, {"cluster_preference": "private", "workers": 2, "hyperparameters": {"steps": 40},
                             "checkpoint_every_steps": 20, **params}, try_number)


def _execute(op, context, env) -> dict:
    """execute, and when it defers: the trigger's event, then execute_complete on a fresh operator
    (as the worker that resumes the task would), as often as it defers."""
    from airflow.sdk.exceptions import TaskDeferred

    try:
        return op.execute(context)
    except TaskDeferred as deferred:
        env.deferrals += 1
        event = asyncio.run(_first_event(deferred.trigger))
        resumed = type(op)(task_id=op.task_id, run=op.run, placement=op.placement, staged=op.staged)
        return _complete(resumed, context, deferred, event, env)


def _complete(op, context, deferred, event, env) -> dict:
    from airflow.sdk.exceptions import TaskDeferred

    try:
        return getattr(op, deferred.method_name)(context, event=event.payload, **deferred.kwargs)
    except TaskDeferred as again:
        env.deferrals += 1
        return _complete(op, context, again, asyncio.run(_first_event(again.trigger)), env)


async def _first_event(trigger):
    async for event in trigger.run():
        return event
    raise AssertionError("the trigger ended without an event")


def _creates(sim) -> list[str]:
    return [c for c in sim.calls if c.startswith(("create vcjob", "create job"))]


ALL = [("volcano", False), ("kueue", False), ("volcano", True), ("kueue", True)]


@pytest.mark.parametrize("estate", ALL, indirect=True, ids=[f"{s}-{'deferred' if d else 'blocking'}" for s, d in ALL])
def test_gang_trains_on_kubernetes_and_a_retry_reattaches(estate) -> None:
    run, placement, staged, op, context = _train_task("k8s")
    assert placement["cluster"] == CLUSTER
    # The private Kubernetes cluster's pods read the data from the cluster's own bucket.
    assert staged["staged"] and staged["source"]["store"]["bucket"] == estate.bucket
    result = _execute(op, context, estate)
    assert estate.deferrals == int(estate.deferrable)  # the wait was the triggerer's, not a worker's
    logs = estate.kubelet.logs()
    assert result["cluster"] == CLUSTER and result["final_step"] == 40, logs
    assert result["checkpoints_written"] >= 2 and Path(result["model_path"]).stat().st_size > 0
    [created] = _creates(estate.sim)
    job = created.split()[-1]
    assert job.startswith("train-") and len(estate.kubelet.started) == 2  # one pod per worker, once
    # Checkpoints in the bucket (primary) and on the scratch volume the pods mount (replica).
    assert any(estate.store.list(f"checkpoints/{run['run_key']}/"))
    assert list((estate.scratch / "checkpoints" / run["run_key"]).rglob("*"))
    assert not estate.sim.secrets, "the store credentials outlived the gang"
    attempts = json.loads((estate.home / "private" / "runs" / run["run_key"] / "train-attempts.json").read_text())
    assert [(a["cluster"], a["outcome"], a["gang"]) for a in attempts] == [(CLUSTER, "succeeded", job)]

    # Cleared and run again: the same job is found, nothing is submitted or trained twice.
    _, _, _, op2, context2 = _train_task("k8s", try_number=2)
    again = _execute(op2, context2, estate)
    assert again["final_step"] == 40 and _creates(estate.sim) == [created]
    assert len(estate.kubelet.started) == 2


@pytest.mark.parametrize("estate", [("volcano", True), ("kueue", False)], indirect=True,
                         ids=["volcano-deferred", "kueue-blocking"])
def test_gang_not_admitted_on_kubernetes_fails_over_and_leaves_nothing_queued(estate) -> None:
    for node in estate.sim.nodes.values():
        node["unschedulable"] = True  # cordoned: the gang can never be admitted
    estate.sim.kueue_admits = False
    run, placement, _, op, context = _train_task("k8s-full")
    assert placement["cluster"] == CLUSTER
    result = _execute(op, context, estate)
    assert result["cluster"] == "onprem-a" and result["final_step"] == 40
    assert not estate.sim.vcjobs and not estate.sim.jobs and not estate.sim.pods and not estate.sim.secrets
    recorded = json.loads((estate.home / "private" / "runs" / run["run_key"] / "placement.json").read_text())
    assert recorded["failovers"] == [{"cluster": CLUSTER, "reason": "gang not admitted within 2 s"}]


@pytest.mark.parametrize("estate", [("volcano", True)], indirect=True, ids=["volcano-deferred"])
def test_a_gang_with_nowhere_to_move_waits_window_after_window_in_one_attempt(estate) -> None:
    """The trigger only waits: after each admission window it hands back to the task, which asks
    placement for room elsewhere, finds none, notes where the gang stands and defers again, keeping
    the gang's job and its attempt. Once the cluster admits it, it trains there."""
    from airflow.sdk.exceptions import TaskDeferred

    from hybridflow.backends.k8s.trigger import GangJobTrigger
    from hybridflow.backends.local import LocalSlotPool
    from hybridflow.queueing import read_standing

    for node in estate.sim.nodes.values():
        node["unschedulable"] = True  # cordoned for now: the gang waits
    other = LocalSlotPool(estate.home / "state", "onprem-a", 4)
    assert other.try_acquire("train-other", 4, team="search")  # the other private cluster is full
    run, placement, _, op, context = _train_task("k8s-wait")
    assert placement["cluster"] == CLUSTER
    with pytest.raises(TaskDeferred) as first:
        op.execute(context)
    assert read_standing(estate.home / "private", run["run_key"])["state"] == "waiting"
    event = asyncio.run(_first_event(first.value.trigger))
    assert event.payload["status"] == "not_admitted"
    resumed = type(op)(task_id=op.task_id, run=op.run, placement=op.placement, staged=op.staged)
    with pytest.raises(TaskDeferred) as second:
        resumed.execute_complete(context, event=event.payload, **first.value.kwargs)
    assert isinstance(second.value.trigger, GangJobTrigger) and second.value.kwargs == first.value.kwargs
    assert len(_creates(estate.sim)) == 1 and estate.sim.vcjobs  # the same job keeps its place
    note = read_standing(estate.home / "private", run["run_key"])
    assert note["state"] == "waiting" and note["cluster"] == CLUSTER and note["waited_s"] >= 2

    for node in estate.sim.nodes.values():
        node["unschedulable"] = False
    event = asyncio.run(_first_event(second.value.trigger))
    assert event.payload["status"] == "success", event.payload
    result = type(op)(task_id=op.task_id, run=op.run, placement=op.placement,
                      staged=op.staged).execute_complete(context, event=event.payload, **second.value.kwargs)
    assert result["cluster"] == CLUSTER and result["final_step"] == 40
    attempts = json.loads((estate.home / "private" / "runs" / run["run_key"] / "train-attempts.json").read_text())
    assert [(a["cluster"], a["outcome"]) for a in attempts] == [(CLUSTER, "succeeded")]


@pytest.mark.parametrize("estate", [("volcano", False)], indirect=True, ids=["volcano-blocking"])
def test_evicted_gang_is_restarted_by_volcano_and_resumes_from_its_checkpoint(estate) -> None:
    from hybridflow import pipeline
    from hybridflow.placement.places import checkpoint_store_spec
    from hybridflow.settings import get_settings
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.checkpoint import CheckpointStore

    run, placement, _, op, context = _train_task("k8s-evict", hyperparameters={"steps": 400}, checkpoint_every_steps=20)

    ckpt = CheckpointStore(open_store(checkpoint_store_spec(
        run["run_key"], pipeline._estate(get_settings()).clusters[CLUSTER], get_settings())))
    evicted = []

    def step() -> None:
        estate.kubelet.step()
        if not evicted and ckpt.committed_steps():
            master = next(p["name"] for p in estate.sim.pods.values() if "-master-" in p["name"])
            estate.sim.evict_pod(master)
            evicted.append(master)

    estate.sim.on_read = step
    result = _execute(op, context, estate)
    assert evicted, "the gang finished before its first checkpoint was seen"
    assert result["preemptions"] == 1 and result["final_step"] == 400
    assert result["start_step"] >= 20  # the restarted gang resumed, it did not start again at 0
    assert len(estate.kubelet.started) == 4 and len(_creates(estate.sim)) == 1


@pytest.mark.parametrize("estate", [("volcano", True), ("kueue", True)], indirect=True,
                         ids=["volcano-deferred", "kueue-deferred"])
def test_a_team_over_its_cap_waits_unsubmitted_and_starts_when_its_gpus_free_up(estate) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    from hybridflow.backends.local import LocalSlotPool
    from hybridflow.queueing import QueueWaitTrigger, read_standing
    from hybridflow.settings import get_settings

    config = get_settings().config_dir
    projects = yaml.safe_load((config / "projects.yaml").read_text())
    projects["teams"]["perception"]["gpu_cap"] = 3
    (config / "projects.yaml").write_text(yaml.safe_dump(projects, sort_keys=False))
    # An earlier run of the same team holds 2 GPUs on the local private cluster: the cap spans the
    # estate, so 2 more on the Kubernetes cluster would pass it.
    earlier = LocalSlotPool(estate.home / "state", "onprem-a", 4)
    assert earlier.try_acquire("train-earlier", 2, team="perception")
    run, placement, _, op, context = _train_task("capped")
    assert placement["cluster"] == CLUSTER
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    trigger = deferred.value.trigger
    assert isinstance(trigger, QueueWaitTrigger) and trigger.kind == "team_cap"
    assert _creates(estate.sim) == []  # not submitted while over the cap
    standing = read_standing(estate.home / "private", run["run_key"])  # written by the task as it deferred
    assert standing["state"] == "waiting" and standing["over_team_cap"]
    earlier.release("train-earlier")  # the team's earlier run finishes
    event = asyncio.run(_first_event(trigger))
    assert event.payload["status"] == "admitted"
    assert read_standing(estate.home / "private", run["run_key"]) == standing  # the trigger writes nothing
    resumed = type(op)(task_id=op.task_id, run=op.run, placement=op.placement, staged=op.staged)
    result = _complete(resumed, context, deferred.value, event, estate)
    assert result["cluster"] == CLUSTER and result["final_step"] == 40
    assert read_standing(estate.home / "private", run["run_key"])["state"] == "admitted"


def _side_gang(name: str, priority: str, queue: str, seconds: float, sim: SimCluster | None = None) -> str:
    """Another team's gang of 2 on the cluster, whose workers run ``seconds`` and finish. With ``sim``,
    submitted straight to the simulator's API objects: from inside a step, which runs in the
    simulator's API server, a request over HTTP would wait for the step itself."""
    from hybridflow import pipeline
    from hybridflow.backends.k8s.backend import KubernetesGangBackend
    from hybridflow.backends.local import GangJob
    from hybridflow.settings import get_settings

    cluster = pipeline._estate(get_settings()).clusters[CLUSTER]
    hook = SimpleNamespace(core_v1_client=sim.core, batch_v1_client=sim.batch, custom_object_client=sim.custom) \
        if sim is not None else None
    backend = KubernetesGangBackend(cluster, image="trainer:1", hook=hook,
                                    command=("python", "-c", f"import time; time.sleep({seconds})"))
    job = GangJob(name=name, workers=2, spec={}, labels={"priority": priority}, env={})
    backend.submit_spec(backend.gang_spec(job, pool=cluster.node_pools[0].name, queue=queue))
    return name


@pytest.mark.parametrize("estate", [("volcano", False), ("kueue", True)], indirect=True,
                         ids=["volcano-blocking", "kueue-deferred"])
def test_a_critical_gang_preempts_the_batch_gang_which_resumes_from_its_checkpoint(estate) -> None:
    """A full cluster: a batch run's gang and a normal gang hold its 4 GPUs. A critical gang evicts the
    batch gang (the lowest priority); its workers checkpoint and exit 75; it is restarted under its
    preemption budget once the critical gang is done, resumes from its checkpoint and finishes."""
    from hybridflow import pipeline
    from hybridflow.placement.places import checkpoint_store_spec
    from hybridflow.settings import get_settings
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.checkpoint import CheckpointStore

    estate.sim.volcano_actions.append("preempt")
    run, placement, _, op, context = _train_task("k8s-batch", priority="batch", interruptible=True,
                                                 hyperparameters={"steps": 300}, checkpoint_every_steps=20)
    assert placement["cluster"] == CLUSTER
    normal = _side_gang("normal-gang", "normal", "search", 120)
    ckpt = CheckpointStore(open_store(checkpoint_store_spec(
        run["run_key"], pipeline._estate(get_settings()).clusters[CLUSTER], get_settings())))
    critical = []

    def step() -> None:
        estate.kubelet.step()
        if not critical and ckpt.committed_steps():
            batch = next(j for k, j in {**estate.sim.vcjobs, **estate.sim.jobs}.items() if k[1] != normal)
            queue = batch["spec"].get("queue") or batch["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
            critical.append("critical-gang")  # before submitting it: submitting reads jobs, which steps
            _side_gang("critical-gang", "critical", queue, 0.5, sim=estate.sim)  # in the batch gang's queue
            estate.kubelet.step()  # evicts and stops the batch gang now, before it can run out its steps

    estate.sim.on_read = step
    result = _execute(op, context, estate)
    assert critical, "the gang finished before its first checkpoint was seen"
    name = result["job_name"]
    assert result["preemptions"] == 1 and result["final_step"] == 300, estate.kubelet.logs()
    assert result["start_step"] >= 20  # resumed from its checkpoint, not from step 0
    assert [code for pod, code in estate.kubelet.exits if pod.startswith(name)] == [75, 75, 0, 0]
    attempts = json.loads((estate.home / "private" / "runs" / run["run_key"] / "train-attempts.json").read_text())
    assert [(a["outcome"], a["preemptions"]) for a in attempts] == [("succeeded", 1)]
    if estate.scheduler == "volcano":
        assert estate.sim.vcjobs[("hybridflow", name)]["status"]["retryCount"] == 1
    else:
        from tests.support.k8s_sim_queues import workload_of

        assert estate.sim.jobs[("hybridflow", name)]["status"].get("failed", 0) == 0  # backoffLimit untouched
        evictions = workload_of(estate.sim, "hybridflow", name)["status"]["schedulingStats"]["evictions"]
        assert [(e["reason"], e["count"]) for e in evictions] == [("Preempted", 1)]
    # The normal gang was never touched; the critical one ran and finished.
    assert [p for p in estate.kubelet.started if p.startswith(normal)] == estate.sim.pod_names(normal)
    assert all(estate.sim.pods[("hybridflow", p)]["phase"] == "Running" for p in estate.sim.pod_names(normal))
    assert [code for pod, code in estate.kubelet.exits if pod.startswith(critical[0])] == [0, 0]


@pytest.mark.parametrize("estate", [("volcano", False), ("kueue", True)], indirect=True,
                         ids=["volcano-blocking", "kueue-deferred"])
def test_an_application_error_spends_an_airflow_retry_and_no_preemption_budget(estate, monkeypatch) -> None:
    """A training function that raises fails the Kubernetes job at once: the task raises GangFailed
    (Airflow retries it), nothing was restarted and the attempt shows no preemption."""
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.backends.local import GangFailed
    from hybridflow.settings import get_settings

    models = get_settings().config_dir / "models.yaml"
    body = yaml.safe_load(models.read_text())
    body["models"]["team-model"] = {**body["models"]["digits-mlp"], "entrypoint": "contract_fns:raises_bad_column"}
    body["models"]["team-model"].pop("serving")
    models.write_text(yaml.safe_dump(body, sort_keys=False))
    functions = REPO_ROOT / "tests" / "support" / "training_fns"
    monkeypatch.syspath_prepend(str(functions))  # importable here (admission) and in the pods' workers
    monkeypatch.setenv("PYTHONPATH", str(functions))
    run, placement, _, op, context = _train_task("k8s-bug", model="team-model")
    assert placement["cluster"] == CLUSTER
    with pytest.raises(GangFailed) as failed:
        _execute(op, context, estate)
    assert not isinstance(failed.value, AirflowFailException)  # retryable: the task's own retries apply
    assert "exited 1" in str(failed.value)
    assert len(estate.kubelet.started) == 2  # the gang ran once: no restart
    attempts = json.loads((estate.home / "private" / "runs" / run["run_key"] / "train-attempts.json").read_text())
    assert [(a["outcome"], a["preemptions"]) for a in attempts] == [("failed", 0)]
    [stored] = [*estate.sim.vcjobs.values(), *estate.sim.jobs.values()]
    if estate.scheduler == "volcano":
        assert stored["status"]["retryCount"] == 0 and stored["status"]["state"]["phase"] == "Terminated"
    else:
        assert [c["reason"] for c in stored["status"]["conditions"]] == ["PodFailurePolicy"]


@pytest.mark.parametrize("estate", [("kueue", True), ("volcano", False)], indirect=True,
                         ids=["kueue-deferred", "volcano-blocking"])
def test_a_gang_moved_off_to_make_room_is_placed_again_and_resumes_from_its_checkpoint(estate) -> None:
    """Once the gang has committed a checkpoint, it is moved off the cluster (as making room does:
    Kueue's Workload deactivated, or a Volcano AbortJob Command): its workers checkpoint and stop, the
    task reads why from the job it kept, ends the attempt 'moved' with that reason, deletes the job
    and places the run again elsewhere, where it resumes from the checkpoint."""
    from tests.support.k8s_sim_api import FakeBatchV1Api, FakeCoreV1Api, FakeCustomObjectsApi

    from hybridflow import pipeline
    from hybridflow.backends.k8s import moves
    from hybridflow.placement.places import checkpoint_store_spec
    from hybridflow.settings import get_settings
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.checkpoint import CheckpointStore

    run, placement, _, op, context = _train_task("k8s-moved", hyperparameters={"steps": 400},
                                                 checkpoint_every_steps=20)
    assert placement["cluster"] == CLUSTER
    ckpt = CheckpointStore(open_store(checkpoint_store_spec(
        run["run_key"], pipeline._estate(get_settings()).clusters[CLUSTER], get_settings())))
    sim = estate.sim
    # The product's move, on the simulator's objects in this process (the task reaches them over HTTP).
    cluster = SimpleNamespace(
        hook=SimpleNamespace(custom_object_client=FakeCustomObjectsApi(sim), batch_v1_client=FakeBatchV1Api(sim),
                             core_v1_client=FakeCoreV1Api(sim)),
        namespace="hybridflow", scheduler=estate.scheduler, API_TIMEOUT_S=5)
    moved = []

    def step() -> None:
        estate.kubelet.step()
        if not moved and ckpt.committed_steps():
            job = next(iter(sim.vcjobs or sim.jobs))[1]
            moved.append(job)  # first: the move's own reads of the job come back here
            assert moves.move(cluster, job, "making room on k8s-dc2 for train-restricted (test)")

    sim.on_read = step
    result = _execute(op, context, estate)
    assert moved, "the gang finished before its first checkpoint was seen"
    assert result["cluster"] != CLUSTER and result["final_step"] == 400
    attempts = json.loads((estate.home / "private" / "runs" / run["run_key"] / "train-attempts.json").read_text())
    assert [(a["cluster"], a["outcome"]) for a in attempts] == [(CLUSTER, "moved"), (result["cluster"], "succeeded")]
    assert attempts[0]["reason"] == "making room on k8s-dc2 for train-restricted (test)"
    assert attempts[1]["start_step"] >= attempts[0]["last_committed_step"] > 0  # resumed from its checkpoint
    exits = [code for pod, code in estate.kubelet.exits if pod.startswith(moved[0])]
    assert exits == [75, 75]  # both workers committed their checkpoint on SIGTERM
    assert not sim.vcjobs and not sim.jobs and not sim.secrets  # the moved gang's job is gone with its Secret
    shown = json.loads((estate.home / "private" / "runs" / run["run_key"] / "placement.json").read_text())
    assert shown["failovers"][0] == {"cluster": CLUSTER, "reason": "making room on k8s-dc2 for train-restricted (test)"}


@pytest.mark.parametrize("estate", [("kueue", True)], indirect=True, ids=["kueue-deferred"])
def test_a_private_only_run_that_waits_on_kubernetes_makes_room_when_its_task_defers(estate) -> None:
    """A run limited to jurisdiction eu (no public cluster is there) finds both private clusters full,
    k8s-dc2 with an interruptible gang that may move: when its task defers, the movable gang is moved
    off (its Workload deactivated), and the run's gang is admitted and trains there."""
    from airflow.sdk.exceptions import TaskDeferred

    from hybridflow import pipeline
    from hybridflow.backends.k8s.backend import KubernetesGangBackend
    from hybridflow.backends.local import GangJob, LocalSlotPool
    from hybridflow.settings import get_settings

    other = LocalSlotPool(estate.home / "state", "onprem-a", 4)
    assert other.try_acquire("train-other", 4, team="search")  # the other private cluster is full
    cluster = pipeline._estate(get_settings()).clusters[CLUSTER]
    side = KubernetesGangBackend(cluster, image="trainer:1", command=("python", "-c", "import time; time.sleep(60)"))
    movable = GangJob(name="train-movable", workers=4, spec={}, env={},
                      labels={"priority": "normal", "team": "search", "interruptible": "true", "movable": "true"})
    side.submit_spec(side.gang_spec(movable, pool=cluster.node_pools[0].name, queue="search"))
    for _ in range(5):
        estate.kubelet.step()
    assert side.status(movable.name).phase == "running"

    run, placement, _, op, context = _train_task("k8s-room", regions=["eu"])
    assert placement["cluster"] == CLUSTER
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    assert "patch workload" in " ".join(estate.sim.calls)
    assert estate.sim.jobs[("hybridflow", movable.name)]["metadata"]["annotations"]["hybridflow.io/moved-reason"]
    resumed = type(op)(task_id=op.task_id, run=op.run, placement=op.placement, staged=op.staged)
    result = _complete(resumed, context, deferred.value, asyncio.run(_first_event(deferred.value.trigger)), estate)
    assert result["cluster"] == CLUSTER and result["final_step"] == 40
    assert side.status(movable.name).phase == "preempted"  # moved: its own task would place it again
