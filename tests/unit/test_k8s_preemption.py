"""Priority preemption on a Kubernetes cluster, through the gang backend against the cluster
simulator: a critical gang evicts a batch gang that holds the GPUs it needs; the batch gang's
workers (real processes, run by the simulator's kubelet) checkpoint on SIGTERM and exit 75, and the
scheduler restarts the gang under its preemption budget (Volcano: RestartJob; Kueue: the Workload
is evicted, the Job suspended and readmitted), never as a failure of the Job."""

from __future__ import annotations

import sys
import time

import pytest
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_kubelet import h100_pool
from tests.support.k8s_sim_preemption import evict_workload
from tests.support.k8s_sim_queues import workload_of

from hybridflow.backends.errors import PreemptionBudgetSpent
from hybridflow.backends.k8s.backend import PENDING, SUCCEEDED, KubernetesGangBackend
from hybridflow.backends.k8s.manifests import gang_job_name
from hybridflow.backends.local import GangFailed, GangJob

NS = "hybridflow"



@pytest.fixture(params=["volcano", "kueue"])
def cluster(request, monkeypatch, tmp_path):
    """2 nodes x 4 H100, with preemption on: Volcano's preempt action, Kueue's withinClusterQueue."""
    with h100_pool(request.param, monkeypatch, tmp_path, preemption=True) as (sim, kubelet, script):
        yield request.param, sim, kubelet, script


def _gang(run_id: str, workers: int, priority: str, run_s: float, work_dir, resume_s: float = 0,
          **env: str) -> GangJob:
    name = gang_job_name("train_model", run_id, "train", "dc2-k8s", readable=f"train-{run_id}")
    return GangJob(name=name, workers=workers, spec={"run_key": run_id}, labels={"team": "vision", "priority": priority},
                   env={"WORK_DIR": str(work_dir), "RUN_S": str(run_s), "RESUME_S": str(resume_s), **env})


def _backend(scheduler: str, script, max_retry: int) -> KubernetesGangBackend:
    return KubernetesGangBackend(private_h100_cluster(scheduler), image="ghcr.io/example/trainer:1.0",
                                 command=(sys.executable, str(script)), max_retry=max_retry)


