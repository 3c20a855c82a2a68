"""The Kubernetes gang backend's control loop against the stateful cluster simulator, through the
provider's KubernetesHook and the same client calls a real API server answers: submit, gang
admission (all or nothing), re-attach on retry, eviction -> restart, failure, on_kill deletion,
and the deferrable trigger's events."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.support.k8s_sim import SimCluster, install

from hybridflow.backends.errors import PreemptionBudgetSpent
from hybridflow.backends.k8s.backend import PENDING, SUCCEEDED, KubernetesGangBackend
from hybridflow.backends.k8s.manifests import GANG_LABEL, gang_job_name
from hybridflow.backends.k8s.trigger import GangJobTrigger
from hybridflow.backends.local import GangFailed, GangJob, GangNotAdmitted
from hybridflow.config import Cluster
from hybridflow.errors import GangError

NS = "hybridflow"
SECRET_ENV = {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}


def _cluster(scheduler: str) -> Cluster:
    cluster = Cluster.model_validate({
        "location": "public", "region": "us-east-1", "backend": "kubernetes", "conn_id": "k8s_east",
        "scheduler": scheduler,
        "node_pools": [
            {"name": "h100", "gpu_model": "H100-80GB", "gpu_memory_gib": 80, "gpus": 8,
             "node_labels": {"hybridflow.io/pool": "h100"}},
            {"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 8,
             "node_labels": {"hybridflow.io/pool": "a100"}},
        ],
        "prices": {"on_demand": 3.9},
    })
    cluster._name = "cloud-east"
    return cluster


@pytest.fixture
def sim(monkeypatch):
    sim = SimCluster({
        "h100-1": {"gpus": 4, "labels": {"hybridflow.io/pool": "h100"}},
        "h100-2": {"gpus": 4, "labels": {"hybridflow.io/pool": "h100"}},
        "a100-1": {"gpus": 8, "labels": {"hybridflow.io/pool": "a100"}},
    })
    install(monkeypatch, sim)
    return sim


def _job(workers: int, run_id: str = "manual__1", priority: str = "normal") -> GangJob:
    name = gang_job_name("train_model", run_id, "train", "cloud-east", readable="train-r1")
    return GangJob(name=name, workers=workers, spec={"run_key": "r1", "train_steps": 100}, env=SECRET_ENV,
                   labels={"project": "digits", "team": "vision", "priority": priority})


class Clock:
    """Simulated time: each poll's sleep advances it and lets the cluster reconcile once."""

    def __init__(self, sim: SimCluster, script: dict | None = None) -> None:
        self.sim, self.now, self.ticks, self.script = sim, 0.0, 0, dict(script or {})

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.ticks += 1
        self.sim.step()
        if self.ticks in self.script:
            self.script.pop(self.ticks)()

    def __call__(self) -> float:
        return self.now


def _backend(scheduler: str, **kw) -> KubernetesGangBackend:
    return KubernetesGangBackend(_cluster(scheduler), image="ghcr.io/example/trainer:1.0", **kw)


def _run(backend, job, clock, timeout_s: float = 60):
    return backend.run(job, pool="h100", queue="vision", admission_timeout_s=timeout_s, poll_s=5,
                       sleep=clock.sleep, clock=clock)


def test_volcano_gang_is_submitted_admitted_together_and_succeeds(sim):
    job = _job(8)
    clock = Clock(sim, {3: lambda: sim.succeed(job.name)})
    status = _run(_backend("volcano"), job, clock)
    assert status.phase == SUCCEEDED and status.retries == 0
    assert sim.calls.count(f"create vcjob {job.name}") == 1
    stored = sim.vcjobs[(NS, job.name)]
    assert stored["spec"]["minAvailable"] == 8 and stored["spec"]["queue"] == "vision"
    pods = [p for p in sim.pods.values() if p["owner"][2] == job.name]
    assert len(pods) == 8 and {p["node"] for p in pods} == {"h100-1", "h100-2"}  # the pool's nodes only
    assert all(p["labels"][GANG_LABEL] == job.name and p["labels"]["hybridflow.io/run-key"] == "r1" for p in pods)
    # Credentials went into a Secret, never into the job.
    assert sim.secrets[(NS, f"{job.name}-env")]["stringData"] == SECRET_ENV
    assert "s3cr3t-value" not in str(stored)


