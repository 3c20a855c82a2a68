"""Preemption and failures with the gang's code really running (the node agent runs the pods of node
``run-0`` as processes) and every decision the real controllers': Kueue evicts a batch gang for a
critical one (its Job suspended, its pods deleted with a grace period: each worker checkpoints on
SIGTERM and exits 75), the Job's podFailurePolicy ignores those exits, and the readmitted gang
resumes; a worker's application error fails the Job at once through the FailJob rule, spending no
preemption budget. The preemption budget is counted by the backend from the real Workload."""

from __future__ import annotations

import sys
import time

import pytest
from tests.k8s_real.conftest import real_cluster, until
from tests.support.gang_worker import WORKER

from hybridflow.backends.errors import PreemptionBudgetSpent
from hybridflow.backends.k8s.backend import SUCCEEDED, KubernetesGangBackend
from hybridflow.backends.k8s.manifests import gang_job_name
from hybridflow.backends.local import GangFailed, GangJob


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    work = tmp_path / "work"
    work.mkdir()
    return script, work


def _gang(run: str, workers: int, priority: str, run_s: float, work, resume_s: float = 1, **env: str) -> GangJob:
    name = gang_job_name("train_model", f"manual__{run}", "train", "k8s-real", readable=f"train-{run}")
    return GangJob(name=name, workers=workers, spec={"run_key": run}, labels={"team": "vision", "priority": priority},
                   env={"WORK_DIR": str(work), "RUN_S": str(run_s), "RESUME_S": str(resume_s), **env})


def _backend(ns: str, script, max_retry: int, scheduler: str = "kueue") -> KubernetesGangBackend:
    # grace_s 5: the pods' terminationGracePeriodSeconds is 15, time enough for the SIGTERM checkpoint
    return KubernetesGangBackend(real_cluster(scheduler, ns, pool="run"), image="registry.local/hybridflow-train:1",
                                 command=(sys.executable, str(script)), max_retry=max_retry, grace_s=5,
                                 read_timeout_s=10, cache_s=0)


def _ends(agent, gang: str, since: int = 0) -> list[int]:
    """Exit codes of gang's containers, of those the (session's) node agent saw end after ``since``."""
    return [code for pod, code in agent.exits[since:] if pod.startswith(gang)]


@pytest.mark.parametrize("scheduler", ["kueue", "volcano"])
def test_a_critical_gang_evicts_a_batch_gang_which_resumes_from_its_checkpoint(real, agent, worker, scheduler):
    script, work = worker
    if scheduler == "kueue":
        real.kueue_queues({"vision": 8}, preemption="LowerPriority")
    else:
        real.volcano_queue("vision")
    backend = _backend(real.ns, script, max_retry=1 if scheduler == "kueue" else 2, scheduler=scheduler)
    seen = len(agent.exits)
    batch, critical = _gang("batch", 6, "batch", 60, work), _gang("urgent", 4, "critical", 1, work)
    backend.submit_spec(backend.gang_spec(batch, pool="run", queue="vision"), batch.env)
    until(lambda: len(list(work.glob(f"{batch.name}-*.ready"))) == 6, 90, "every batch rank at work")
    backend.submit_spec(backend.gang_spec(critical, pool="run", queue="vision"), critical.env)

    status = backend.run(batch, pool="run", queue="vision", admission_timeout_s=120, poll_s=0.5)
    # One preemption, one restart, on either scheduler: a restarted Volcano gang's pods reuse their names,
    # and nothing may count an ended pod's exit against its namesake (docs/kubernetes.md).
    assert status.phase == SUCCEEDED and status.retries == 1
    assert backend.status(critical.name).phase == SUCCEEDED
    ends = _ends(agent, batch.name, seen)
    assert ends.count(0) == 6 and ends.count(75) >= 6 and set(ends) == {0, 75}  # checkpointed on SIGTERM, then done
    assert len(list(work.glob(f"{batch.name}-*.resumed"))) == 6  # and every rank resumed
    if scheduler == "kueue":
        job = real.batch().read_namespaced_job(batch.name, real.ns)
        assert not job.status.failed and [c.type for c in job.status.conditions if c.status == "True"] == [
            "SuccessCriteriaMet", "Complete"]
    else:
        job = real.custom().get_namespaced_custom_object("batch.volcano.sh", "v1alpha1", real.ns, "jobs", batch.name)
        assert job["status"]["retryCount"] == status.retries and job["status"]["state"]["phase"] == "Completed"


def test_a_second_eviction_past_the_budget_stops_the_gang(real, agent, worker):
    script, work = worker
    real.kueue_queues({"vision": 8}, preemption="LowerPriority")
    backend = _backend(real.ns, script, max_retry=0)
    batch, critical = _gang("batch", 6, "batch", 60, work, resume_s=60), _gang("urgent", 4, "critical", 1, work)
    backend.submit_spec(backend.gang_spec(batch, pool="run", queue="vision"), batch.env)
    until(lambda: len(list(work.glob(f"{batch.name}-*.ready"))) == 6, 90, "every batch rank at work")
    backend.submit_spec(backend.gang_spec(critical, pool="run", queue="vision"), critical.env)
    with pytest.raises(PreemptionBudgetSpent, match="preempted 1 times, more than the 0 restarts"):
        backend.run(batch, pool="run", queue="vision", admission_timeout_s=120, poll_s=0.5)
    until(lambda: real.pods(batch.name) == [], 60, "the stopped gang's pods to be gone")


def test_an_application_error_fails_the_job_at_once_and_spends_no_preemption_budget(real, agent, worker):
    script, work = worker
    real.kueue_queues({"vision": 8})
    backend = _backend(real.ns, script, max_retry=3)
    gang = _gang("buggy", 4, "batch", 60, work, FAIL_RANK="2")
    started, began = len(agent.started), time.monotonic()
    with pytest.raises(GangFailed) as failed:
        backend.run(gang, pool="run", queue="vision", admission_timeout_s=60, poll_s=0.5)
    assert not isinstance(failed.value, PreemptionBudgetSpent)
    assert failed.value.rank == 2 and failed.value.exit_code == 3
    assert time.monotonic() - began < 60  # at once, not after the other ranks' 60 s
    assert backend.status(gang.name).retries == 0
    # The Job controller marks the Job FailureTarget at once (what the backend acts on) and Failed only
    # once the other ranks' pods have terminated.
    def failed_reason():
        job = real.batch().read_namespaced_job(gang.name, real.ns)
        return next((c.reason for c in job.status.conditions or [] if c.type == "Failed" and c.status == "True"), None)

    assert until(failed_reason, 60, "the Job to be marked Failed") == "PodFailurePolicy"
    assert len([p for p in agent.started[started:] if p.startswith(gang.name)]) == 4  # started once: no restart