def _until(condition, kubelet, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the cluster did not get there in time"
        kubelet.step()
        time.sleep(0.02)


def test_a_critical_gang_evicts_the_batch_gang_which_resumes_from_its_checkpoint(cluster, tmp_path):
    """A full cluster: 6 batch workers and 2 normal ones hold its 8 GPUs. A critical gang of 4
    evicts the lowest-priority gang (all 6 batch ranks), runs, and the batch gang is restarted once
    (its preemption budget) and every rank resumes; the Job never fails; the normal gang runs on."""
    scheduler, sim, kubelet, script = cluster
    batch, critical = _gang("batch", 6, "batch", 60, tmp_path), _gang("urgent", 4, "critical", 0.3, tmp_path)
    normal = _gang("normal", 2, "normal", 60, tmp_path)
    backend = _backend(scheduler, script, max_retry=1)
    for gang in (batch, normal):
        backend.submit_spec(backend.gang_spec(gang, pool="h100", queue="vision"), gang.env)
    _until(lambda: len(list(tmp_path.glob("*.ready"))) == 8, kubelet)  # every rank at work
    backend.submit_spec(backend.gang_spec(critical, pool="h100", queue="vision"), critical.env)

    status = backend.run(batch, pool="h100", queue="vision", admission_timeout_s=60, poll_s=0.02,
                         sleep=lambda s: (kubelet.step(), time.sleep(s)))
    assert status.phase == SUCCEEDED and status.retries == 1  # one restart, under the budget
    ends = [code for pod, code in kubelet.exits if pod.startswith(batch.name)]
    assert ends == [75] * 6 + [0] * 6  # all ranks checkpointed and exited 75, then finished
    assert len(list(tmp_path.glob(f"{batch.name}-*.resumed"))) == 6  # and every rank resumed
    assert backend.status(critical.name).phase == SUCCEEDED
    assert [p for p in kubelet.started if p.startswith(normal.name)] == sim.pod_names(normal.name)  # untouched
    assert backend.status(normal.name).retries == 0
    if scheduler == "volcano":
        assert sim.vcjobs[(NS, batch.name)]["status"]["retryCount"] == 1
    else:
        job = sim.jobs[(NS, batch.name)]
        assert job["status"].get("failed", 0) == 0 and job["spec"]["backoffLimit"] == 1  # backoffLimit untouched
        assert [c["type"] for c in job["status"]["conditions"]] == ["Complete"]
        stats = workload_of(sim, NS, batch.name)["status"]["schedulingStats"]["evictions"]
        assert stats == [{"reason": "Preempted", "underlyingCause": "InClusterQueue", "count": 1}]


@pytest.mark.parametrize("cluster", ["kueue"], indirect=True)
def test_an_evicted_kueue_gang_waits_then_a_second_eviction_spends_its_budget(cluster, tmp_path):
    """While evicted the gang reads as pending, saying why; readmitted, it resumes; evicted once more
    than training.preemption_retries allows, it is stopped with PreemptionBudgetSpent."""
    _, sim, kubelet, script = cluster
    batch = _gang("batch", 6, "batch", 60, tmp_path, resume_s=60)
    backend = _backend("kueue", script, max_retry=1)
    seen = []

    def evictions() -> int:
        return sum(e["count"] for e in workload_of(sim, NS, batch.name)["status"].get("schedulingStats", {}).get(
            "evictions", []))

    def evict(message: str) -> None:
        evict_workload(sim, workload_of(sim, NS, batch.name), "Preempted", "InClusterQueue", message)

    def tick(seconds: float) -> None:
        kubelet.step()
        time.sleep(seconds)
        ready, resumed = (len(list(tmp_path.glob(f"{batch.name}-*.{kind}"))) for kind in ("ready", "resumed"))
        if evictions() == 0 and ready == 6:  # every rank at work
            sim.kueue_admits = False  # no room to come back to, for now
            evict("Preempted to accommodate a workload (UID: 1, JobUID: 2) due to prioritization in the ClusterQueue")
        elif evictions() == 1 and not sim.kueue_admits and sim.jobs[(NS, batch.name)]["spec"]["suspend"]:
            seen.append((backend.status(batch.name), sim.pod_names(batch.name)))
            sim.kueue_admits = True
        elif evictions() == 1 and resumed == 6:
            evict("again")

    with pytest.raises(PreemptionBudgetSpent, match="preempted 2 times, more than the 1 restarts"):
        backend.run(batch, pool="h100", queue="vision", secret_env=batch.env, admission_timeout_s=60, poll_s=0.02,
                    sleep=tick)
    [(waiting, pods)] = seen
    assert waiting.phase == PENDING and waiting.retries == 1 and pods == []
    assert waiting.message.startswith("evicted by Kueue (Preempted: Preempted to accommodate a workload")
    assert not sim.jobs and not sim.pods  # stopped (deleted): it holds no GPUs
    kubelet.step()  # the deleted pods' workers get SIGTERM
    assert [code for _, code in kubelet.exits] == [75] * 12  # each time, every rank checkpointed


def test_an_application_error_fails_the_job_at_once_and_spends_no_preemption_budget(cluster, tmp_path):
    """A worker that exits 3 is a bug, not a preemption: the Job fails at once (Volcano's TerminateJob,
    Kueue's FailJob rule), nothing restarts, and the error is GangFailed, which Airflow retries."""
    scheduler, sim, kubelet, script = cluster
    gang = _gang("buggy", 4, "batch", 60, tmp_path, FAIL_RANK="2")
    backend = _backend(scheduler, script, max_retry=3)
    with pytest.raises(GangFailed) as failed:
        backend.run(gang, pool="h100", queue="vision", secret_env=gang.env, admission_timeout_s=60, poll_s=0.02,
                    sleep=lambda s: (kubelet.step(), time.sleep(s)))
    assert not isinstance(failed.value, PreemptionBudgetSpent)
    assert failed.value.rank == 2 and failed.value.exit_code == 3
    assert backend.status(gang.name).retries == 0  # no preemption budget spent
    assert len(kubelet.started) == 4  # started once: no restart
    if scheduler == "volcano":
        stored = sim.vcjobs[(NS, gang.name)]["status"]
        assert stored["retryCount"] == 0 and stored["state"]["phase"] == "Terminated"
    else:
        [condition] = sim.jobs[(NS, gang.name)]["status"]["conditions"]
        assert (condition["type"], condition["reason"]) == ("Failed", "PodFailurePolicy")
        assert "schedulingStats" not in workload_of(sim, NS, gang.name)["status"]