def test_no_partial_start_when_the_pool_lacks_capacity(sim):
    held = _job(4, run_id="other")
    _backend("volcano").submit_spec(_backend("volcano").gang_spec(held, pool="h100", queue="vision"), SECRET_ENV)
    sim.run(2)  # the first gang holds one h100 node
    job = _job(6)  # 6 > 4 free h100 GPUs (the a100 node is free but not in the pool)
    clock = Clock(sim)
    with pytest.raises(GangNotAdmitted) as info:
        _run(_backend("volcano"), job, clock, timeout_s=30)
    assert info.value.cluster == "cloud-east"
    assert sim.pod_names(job.name) == []  # not one pod of the gang ever started
    # It keeps its place in the queue (the train task deletes it only if the run moves elsewhere).
    assert (NS, job.name) in sim.vcjobs and "position 1 in the queue of cloud-east" in str(info.value)
    assert clock.now >= 30 and len(sim.pod_names(held.name)) == 4


def test_retry_reattaches_instead_of_creating_a_second_job(sim):
    job = _job(4)
    first = _backend("volcano")
    sub = first.submit_spec(first.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    assert sub.created and sub.status.phase == PENDING
    sim.run(2)
    # The worker running the task died; the retry (a fresh backend, same run) finds the job by name.
    clock = Clock(sim, {2: lambda: sim.succeed(job.name)})
    status = _run(_backend("volcano"), job, clock)
    assert status.phase == SUCCEEDED
    assert sim.calls.count(f"create vcjob {job.name}") == 1 and len(sim.vcjobs) == 1
    again = _backend("volcano").submit_spec(first.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    assert not again.created and again.status.phase == SUCCEEDED  # a cleared, finished task does not rerun


def test_eviction_restarts_the_whole_gang_away_from_the_cordoned_node(sim):
    job = _job(4)

    def evict():
        victim = next(p for p in sim.pods.values() if p["owner"][2] == job.name)
        sim.nodes[victim["node"]]["unschedulable"] = True  # e.g. node health cordoned it
        sim.evict_pod(victim["name"])

    seen = []
    clock = Clock(sim, {2: evict, 6: lambda: seen.extend(sim.pods.values()), 7: lambda: sim.succeed(job.name)})
    status = _run(_backend("volcano"), job, clock)
    assert status.phase == SUCCEEDED and status.retries == 1
    restarted = [p for p in seen if p["owner"][2] == job.name]
    assert len(restarted) == 4 and len({p["node"] for p in restarted}) == 1
    assert not any(sim.nodes[p["node"]]["unschedulable"] for p in restarted)


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_an_application_failure_fails_the_gang_at_once_naming_the_rank(sim, scheduler):
    job = _job(4)

    def fail_rank():
        sim.fail_pod(sim.pod_names(job.name)[1], exit_code=3)

    clock = Clock(sim, {2: fail_rank})
    backend = _backend(scheduler, max_retry=3)
    with pytest.raises(GangFailed) as info:
        _run(backend, job, clock)
    assert not isinstance(info.value, PreemptionBudgetSpent)
    assert info.value.rank == 1 and info.value.exit_code == 3 and "rank 1" in str(info.value)
    assert "exited 3" in str(info.value) and clock.ticks <= 4  # no restart: the task's own retries apply
    assert all(sim.pods[(NS, p)]["phase"] == "Failed" for p in sim.pod_names(job.name))  # nothing runs on
    # The retry of the failed task starts the gang afresh under the same name.
    sub = backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    assert sub.created and sim.pod_names(job.name) == []


def test_volcano_preemptions_restart_the_gang_until_the_budget_is_spent(sim):
    job = _job(2)

    def preempt():  # every rank checkpointed on SIGTERM and exited 75
        for pod in sim.pod_names(job.name):
            sim.fail_pod(pod, exit_code=75)

    clock = Clock(sim, {2: preempt, 6: preempt, 10: preempt})
    with pytest.raises(PreemptionBudgetSpent, match="preempted 3 times, more than the 2 restarts.*training.preemption_retries"):
        _run(_backend("volcano", max_retry=2), job, clock)
    assert not sim.vcjobs and not sim.secrets  # stopped: it holds nothing


def test_kueue_eviction_of_a_whole_gang_spends_only_the_preemption_budget(sim):
    job = _job(6)

    def preempt(gang=job):  # one pod evicted; every other rank checkpointed and exited 75
        first, *rest = [p for p in sim.pod_names(gang.name) if sim.pods[(NS, p)]["phase"] == "Running"]
        sim.evict_pod(first)
        for pod in rest:
            sim.fail_pod(pod, exit_code=75)

    def succeed():
        sim.succeed(job.name)

    clock = Clock(sim, {3: preempt, 8: succeed, 9: succeed, 10: succeed})
    backend = _backend("kueue", max_retry=1)
    status = _run(backend, job, clock)
    assert status.phase == SUCCEEDED and status.retries == 1
    assert sim.jobs[(NS, job.name)]["status"].get("failed", 0) == 0  # backoffLimit untouched
    job2 = _job(6, run_id="manual__2")
    clock = Clock(sim, {3: lambda: preempt(job2), 8: lambda: preempt(job2)})
    with pytest.raises(PreemptionBudgetSpent, match="preempted 2 times, more than the 1 restarts"):
        _run(backend, job2, clock)
    assert (NS, job2.name) not in sim.jobs and sim.pod_names(job2.name) == []  # stopped, GPUs free


def test_on_kill_deletes_the_job_its_pods_and_secret(sim):
    job = _job(4)
    backend = _backend("volcano")
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    sim.run(2)
    assert len(sim.pod_names(job.name)) == 4
    assert backend.cancel(job.name) is True
    assert not sim.vcjobs and sim.pod_names(job.name) == [] and not sim.secrets
    assert backend.cancel(job.name) is False  # already gone: no error


def test_kueue_job_stays_suspended_until_admitted_then_survives_an_eviction(sim):
    job = _job(4, priority="critical")
    sim.kueue_admits = False  # the ClusterQueue has no quota left for now

    def admit():
        assert sim.pod_names(job.name) == [] and sim.jobs[(NS, job.name)]["spec"]["suspend"] is True
        sim.kueue_admits = True

    def evict():
        sim.evict_pod(sim.pod_names(job.name)[0])

    clock = Clock(sim, {3: admit, 6: evict, 9: lambda: sim.succeed(job.name)})
    backend = _backend("kueue")
    status = _run(backend, job, clock)
    assert status.phase == SUCCEEDED and status.retries == 1  # one restart under the preemption budget
    stored = sim.jobs[(NS, job.name)]
    assert stored["status"].get("failed", 0) == 0  # the eviction did not count towards backoffLimit
    assert stored["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision"
    assert stored["spec"]["suspend"] is False and (NS, job.name) in sim.services
    assert backend.cancel(job.name) and not sim.jobs and sim.pod_names(job.name) == [] and not sim.services


def test_backend_refuses_a_cluster_it_cannot_drive():
    local = Cluster.model_validate({"location": "private", "region": "dc", "node_pools": [
        {"name": "p", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 1}], "prices": {"onprem": 1}})
    with pytest.raises(GangError, match="backend: kubernetes"):
        KubernetesGangBackend(local, image="x:1")


# --- the trigger --------------------------------------------------------------------------------


def _trigger(name: str, **kw) -> GangJobTrigger:
    args = dict(conn_id="k8s_east", scheduler="volcano", namespace=NS, name=name, cluster="cloud-east",
                submitted_at=time.time(), admission_timeout_s=60, poll_interval=0)
    return GangJobTrigger(**{**args, **kw})


async def _first_event(trigger: GangJobTrigger) -> dict:
    gen = trigger.run()
    try:
        return (await asyncio.wait_for(gen.__anext__(), timeout=10)).payload
    finally:
        await gen.aclose()


def test_trigger_serialize_round_trips():
    trigger = _trigger("train-r1-abc", admitted=True, poll_interval=7.5)
    path, kwargs = trigger.serialize()
    module, _, cls = path.rpartition(".")
    import importlib

    rebuilt = getattr(importlib.import_module(module), cls)(**kwargs)
    assert rebuilt.serialize() == (path, kwargs) and isinstance(rebuilt, GangJobTrigger)


def test_trigger_waits_for_the_gang_and_reports_success(sim):
    job = _job(4)
    backend = _backend("volcano")
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    reads = []

    def time_passes():
        reads.append(1)
        sim.step()
        if len(reads) == 4:
            sim.succeed(job.name)

    sim.on_read = time_passes
    event = asyncio.run(_first_event(_trigger(job.name)))
    assert event["status"] == "success" and event["admitted"] and len(reads) >= 5
    assert backend.on_event(event).phase == SUCCEEDED


def test_trigger_not_admitted_after_the_deadline(sim):
    job = _job(4)
    sim.kueue_admits = False
    backend = _backend("kueue")
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    event = asyncio.run(_first_event(_trigger(job.name, scheduler="kueue", submitted_at=time.time() - 120)))
    assert event["status"] == "not_admitted" and not event["admitted"]
    with pytest.raises(GangNotAdmitted):
        backend.on_event(event)
    assert sim.jobs  # still queued: the train task decides whether the run moves (and deletes it then)


def test_trigger_turns_api_errors_and_failures_into_events(sim):
    def down():
        raise ConnectionError("connection refused")

    sim.on_read = down
    event = asyncio.run(_first_event(_trigger("train-r1-abc", api_outage_s=1)))
    assert event["status"] == "error" and "connection refused" in event["message"]
    assert "unreachable for 1 s" in event["message"]
    with pytest.raises(GangError, match="re-attaches"):
        _backend("volcano").on_event(event)
    sim.on_read = None
    gone = asyncio.run(_first_event(_trigger("no-such-job")))
    assert gone["status"] == "failed" and gone["gang"]["phase"] == "missing"
    with pytest.raises(GangFailed):
        _backend("volcano").on_event(gone)



@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_missing_scratch_claim_is_refused_before_anything_is_created(sim, scheduler):
    """A real scheduler never places a pod whose PersistentVolumeClaim is missing (it stays Pending, said
    only in events); the backend refuses the gang at submit, naming the claim, the namespace and the fix."""
    cluster = _cluster(scheduler).model_copy(update={"scratch_claim": "team-scratch", "scratch_dir": "/scratch"})
    cluster._name = "cloud-east"
    backend = KubernetesGangBackend(cluster, image="ghcr.io/example/trainer:1.0")
    job = _job(2)
    sim.claims = set()
    with pytest.raises(GangError, match=r"clusters.cloud-east.scratch_claim: no PersistentVolumeClaim 'team-scratch' "
                                        r"in namespace 'hybridflow'.*create the claim there.*nothing was submitted"):
        backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    assert not [c for c in sim.calls if c.startswith("create")] and not sim.secrets
    sim.claims = {(NS, "team-scratch")}  # the admins made it: the same gang goes in
    submitted = backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), SECRET_ENV)
    assert submitted.created and (NS, f"{job.name}-env") in sim.secrets


def test_the_clusters_nccl_interface_goes_into_the_gang_spec():
    cluster = _cluster("kueue")
    assert KubernetesGangBackend(cluster, image="t:1").gang_spec(_job(2), pool="h100", queue="q").nccl_socket_ifname \
        is None
    cluster = cluster.model_copy(update={"nccl_socket_ifname": "eth0"})
    cluster._name = "cloud-east"
    spec = KubernetesGangBackend(cluster, image="t:1").gang_spec(_job(2), pool="h100", queue="q")
    assert spec.nccl_socket_ifname == "eth0"
